//! Running a consumer beside the scenario that watches it, on any harness's clock.

use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::{self, Either};
use retry_core::{Consumer, Handler, RunReport, Transport};

use crate::harness::{Harness, Timing};

/// How often a scenario looks at what its consumer did. On a virtual clock this is also
/// how far time moves between looks when nothing else is due.
pub const POLL_EVERY: Duration = Duration::from_millis(10);

/// Stops or kills the consumer a scenario runs beside.
#[derive(Clone, Debug, Default)]
pub struct Control {
    senders: Arc<Mutex<Senders>>,
}

#[derive(Debug, Default)]
struct Senders {
    stop: Option<oneshot::Sender<()>>,
    kill: Option<oneshot::Sender<()>>,
}

impl Control {
    /// Asks the consumer to shut down: it finishes what it holds within its grace.
    pub fn stop(&self) {
        if let Some(tx) = self.lock().stop.take() {
            let _ = tx.send(());
        }
    }

    /// Drops the consumer's future where it stands, as a process crash would; nothing it
    /// holds is settled. Crash its connection afterwards with [`Harness::crash`].
    pub fn kill(&self) {
        if let Some(tx) = self.lock().kill.take() {
            let _ = tx.send(());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Senders> {
        self.senders.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How a consumer run ended.
#[derive(Debug)]
pub enum Ended {
    /// It was stopped and returned its report.
    Stopped(RunReport),
    /// It was killed.
    Killed,
}

impl Ended {
    /// The report of a stopped consumer; panics if it was killed.
    pub fn report(self) -> RunReport {
        match self {
            Ended::Stopped(report) => report,
            Ended::Killed => panic!("the consumer was killed, it has no report"),
        }
    }
}

/// Runs `consumer` while `watch` runs; `watch` gets the [`Control`] to stop or kill it. When
/// `watch` returns without having done either, the consumer is stopped. Panics if the
/// consumer fails.
pub async fn drive<T, H, F, Fut>(consumer: Consumer<T, H>, watch: F) -> (Ended, Fut::Output)
where
    T: Transport,
    H: Handler,
    F: FnOnce(Control) -> Fut,
    Fut: Future,
{
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (kill_tx, kill_rx) = oneshot::channel::<()>();
    let control = Control {
        senders: Arc::new(Mutex::new(Senders {
            stop: Some(stop_tx),
            kill: Some(kill_tx),
        })),
    };
    let run = async move {
        let stopped = async move {
            let _ = stop_rx.await;
        };
        let killed = async move {
            // A kill sender dropped unused must not count as a kill.
            if kill_rx.await.is_err() {
                future::pending::<()>().await;
            }
        };
        match future::select(pin!(consumer.run(stopped)), pin!(killed)).await {
            Either::Left((Ok(report), _)) => Ended::Stopped(report),
            Either::Left((Err(e), _)) => panic!("the consumer failed: {e}"),
            Either::Right(((), _)) => Ended::Killed,
        }
    };
    let watcher = control.clone();
    let watching = async move {
        let out = watch(watcher.clone()).await;
        watcher.stop();
        out
    };
    future::join(run, watching).await
}

/// Waits on the harness's clock until `done` holds, looking every [`POLL_EVERY`]; panics
/// with `what` if it does not within `within`.
pub async fn wait_until<H: Harness>(
    h: &H,
    within: Duration,
    what: impl Fn() -> String,
    done: impl Fn() -> bool,
) {
    let clock = h.stopwatch();
    let deadline = clock.elapsed() + within;
    loop {
        if done() {
            return;
        }
        if clock.elapsed() >= deadline {
            panic!("not within {within:?}: {}", what());
        }
        h.sleep(POLL_EVERY).await;
    }
}

/// Checks that `waited` honours `delay` under the harness's timing: exactly on a virtual
/// clock, at least `delay - slack` on the wall clock. `what` names the wait in the panic.
pub fn assert_waited(timing: Timing, what: &str, waited: Duration, delay: Duration) {
    match timing {
        Timing::Virtual => assert_eq!(
            waited, delay,
            "{what}: waited {waited:?} of virtual time, the policy says {delay:?}"
        ),
        Timing::Wall { slack } => assert!(
            waited + slack >= delay,
            "{what}: came back after {waited:?}, before the {delay:?} delay (slack {slack:?})"
        ),
    }
}
