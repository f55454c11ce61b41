//! Storm control on the real RabbitMQ: a paused consumer takes nothing from the queue.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use retry_core::{
    HandlerError, Message, RetryPolicy, StormControl, StormEvent, TopologyPlan, Transport,
};

const MESSAGES: usize = 100;

#[tokio::test]
async fn a_paused_consumer_takes_nothing_until_its_probe() {
    let Some(config) = broker("storm").await else {
        return;
    };
    let q = unique("storm");
    // Clones wait a minute in the delay queue: none comes back during the test.
    let policy = RetryPolicy::delays([Duration::from_secs(60)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (_conn, ch) = raw().await;
    for i in 0..MESSAGES {
        publish(&ch, &q, b"charge", &format!("s-{i}")).await;
    }

    let down = Arc::new(AtomicBool::new(true));
    let runs = Arc::new(AtomicU64::new(0));
    let events = Arc::new(Mutex::new(Vec::<(Instant, StormEvent)>::new()));
    let (d, r, e) = (Arc::clone(&down), Arc::clone(&runs), Arc::clone(&events));
    // Long enough for two `rabbitmqctl` listings (a second or two each on a loaded machine)
    // and the wait between them to fit inside the pause.
    let cool_down = Duration::from_secs(12);
    let running = start(
        Arc::clone(&t),
        policy,
        move |_m: Message| {
            r.fetch_add(1, Ordering::SeqCst);
            let down = d.load(Ordering::SeqCst);
            async move {
                match down {
                    true => Err(HandlerError::transient("downstream refused the connection")),
                    false => Ok(()),
                }
            }
        },
        &q,
        move |b| {
            b.with_storm_control(
                StormControl::consecutive_failures(5)
                    .with_cool_down(cool_down, cool_down)
                    .with_probes(2),
            )
            .with_on_storm(move |event| e.lock().unwrap().push((Instant::now(), *event)))
        },
    );

    let paused_at = poll_until(
        Duration::from_secs(20),
        Duration::from_millis(10),
        || {
            let first = events.lock().unwrap().first().copied();
            std::future::ready(first)
        },
        Option::is_some,
    )
    .await
    .map(|(at, event)| {
        assert_eq!(event, StormEvent::Paused { cool_down });
        at
    })
    .expect("storm control paused the consumer");

    // While paused, the queue's depth and the handler's runs stay put.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (runs_before, depth_before) = (runs.load(Ordering::SeqCst), ready_and_unacked(&q).await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (runs_after, depth_after) = (runs.load(Ordering::SeqCst), ready_and_unacked(&q).await);
    assert!(
        paused_at.elapsed() < cool_down,
        "the checks ran past the cool-down; the pause was not observed whole"
    );
    assert_eq!(depth_after, depth_before, "ready and unacked while paused");
    assert_eq!(runs_after, runs_before, "handler runs while paused");
    assert!(
        depth_before.0 >= (MESSAGES - 20) as u64,
        "most messages are still ready: {depth_before:?}"
    );

    // The downstream comes back: the probe succeeds, full concurrency resumes, and every
    // message still in the work queue is handled.
    down.store(false, Ordering::SeqCst);
    let failed = runs_before as usize;
    assert!(
        running
            .until(Duration::from_secs(30), |t| t.len() == MESSAGES)
            .await,
        "every message ended: {failed} retried, the rest handled"
    );
    let report = running.stop().await;
    assert_eq!(report.retried as usize, failed);
    assert_eq!(report.handled as usize, MESSAGES - failed);
    assert_eq!((report.isolated, report.storm_pauses), (0, 1));
    let kinds: Vec<_> = events.lock().unwrap().iter().map(|(_, e)| *e).collect();
    assert!(matches!(
        kinds[..],
        [
            StormEvent::Paused { .. },
            StormEvent::Probing,
            StormEvent::Resumed { .. }
        ]
    ));
    t.teardown(&plan).await.unwrap();
}
