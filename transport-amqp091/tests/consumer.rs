//! The whole consumer on the real RabbitMQ: the driver, the engine and this transport.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use retry_core::{
    DeadLetterReason, HandlerError, HeaderValue, Message, ParkedRecord, QueueType, RetryPolicy,
    Terminal, TopologyPlan, Transport, headers,
};
use test_brokers::rabbitmq::{redeclare, refusing};
use transport_amqp091::AmqpTransport;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Counts runs per message id.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, u32>>>);

impl Runs {
    fn next(&self, msg: &Message) -> u32 {
        let id = msg.properties().message_id.clone().unwrap_or_default();
        let mut m = self.0.lock().unwrap();
        let n = m.entry(id).or_default();
        *n += 1;
        *n
    }
}

async fn setup(
    test: &str,
    policy: &RetryPolicy,
) -> Option<(
    Arc<AmqpTransport>,
    String,
    TopologyPlan,
    lapin::Connection,
    lapin::Channel,
)> {
    let config = broker(test).await?;
    let q = unique(test);
    let plan = TopologyPlan::new(&q, policy).unwrap();
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (conn, ch) = raw().await;
    Some((t, q, plan, conn, ch))
}

#[tokio::test]
async fn a_message_that_succeeds_is_acked() {
    let policy = RetryPolicy::delays([ms(500)]).build().unwrap();
    let Some((t, q, plan, _c, ch)) = setup("success", &policy).await else {
        return;
    };
    publish(&ch, &q, b"hello", "ok-1").await;
    let running = start(
        Arc::clone(&t),
        policy,
        |_m: Message| async { Ok::<(), HandlerError>(()) },
        &q,
        |b| b,
    );
    assert!(running.until(ms(10_000), |t| !t.is_empty()).await);
    let report = running.stop().await;
    assert_eq!(report.handled, 1);
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
    assert_eq!(message_count(&ch, plan.parking_queue()).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn a_transient_failure_comes_back_after_the_real_ttl_and_succeeds() {
    let policy = RetryPolicy::delays([ms(1_000)]).build().unwrap();
    let Some((t, q, plan, _c, ch)) = setup("transient", &policy).await else {
        return;
    };
    let runs = Runs::default();
    let seen_at = Arc::new(Mutex::new(Vec::<(Instant, u32, u32)>::new()));
    let (r, s) = (runs.clone(), Arc::clone(&seen_at));
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            let n = r.next(&m);
            let deaths = match m.headers().get("x-death") {
                Some(HeaderValue::Array(a)) => a.len() as u32,
                _ => 0,
            };
            s.lock().unwrap().push((Instant::now(), n, deaths));
            async move {
                if n == 1 {
                    Err(HandlerError::transient("downstream timeout"))
                } else {
                    Ok(())
                }
            }
        },
        &q,
        |b| b,
    );
    publish(&ch, &q, b"payload", "t-1").await;
    assert!(running.until(ms(15_000), |t| t.len() == 2).await);
    let terminals = running.of("t-1");
    assert_eq!(
        terminals,
        [
            Terminal::Retried {
                attempts: 1,
                delay: ms(1_000)
            },
            Terminal::Handled { attempt: 2 }
        ]
    );
    let seen = seen_at.lock().unwrap().clone();
    // The second run came through the delay queue (the broker's x-death says so) and not
    // before its TTL.
    assert_eq!(seen[1].1, 2);
    assert_eq!(seen[1].2, 1, "one x-death entry from the delay queue");
    assert!(
        seen[1].0 - seen[0].0 >= ms(950),
        "{:?}",
        seen[1].0 - seen[0].0
    );
    running.stop().await;
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn used_up_attempts_park_the_message_with_diagnostics() {
    let policy = RetryPolicy::delays([ms(200), ms(400)]).build().unwrap();
    let Some((t, q, plan, _c, ch)) = setup("exhausted", &policy).await else {
        return;
    };
    let running = start(
        Arc::clone(&t),
        policy,
        |m: Message| async move {
            Err::<(), _>(HandlerError::transient(format!(
                "attempt {} failed",
                m.attempt()
            )))
        },
        &q,
        |b| b,
    );
    let before = retry_core::Timestamp::from_system_time(std::time::SystemTime::now());
    publish(&ch, &q, b"\x00\x01poison", "x-1").await;
    let parked = wait_get(&ch, plan.parking_queue(), ms(15_000))
        .await
        .unwrap();
    running.stop().await;
    assert_eq!(parked.body, b"\x00\x01poison");
    assert_eq!(parked.message_id.as_deref(), Some("x-1"));
    let record = ParkedRecord::decode(&parked.headers);
    assert_eq!(record.reason, Some(DeadLetterReason::AttemptsExhausted));
    assert_eq!(record.attempts, 3);
    assert_eq!(record.crashes, 0);
    assert_eq!(record.last_error, Some("attempt 3 failed"));
    assert_eq!(record.origin_queue, Some(q.as_str()));
    assert_eq!(record.origin_exchange, Some(""));
    assert_eq!(record.origin_routing_key, Some(q.as_str()));
    let first = record.first_failure.unwrap();
    let last = record.last_failure.unwrap();
    assert!(first >= before && last >= first);
    assert!(record.malformed.is_empty());
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn a_permanent_failure_is_parked_at_once() {
    let policy = RetryPolicy::delays([ms(200)]).build().unwrap();
    let Some((t, q, plan, _c, ch)) = setup("permanent", &policy).await else {
        return;
    };
    let runs = Runs::default();
    let r = runs.clone();
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            r.next(&m);
            async { Err::<(), _>(HandlerError::permanent("schema mismatch")) }
        },
        &q,
        |b| b,
    );
    publish(&ch, &q, b"{}", "p-1").await;
    let parked = wait_get(&ch, plan.parking_queue(), ms(10_000))
        .await
        .unwrap();
    running.stop().await;
    let record = ParkedRecord::decode(&parked.headers);
    assert_eq!(record.reason, Some(DeadLetterReason::Permanent));
    assert_eq!(record.attempts, 1);
    assert_eq!(record.last_error, Some("schema mismatch"));
    assert_eq!(runs.0.lock().unwrap()["p-1"], 1);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn a_delivery_held_by_a_closed_connection_comes_back_a_suspect_and_runs_alone() {
    let policy = RetryPolicy::delays([ms(300)]).build().unwrap();
    let Some(config) = broker("crash").await else {
        return;
    };
    let name = config.connection_name().unwrap().to_owned();
    let q = unique("crash");
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (_c, ch) = raw().await;
    let runs = Runs::default();
    let release = Arc::new(tokio::sync::Notify::new());
    let (r, gate) = (runs.clone(), Arc::clone(&release));
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            let n = r.next(&m);
            let gate = Arc::clone(&gate);
            async move {
                if n == 1 {
                    // Still handling when the connection goes away.
                    gate.notified().await;
                }
                Ok::<(), HandlerError>(())
            }
        },
        &q,
        |b| b.with_suspect_poll(ms(200)),
    );
    publish(&ch, &q, b"held", "c-1").await;
    let started = {
        let deadline = Instant::now() + ms(10_000);
        loop {
            if runs.0.lock().unwrap().get("c-1") == Some(&1) {
                break true;
            }
            if Instant::now() > deadline {
                break false;
            }
            tokio::time::sleep(ms(20)).await;
        }
    };
    assert!(started);
    assert_eq!(close_connection(&name).await, 1);
    // The broker gives the delivery back, flagged: a suspect, isolated without a run.
    assert!(
        running
            .until(ms(20_000), |t| t
                .iter()
                .any(|(_, t)| *t == Terminal::Isolated))
            .await
    );
    // It runs alone only once the first run, still going, has finished.
    assert_eq!(runs.0.lock().unwrap()["c-1"], 1);
    release.notify_waiters();
    assert!(
        running
            .until(ms(20_000), |t| t
                .iter()
                .any(|(_, t)| matches!(t, Terminal::Handled { .. })))
            .await
    );
    let report = running.stop().await;
    assert_eq!(runs.0.lock().unwrap()["c-1"], 2);
    assert_eq!((report.suspects, report.diverted), (1, 0));
    assert_eq!(
        report.settle_errors, 1,
        "the first run's ack found its channel gone"
    );
    assert!(recoveries_reaching(&t, 1).await >= 1);
    assert_nothing_left_once_closed(&t, &ch, &plan).await;
    transport(&config).await.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn a_publish_refused_every_time_requeues_once_then_runs_as_a_suspect_uncounted() {
    let policy = RetryPolicy::delays([ms(300)])
        .with_publish_retries(2, ms(50))
        .build()
        .unwrap();
    let Some((t, q, plan, _c, ch)) = setup("refused", &policy).await else {
        return;
    };
    // Replace the delay queue by a full one that refuses publishes.
    let delay_queue = format!("{q}.retry.300ms");
    redeclare(&ch, &plan, &delay_queue, refusing).await.unwrap();
    let runs = Runs::default();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (r, s) = (runs.clone(), Arc::clone(&seen));
    let running = start(
        Arc::clone(&t),
        policy.clone(),
        move |m: Message| {
            let n = r.next(&m);
            s.lock().unwrap().push((
                m.headers().get(headers::SUSPECT).is_some(),
                ParkedRecord::decode(m.headers()).crashes,
            ));
            async move {
                match n {
                    1 => Err(HandlerError::transient("down")),
                    _ => Ok(()),
                }
            }
        },
        &q,
        |b| b.with_provision(false).with_suspect_poll(ms(200)),
    );
    publish(&ch, &q, b"keep me", "r-1").await;
    let handled = running
        .until(ms(20_000), |t| {
            t.iter().any(|(_, t)| matches!(t, Terminal::Handled { .. }))
        })
        .await;
    assert!(handled, "{:?}", running.terminals.lock().unwrap());
    assert_eq!(
        running.of("r-1"),
        [
            Terminal::Requeued {
                cause: retry_core::Confirm::Nack
            },
            Terminal::Isolated,
            Terminal::Handled { attempt: 1 }
        ]
    );
    let report = running.stop().await;
    assert_eq!(report.diverted + report.dead_lettered + report.retried, 0);
    // The solo run, of the suspect's copy, saw no crash recorded on the message.
    assert_eq!(*seen.lock().unwrap(), [(false, 0), (true, 0)]);
    (*t).close().await.unwrap();
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
    assert_eq!(message_count(&ch, &delay_queue).await.unwrap(), 0);
    let config = broker("refused-teardown").await.unwrap();
    transport(&config).await.teardown(&plan).await.unwrap();
}

