//! Ours: the retry consumer on a [`Subject`]'s concrete transport, one generic function per
//! measurement.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use retry_core::{
    Consumer, HandlerError, HeaderValue, Message, RetryPolicy, Terminal, Transport, headers,
};

use crate::lateness::{Clock, Lateness, Trial};
use crate::{BOUND, BoxError, Measured, Meter, Run, Subject};

/// The consumer on `run`'s prefilled work queue, on a transport of its own, until all `n`
/// messages have ended: handled on the success path, or (`fail`) each failing its first run
/// and cloned to the delay queue. The clock runs from just before `Consumer::run` (so it
/// includes verifying the plan, the first look at the isolation queue and subscribing) to
/// the last message's `on_terminal`; the report is checked after.
pub async fn throughput<S: Subject>(
    subject: &S,
    run: &Run<'_>,
    fail: bool,
) -> Result<Measured, BoxError> {
    let n = run.n;
    let transport = Arc::new(subject.connect().await?);
    let ended = Arc::new(AtomicU64::new(0));
    let measured = Arc::new(Mutex::new(None::<Measured>));
    let (done_tx, done_rx) = futures::channel::oneshot::channel::<()>();
    let done_tx = Mutex::new(Some(done_tx));
    let meter = Arc::new(Meter::start(S::SERVER));
    let handler = {
        let meter = Arc::clone(&meter);
        move |m: Message| {
            meter.first();
            async move {
                if fail && m.attempt() == 1 {
                    Err(HandlerError::transient("the first run fails"))
                } else {
                    Ok(())
                }
            }
        }
    };
    let consumer = Consumer::builder(
        Arc::clone(&transport),
        run.queue(),
        run.policy.clone(),
        handler,
    )
    .with_prefetch(run.prefetch)
    .with_provision(false)
    .with_on_terminal({
        let (meter, measured) = (Arc::clone(&meter), Arc::clone(&measured));
        move |_, terminal| {
            let expected = if fail {
                matches!(terminal, Terminal::Retried { attempts: 1, .. })
            } else {
                matches!(terminal, Terminal::Handled { attempt: 1 })
            };
            if expected && ended.fetch_add(1, Ordering::Relaxed) + 1 == n {
                *measured.lock().unwrap() = Some(meter.stop());
                if let Some(tx) = done_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
            }
        }
    })
    .build()?;
    let shutdown = async move {
        let _ = tokio::time::timeout(BOUND, done_rx).await;
    };
    let report = consumer.run(shutdown).await;
    Transport::close(&*transport).await;
    let report = report?;
    let expected = if fail { report.retried } else { report.handled };
    if expected != n || report.accounted() != report.received {
        return Err(format!(
            "{}: the consumer did not finish all {n} messages: {report:?}",
            S::NAME
        )
        .into());
    }
    let measured = measured.lock().unwrap().take();
    measured.ok_or_else(|| "the last message never ended".into())
}

