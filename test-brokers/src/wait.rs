//! Waiting: polling a broker until it reports what a test expects, and running a cleanup to
//! its end from synchronous code.

use std::future::Future;
use std::time::Duration;

/// Calls `probe` every `every` until what it returns is `done`, or `within` has passed;
/// returns its last answer. A broker applies settlements, deletions and the end of a
/// connection a moment after the client's call returns: tests ask again rather than sleep.
///
/// ```no_run
/// # async fn f(count: impl Fn() -> std::future::Ready<u32>) {
/// use std::time::Duration;
///
/// let (within, every) = (Duration::from_secs(5), Duration::from_millis(50));
/// let ready = test_brokers::poll_until(within, every, || count(), |n| *n == 3).await;
/// assert_eq!(ready, 3);
/// # }
/// ```
pub async fn poll_until<T, F: Future<Output = T>>(
    within: Duration,
    every: Duration,
    mut probe: impl FnMut() -> F,
    done: impl Fn(&T) -> bool,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let answer = probe().await;
        if done(&answer) || tokio::time::Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(every).await;
    }
}

/// Runs `work` to its end on a thread of its own with a runtime of its own, and returns when
/// it is done. A guard's `Drop`, which is synchronous and may run inside the test's runtime
/// (or while it unwinds from a panic), can call it. Nothing is reported: cleaning up must not
/// fail a test.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn on_own_thread<F>(work: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let running = std::thread::spawn(move || {
        if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            rt.block_on(work);
        }
    });
    let _ = running.join();
}