fn quorum(p: retry_core::TopologyBuilder<'_>) -> retry_core::TopologyBuilder<'_> {
    p.with_queue_type(QueueType::Quorum).with_delivery_limit(10)
}

#[tokio::test]
async fn quorum_redelivery_counts_make_a_suspect_and_the_broker_limit_backs_up() {
    let Some(config) = broker("quorum").await else {
        return;
    };
    let t = Arc::new(transport(&config).await);
    let (_c, ch) = raw().await;
    // Returns the message to its queue `n` times, as crashing consumers would.
    async fn crash(ch: &lapin::Channel, q: &str, n: u32) {
        for _ in 0..n {
            let msg = loop {
                if let Some(m) = ch
                    .basic_get(q.into(), lapin::options::BasicGetOptions { no_ack: false })
                    .await
                    .unwrap()
                {
                    break m;
                }
                tokio::time::sleep(ms(20)).await;
            };
            msg.delivery
                .nack(lapin::options::BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await
                .unwrap();
        }
    }

    // 1. Returned twice (x-delivery-count 2): a suspect like any redelivery, run alone and
    // handled, with no crash counted.
    let policy = RetryPolicy::delays([ms(300)])
        .with_crash_limit(1)
        .build()
        .unwrap();
    let q = unique("quorum-engine");
    let plan = quorum(TopologyPlan::builder(&q, &policy)).build().unwrap();
    t.provision(&plan).await.unwrap();
    publish(&ch, &q, b"q", "q-1").await;
    crash(&ch, &q, 2).await;
    let count = Arc::new(Mutex::new(None));
    let c = Arc::clone(&count);
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            *c.lock().unwrap() = Some((
                m.queue().to_owned(),
                m.headers().get("x-delivery-count").cloned(),
            ));
            async { Ok::<(), HandlerError>(()) }
        },
        &q,
        |b| b.with_provision(false).with_topology(quorum),
    );
    assert!(running.until(ms(10_000), |t| t.len() == 2).await);
    assert_eq!(
        running.of("q-1"),
        [Terminal::Isolated, Terminal::Handled { attempt: 1 }]
    );
    running.stop().await;
    let (queue, delivery_count) = count.lock().unwrap().clone().unwrap();
    assert_eq!(
        queue,
        plan.isolation_queue(),
        "it ran from the isolation queue"
    );
    // A fresh copy: RabbitMQ 3.10 counts no return (it sends 0 on a basic.get).
    assert!(
        matches!(delivery_count, None | Some(HeaderValue::Int(0))),
        "{delivery_count:?}"
    );
    assert_eq!(message_count(&ch, plan.parking_queue()).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();

    // 2. The broker's delivery limit (1) stays a backstop: returned past it, RabbitMQ itself
    // dead-letters the message into the parking queue, and x-death says why.
    let policy = RetryPolicy::delays([ms(300)])
        .with_crash_limit(5)
        .build()
        .unwrap();
    let q = unique("quorum-broker");
    let plan = TopologyPlan::builder(&q, &policy)
        .with_queue_type(QueueType::Quorum)
        .with_delivery_limit(1)
        .build()
        .unwrap();
    t.provision(&plan).await.unwrap();
    publish(&ch, &q, b"q", "q-2").await;
    crash(&ch, &q, 2).await;
    let parked = wait_get(&ch, plan.parking_queue(), ms(10_000))
        .await
        .unwrap();
    let Some(HeaderValue::Array(deaths)) = parked.headers.get("x-death") else {
        panic!("no x-death: {:?}", parked.headers)
    };
    let HeaderValue::Table(death) = &deaths[0] else {
        panic!()
    };
    assert_eq!(
        death.get("reason"),
        Some(&HeaderValue::from("delivery_limit"))
    );
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn consuming_recovers_after_a_forced_close_and_nothing_is_lost() {
    let policy = RetryPolicy::delays([ms(300)]).build().unwrap();
    let Some(config) = broker("recover-e2e").await else {
        return;
    };
    let name = config.connection_name().unwrap().to_owned();
    let q = unique("recover-e2e");
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (_c, ch) = raw().await;
    let handled = Arc::new(AtomicU32::new(0));
    let h = Arc::clone(&handled);
    let running = start(
        Arc::clone(&t),
        policy,
        move |_m: Message| {
            h.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        },
        &q,
        |b| b,
    );
    for i in 0..20 {
        publish(&ch, &q, b"before", &format!("a-{i}")).await;
    }
    assert!(running.until(ms(10_000), |t| t.len() >= 20).await);
    assert_eq!(close_connection(&name).await, 1);
    for i in 0..20 {
        publish(&ch, &q, b"after", &format!("b-{i}")).await;
    }
    let all_handled = running
        .until(ms(30_000), |t| {
            (0..20).all(|i| {
                t.iter()
                    .any(|(id, t)| id == &format!("b-{i}") && matches!(t, Terminal::Handled { .. }))
            })
        })
        .await;
    running.stop().await;
    assert!(
        all_handled,
        "every message published after the drop was handled"
    );
    assert_eq!(recoveries_reaching(&t, 1).await, 1);
    assert_nothing_left_once_closed(&t, &ch, &plan).await;
    transport(&config).await.teardown(&plan).await.unwrap();
}

/// Closes `t`, which returns whatever it never acked, then finds the work, isolation and
/// parking queues empty.
async fn assert_nothing_left_once_closed(
    t: &AmqpTransport,
    ch: &lapin::Channel,
    plan: &TopologyPlan,
) {
    t.close().await.unwrap();
    for queue in [
        plan.work_queue(),
        plan.isolation_queue(),
        plan.parking_queue(),
    ] {
        assert_eq!(message_count(ch, queue).await.unwrap(), 0, "{queue}");
    }
}

#[tokio::test]
async fn a_graceful_shutdown_mid_handler_sends_every_ack_before_run_returns() {
    // 25 messages: prefetch 15 holds 15 and acks go in batches of 7, so the last ack is
    // never part of a full batch; 10 stay in the queue. Shutdown comes while the 300 ms
    // handlers run.
    const N: usize = 25;
    let policy = RetryPolicy::delays([ms(300)]).build().unwrap();
    let Some(config) = broker("shutdown").await else {
        return;
    };
    // No timer sends acks behind the consumer's back: what reaches the broker is what the
    // consumer sent before `run` returned (its subscription's channel closes as it returns).
    let config = config.with_ack_flush_interval(Duration::from_secs(3600));
    let q = unique("shutdown");
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = Arc::new(transport(&config).await);
    t.provision(&plan).await.unwrap();
    let (_c, ch) = raw().await;
    for i in 0..N {
        publish(&ch, &q, b"slow", &format!("s-{i:02}")).await;
    }
    let started = Arc::new(AtomicU32::new(0));
    let s = Arc::clone(&started);
    let running = start(
        Arc::clone(&t),
        policy,
        move |_m: Message| {
            s.fetch_add(1, Ordering::SeqCst);
            async {
                tokio::time::sleep(ms(300)).await;
                Ok::<(), HandlerError>(())
            }
        },
        &q,
        |b| b.with_prefetch(15),
    );
    let deadline = Instant::now() + ms(10_000);
    while started.load(Ordering::SeqCst) < 15 && Instant::now() < deadline {
        tokio::time::sleep(ms(10)).await;
    }
    let handled: Vec<String> = {
        let terminals = Arc::clone(&running.terminals);
        let report = running.stop().await;
        assert_eq!(report.handled, 15, "{report:?}");
        assert_eq!(report.left_unsettled, 0);
        let t = terminals.lock().unwrap();
        t.iter()
            .filter(|(_, t)| matches!(t, Terminal::Handled { .. }))
            .map(|(id, _)| id.clone())
            .collect()
    };
    // `run` has returned and the transport is still open: had any ack stayed batched, its
    // message would still be unacknowledged here.
    tokio::time::sleep(ms(300)).await;
    assert_eq!(ready_and_unacked(&q).await, ((N - handled.len()) as u64, 0));
    (*t).close().await.unwrap();
    assert_eq!(ready_and_unacked(&q).await, ((N - handled.len()) as u64, 0));
    let mut left = Vec::new();
    while let Some(got) = get(&ch, &q).await {
        left.push(got.message_id.unwrap());
    }
    assert_eq!(left.len(), N - handled.len());
    assert!(
        left.iter().all(|id| !handled.contains(id)),
        "handled messages still in the queue: {left:?}"
    );
    transport(&broker("shutdown-teardown").await.unwrap())
        .await
        .teardown(&plan)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_forwarded_delivery_count_on_a_classic_queue_is_not_crash_evidence() {
    // A shovel or a forwarding application copied a quorum queue's x-delivery-count.
    let policy = RetryPolicy::delays([ms(500)]).build().unwrap();
    let Some((t, q, plan, _c, ch)) = setup("forged-count", &policy).await else {
        return;
    };
    let mut headers = lapin::types::FieldTable::default();
    headers.insert(
        "x-delivery-count".into(),
        lapin::types::AMQPValue::LongInt(4),
    );
    ch.basic_publish(
        "".into(),
        q.as_str().into(),
        lapin::options::BasicPublishOptions::default(),
        b"forwarded",
        lapin::BasicProperties::default()
            .with_message_id("forged-1".into())
            .with_delivery_mode(2)
            .with_headers(headers),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let runs = Runs::default();
    let r = runs.clone();
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            r.next(&m);
            async { Ok::<(), HandlerError>(()) }
        },
        &q,
        |b| b,
    );
    assert!(running.until(ms(10_000), |t| !t.is_empty()).await);
    assert_eq!(running.of("forged-1"), [Terminal::Handled { attempt: 1 }]);
    let report = running.stop().await;
    assert_eq!((report.handled, report.isolated), (1, 0));
    assert_eq!(runs.0.lock().unwrap()["forged-1"], 1);
    assert_eq!(message_count(&ch, plan.isolation_queue()).await.unwrap(), 0);
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn two_consumers_on_one_transport_each_see_and_settle_only_their_own_queue() {
    const A: usize = 50;
    const B: usize = 20;
    let policy = RetryPolicy::delays([ms(500)]).build().unwrap();
    let Some((t, a, plan_a, _c, ch)) = setup("two-a", &policy).await else {
        return;
    };
    let b = unique("two-b");
    let plan_b = TopologyPlan::new(&b, &policy).unwrap();
    t.provision(&plan_b).await.unwrap();
    for i in 0..A {
        publish(&ch, &a, b"a", &format!("a-{i:02}")).await;
    }
    for i in 0..B {
        publish(&ch, &b, b"b", &format!("b-{i:02}")).await;
    }
    // Which queue's messages each handler was given.
    let seen = |prefix: &'static str, wait: u64| {
        let strangers = Arc::new(Mutex::new(Vec::<String>::new()));
        let s = Arc::clone(&strangers);
        let handler = move |m: Message| {
            let id = m.properties().message_id.clone().unwrap_or_default();
            if !id.starts_with(prefix) {
                s.lock().unwrap().push(id);
            }
            async move {
                tokio::time::sleep(ms(wait)).await;
                Ok::<(), HandlerError>(())
            }
        };
        (handler, strangers)
    };
    let (slow, strangers_a) = seen("a-", 100);
    let running_a = start(Arc::clone(&t), policy.clone(), slow, &a, |b| b);
    // The second consumer starts while the first holds a full prefetch window.
    assert!(running_a.until(ms(10_000), |t| t.len() >= 5).await);
    let (quick, strangers_b) = seen("b-", 0);
    let running_b = start(Arc::clone(&t), policy, quick, &b, |b| b);
    assert!(running_b.until(ms(10_000), |t| t.len() == B).await);
    let report_b = running_b.stop().await;
    let report_a = running_a.stop().await;
    (*t).close().await.unwrap();

    assert_eq!(*strangers_a.lock().unwrap(), Vec::<String>::new());
    assert_eq!(*strangers_b.lock().unwrap(), Vec::<String>::new());
    assert_eq!((report_b.handled, report_b.left_unsettled), (B as u64, 0));
    // Nothing of A was lost or settled by B's acks: what A did not handle is still ready.
    let (ready, unacked) = ready_and_unacked_settled(&a).await;
    let parked = ready_and_unacked(plan_a.parking_queue()).await;
    assert_eq!(unacked, 0);
    assert_eq!(parked, (0, 0));
    assert!(
        report_a.handled < A as u64,
        "A was meant to be stopped mid-run"
    );
    assert_eq!(report_a.handled + ready, A as u64, "{report_a:?}");
    assert_eq!(ready_and_unacked(&b).await, (0, 0));
    let teardown = transport(&broker("two-teardown").await.unwrap()).await;
    teardown.teardown(&plan_a).await.unwrap();
    teardown.teardown(&plan_b).await.unwrap();
}