/// How late a delayed retry comes back through the consumer: `trial`'s messages are
/// published at its rate by [`Subject::publish_paced`] into the work queue while a consumer
/// (on a transport of its own, at the trial's prefetch, not provisioning) runs with a
/// handler that fails each message's first run, noting the time on a [`Clock`], and
/// succeeds its second, due after the delay the engine gave the clone (its
/// `x-retry-delay` header; the policy's first level if absent). The consumer stops once
/// every message has been handled; its report is checked after.
pub async fn lateness<S: Subject>(subject: &S, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
    let (n, base) = (trial.n, trial.delay()?);
    let transport = Arc::new(subject.connect().await?);
    let clock = Arc::new(Mutex::new(Clock::default()));
    let handled = Arc::new(AtomicU64::new(0));
    // Stops the consumer: once the last message is handled, or the publisher failed.
    let stop = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let clock = Arc::clone(&clock);
        move |m: Message| {
            let id = m.properties().message_id.as_deref();
            let result = if m.attempt() == 1 {
                clock.lock().unwrap().failed(id);
                Err(HandlerError::transient("the first run fails"))
            } else {
                let delay = match m.headers().get(headers::DELAY) {
                    Some(HeaderValue::Int(ms)) => {
                        u64::try_from(*ms).map(Duration::from_millis).ok()
                    }
                    Some(HeaderValue::UInt(ms)) => Some(Duration::from_millis(*ms)),
                    _ => None,
                };
                clock.lock().unwrap().returned(id, delay.unwrap_or(base));
                Ok(())
            };
            async move { result }
        }
    };
    let consumer = Consumer::builder(
        Arc::clone(&transport),
        trial.queue(),
        trial.policy.clone(),
        handler,
    )
    .with_prefetch(trial.prefetch)
    .with_provision(false)
    .with_on_terminal({
        let stop = Arc::clone(&stop);
        move |_, terminal| {
            if matches!(terminal, Terminal::Handled { .. })
                && handled.fetch_add(1, Ordering::Relaxed) + 1 == n
            {
                stop.notify_one();
            }
        }
    })
    .build()?;
    let feed = async {
        let fed = subject
            .publish_paced(trial.queue(), trial.ids(), trial.body, trial.rate)
            .await;
        if fed.is_err() {
            stop.notify_one();
        }
        fed
    };
    let shutdown = async {
        let _ = tokio::time::timeout(BOUND, stop.notified()).await;
    };
    let (fed, report) = tokio::join!(feed, consumer.run(shutdown));
    Transport::close(&*transport).await;
    fed?;
    let report = report?;
    if report.handled != n || report.retried != n {
        return Err(format!(
            "{}: {n} messages, but the consumer reports {report:?}",
            S::NAME
        )
        .into());
    }
    let clock = std::mem::take(&mut *clock.lock().unwrap());
    Ok(clock.finish())
}

/// Time to first delivery of the consumer, on a fresh transport.
#[derive(Clone, Copy, Debug)]
pub struct FirstDelivery {
    /// From just before the transport connects to the first handler call.
    pub total: Duration,
    /// The part of it from calling `Consumer::run` (see [`first_call`]).
    pub from_run: Duration,
}

/// How long the consumer takes on `subject` from being started to its first handler call,
/// on `queue` (a declared plan's work queue, made from `policy`, holding one message):
/// from just before [`Subject::connect`] (connecting, the consumer's own look at the plan
/// (it provisions, by default, finding every queue there), its first look at the
/// isolation queue, subscribing and the delivery itself), and the part of it from
/// `Consumer::run`.
pub async fn first_delivery<S: Subject>(
    subject: &S,
    queue: &str,
    policy: &RetryPolicy,
) -> Result<FirstDelivery, BoxError> {
    let start = Instant::now();
    let transport = subject.connect().await?;
    let connected = start.elapsed();
    let from_run = first_call(transport, queue, policy).await?;
    Ok(FirstDelivery {
        total: connected + from_run,
        from_run,
    })
}

/// Runs a consumer with `policy` (defaults otherwise) on `transport` until its first
/// handler call on `queue`, and returns how long that took from `Consumer::run` being
/// called; the transport is closed after. Generic over any transport, so that the
/// in-memory one (which is no [`Subject`]) is timed by the same code.
pub async fn first_call<T: Transport>(
    transport: T,
    queue: &str,
    policy: &RetryPolicy,
) -> Result<Duration, BoxError> {
    let transport = Arc::new(transport);
    let (tx, rx) = oneshot::channel::<Instant>();
    let tx = Mutex::new(Some(tx));
    let handler = move |_: Message| {
        let at = Instant::now();
        if let Some(tx) = tx.lock().unwrap().take() {
            let _ = tx.send(at);
        }
        async { Ok::<(), HandlerError>(()) }
    };
    let consumer =
        Consumer::builder(Arc::clone(&transport), queue, policy.clone(), handler).build()?;
    let (seen_tx, seen_rx) = oneshot::channel::<Instant>();
    let start = Instant::now();
    let report = consumer
        .run(async move {
            if let Ok(at) = rx.await {
                let _ = seen_tx.send(at);
            }
        })
        .await;
    Transport::close(&*transport).await;
    report?;
    let at = seen_rx
        .await
        .map_err(|_| "the consumer stopped before a delivery")?;
    Ok(at - start)
}
