//! One message with a header block async-nats cannot take, among 240 good ones, must not stop
//! a consumer: it is parked `malformed` with its bytes, every good message is handled, and it
//! costs at most one lost connection (one row per block of issue 42's table, and the blocks
//! found since: a bare carriage return in a value, a stored status). Odd blocks that
//! async-nats does take are handled like any other message. Also: a consumer that starts
//! after a process died holding such a message parks it without losing a connection; a
//! queue of no known plan keeps it in place; a walk hands it out with its bytes. Published
//! with [`RawPublisher`], since async-nats cannot write them; against the local NATS server
//! (`NATS_URL`), skipped loudly without one unless `REQUIRE_NATS` is set.

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use retry_core::{
    Consumer, HandlerError, HeaderValue, Message, RetryPolicy, SoloGate, TopologyPlan, Transport,
    headers,
};
use test_brokers::nats::{RawPublisher, header_block};
use test_brokers::nats_url;
use transport_nats::testing;
use transport_nats::{HEADER_BLOCK_HEADER, NatsTransport, UNDECODABLE_HEADER, stream_name};

const GOOD: usize = 240;
/// Long enough for every wait here on a loaded machine; a passing run takes seconds.
const DEADLINE: Duration = Duration::from_secs(90);

fn unique(what: &str) -> String {
    test_brokers::unique(&format!("tn-hostile-{what}"))
}

/// What the odd message is expected to become.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Expect {
    /// Handled like the good ones; no connection lost.
    Handled,
    /// Handled, or parked by the engine's decision: either way not lost.
    HandledOrParkedByTheEngine,
    /// Parked `malformed` by the transport with its bytes, at the cost of at most one
    /// connection.
    Quarantined,
}

async fn wait_until(
    what: &str,
    mut done: impl AsyncFnMut() -> bool,
    explain: impl AsyncFn() -> String,
) {
    let started = Instant::now();
    while !done().await {
        if started.elapsed() > DEADLINE {
            panic!("{what}: not after {DEADLINE:?}; {}", explain().await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn row(name: &str, odd_block: Vec<u8>, expect: Expect) {
    let Some(admin) = admin().await else {
        return;
    };
    let queue = unique(name);
    let policy = RetryPolicy::delays([Duration::from_millis(300)])
        .build()
        .expect("a policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    // Not spawned: the waits borrow; a panic is caught so that the streams go either way.
    cleaning_up(
        &admin,
        &plan,
        consume_past(
            admin.clone(),
            queue.clone(),
            plan.clone(),
            policy,
            odd_block,
            expect,
        ),
    )
    .await;
}

/// The tests' own connection to the server, or `None` (after a loud notice) without one.
async fn admin() -> Option<NatsTransport> {
    let config = testing::test_config(&nats_url());
    testing::connect_or_skip("transport-nats' hostile-message tests", config).await
}

/// Runs `test`, then deletes `plan`'s streams and closes `admin`, however the test ended.
async fn cleaning_up(admin: &NatsTransport, plan: &TopologyPlan, test: impl Future<Output = ()>) {
    let outcome = AssertUnwindSafe(test).catch_unwind().await;
    testing::delete_plan(admin.client(), plan).await;
    admin.close().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Publishes `before`, then the odd message (`block` and `body`, written raw), then `after`,
/// each good one with its id as message id and body.
async fn publish_around(
    admin: &NatsTransport,
    queue: &str,
    (before, after): (&[String], &[String]),
    block: &[u8],
    body: &[u8],
) {
    for id in before {
        test_brokers::nats::publish(admin.client(), queue, id, id, &[]).await;
    }
    let (url, subject, block, body) = (nats_url(), queue.to_owned(), block.to_vec(), body.to_vec());
    tokio::task::spawn_blocking(move || {
        RawPublisher::connect(&url)
            .and_then(|mut raw| raw.publish(&subject, &block, &body))
            .expect("the server stores the odd message")
    })
    .await
    .expect("the raw publish");
    for id in after {
        test_brokers::nats::publish(admin.client(), queue, id, id, &[]).await;
    }
}

/// A consumer running in the background at prefetch 20, recording the message id of every
/// message its handler runs.
struct Recording {
    handled: Arc<Mutex<HashSet<String>>>,
    stop: tokio::sync::oneshot::Sender<()>,
    running: tokio::task::JoinHandle<Result<retry_core::RunReport, retry_core::ConsumerError>>,
}

impl Recording {
    fn start(transport: &NatsTransport, queue: &str, policy: RetryPolicy) -> Self {
        let handled: Arc<Mutex<HashSet<String>>> = Arc::default();
        let seen = Arc::clone(&handled);
        let handler = move |m: Message| {
            let id = m.properties().message_id.clone().unwrap_or_default();
            seen.lock().expect("handled").insert(id);
            async { Ok::<(), HandlerError>(()) }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let consumer = Consumer::builder(transport.clone(), queue.to_owned(), policy, handler)
            .with_prefetch(20)
            .with_suspect_poll(Duration::from_millis(500))
            // Each test stands for a process of its own: one test's consumer waiting to run
            // a suspect alone must not hold another's back.
            .with_solo_gate(SoloGate::new())
            .build()
            .expect("a consumer");
        let running = tokio::spawn(consumer.run(async {
            let _ = stopped.await;
        }));
        Recording {
            handled,
            stop,
            running,
        }
    }

    /// Whether every one of `ids` was handled.
    fn handled_all(&self, ids: &HashSet<String>) -> bool {
        self.handled.lock().expect("handled").is_superset(ids)
    }

    /// Stops the consumer and returns its report.
    async fn stop(self) -> retry_core::RunReport {
        let _ = self.stop.send(());
        tokio::time::timeout(DEADLINE, self.running)
            .await
            .expect("the consumer stops")
            .expect("its task")
            .expect("the consumer ran to its end without error")
    }
}

async fn consume_past(
    admin: NatsTransport,
    queue: String,
    plan: TopologyPlan,
    policy: RetryPolicy,
    odd_block: Vec<u8>,
    expect: Expect,
) {
    admin.provision(&plan).await.expect("provision");
    let odd_body = format!("the odd one of {queue}").into_bytes();
    let ids: Vec<String> = (0..GOOD).map(|i| format!("good-{i:03}")).collect();
    let halves = ids.split_at(GOOD / 2);
    publish_around(&admin, &queue, halves, &odd_block, &odd_body).await;

    let transport = NatsTransport::connect(testing::test_config(&nats_url()))
        .await
        .expect("the consumer's connection");
    let consumer = Recording::start(&transport, &queue, policy);
    let (handled, running) = (&consumer.handled, &consumer.running);
    let good: HashSet<String> = ids.into_iter().collect();
    let js = async_nats::jetstream::new(admin.client().clone());
    let state = async || {
        let handled = handled.lock().expect("handled").clone();
        let missing = good.difference(&handled).count();
        let mut streams = String::new();
        for q in [queue.as_str(), plan.isolation_queue()] {
            let consumer = match js.get_stream(stream_name(q)).await {
                Ok(stream) => match stream.consumer_info(transport_nats::CONSUMER).await {
                    Ok(i) => format!(
                        "delivered {}, ack floor {}, {} pending, {} handed out, {} pulls waiting",
                        i.delivered.stream_sequence,
                        i.ack_floor.stream_sequence,
                        i.num_pending,
                        i.num_ack_pending,
                        i.num_waiting
                    ),
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            streams += &format!(
                "; {q} holds {:?} (its consumer: {consumer})",
                admin.count(q).await.ok()
            );
        }
        format!(
            "{} of {GOOD} good messages handled ({missing} missing), {} connections lost, consumer {}{streams}; parking stream {:?}",
            GOOD - missing,
            transport.connection_losses(),
            if running.is_finished() {
                "ended"
            } else {
                "running"
            },
            admin.count(plan.parking_queue()).await.ok(),
        )
    };
    wait_until(
        "every good message handled",
        async || {
            assert!(
                !running.is_finished(),
                "the consumer ended: {}",
                state().await
            );
            consumer.handled_all(&good)
        },
        &state,
    )
    .await;
    assert!(!running.is_finished(), "the consumer is still running");

    let parking = plan.parking_queue();
    match expect {
        Expect::Quarantined => {
            wait_until(
                "the odd message parked and the work stream empty",
                async || {
                    admin.count(&queue).await.ok() == Some(0)
                        && admin.count(parking).await.ok() == Some(1)
                },
                &state,
            )
            .await;
            let mut walk = admin.walk(parking).await.expect("walk the parking stream");
            let parked = walk
                .next()
                .await
                .expect("read the parked message")
                .expect("one parked message");
            let h = parked.message.headers();
            assert_eq!(parked.message.body(), odd_body.as_slice(), "its payload");
            assert_eq!(
                h.get(HEADER_BLOCK_HEADER),
                Some(&HeaderValue::Bytes(odd_block.clone())),
                "its header block, byte for byte"
            );
            assert_eq!(
                h.get(headers::REASON).and_then(HeaderValue::as_str),
                Some("malformed")
            );
            assert_eq!(
                h.get(headers::ORIGIN_QUEUE).and_then(HeaderValue::as_str),
                Some(queue.as_str())
            );
            let why = h
                .get(UNDECODABLE_HEADER)
                .and_then(HeaderValue::as_str)
                .unwrap_or_default();
            assert!(why.contains("line"), "why it was parked: {why:?}");
            walk.leave(parked.tag);
            walk.end().await.expect("end the walk");
            let losses = transport.connection_losses();
            assert!(
                losses <= 1,
                "a hostile message costs at most one connection, not {losses}"
            );
        }
        Expect::Handled | Expect::HandledOrParkedByTheEngine => {
            wait_until(
                "the odd message handled",
                async || {
                    let handled = handled.lock().expect("handled").contains("odd");
                    let parked = admin.count(parking).await.ok() == Some(1);
                    handled || (expect == Expect::HandledOrParkedByTheEngine && parked)
                },
                &state,
            )
            .await;
            wait_until(
                "the work stream empty",
                async || admin.count(&queue).await.ok() == Some(0),
                &state,
            )
            .await;
            assert_eq!(transport.connection_losses(), 0, "no connection lost");
            if expect == Expect::Handled {
                assert_eq!(
                    admin.count(parking).await.ok(),
                    Some(0),
                    "nothing parked: {}",
                    state().await
                );
            }
        }
    }

    let report = consumer.stop().await;
    println!("{queue}: {report:?}");
    transport.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_value_that_is_not_utf8_is_parked_and_costs_one_connection() {
    let block = header_block(&[b"Nats-Msg-Id: odd", b"tenant: ac\xffme"]);
    row("value", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_name_that_is_not_utf8_is_parked_and_costs_one_connection() {
    let block = header_block(&[b"Nats-Msg-Id: odd", b"ten\xfeant: acme"]);
    row("name", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_id_that_is_not_utf8_is_parked_and_costs_one_connection() {
    let block = header_block(&[b"Nats-Msg-Id: bad-\xff\xfe-id"]);
    row("msgid", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_line_without_a_colon_is_parked_and_costs_one_connection() {
    let block = header_block(&[b"Nats-Msg-Id: odd", b"no colon here"]);
    row("colon", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60_kb_header_value_is_handled() {
    let big = [b"big: ".as_slice(), &[b'v'; 60 * 1024]].concat();
    let block = header_block(&[b"Nats-Msg-Id: odd", &big]);
    row("big", block, Expect::Handled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_headers_are_handled() {
    let lines: Vec<Vec<u8>> = std::iter::once(b"Nats-Msg-Id: odd".to_vec())
        .chain((0..3000).map(|i| format!("h{i}: {i}").into_bytes()))
        .collect();
    let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
    row("many", header_block(&lines), Expect::Handled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_a_header_value_are_handled() {
    let block = header_block(&[b"Nats-Msg-Id: odd", b"c: a\x01\x07\x1b\x7fb\tc\x00d"]);
    row("control", block, Expect::Handled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_headers_holding_garbage_are_the_engines_to_decide() {
    let block = header_block(&[
        b"Nats-Msg-Id: odd",
        b"x-retry-attempts: ~i:notanumber",
        b"x-retry-crashes: ~j:{\"a\":[",
        b"x-retry-first-failure: ~t:-1",
    ]);
    row("garbage", block, Expect::HandledOrParkedByTheEngine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_carriage_return_inside_a_header_value_is_parked() {
    let block = header_block(&[b"Nats-Msg-Id: odd", b"a: x\ry"]);
    row("cr", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_408_status_is_parked() {
    let block = b"NATS/1.0 408 Request Timeout\r\nNats-Msg-Id: odd\r\n\r\n".to_vec();
    row("status408", block, Expect::Quarantined).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_100_status_is_parked() {
    let block = b"NATS/1.0 100 Idle Heartbeat\r\nNats-Msg-Id: odd\r\n\r\n".to_vec();
    row("status100", block, Expect::Quarantined).await;
}

/// A consumer that starts while a process before it died holding a hostile message (its
/// connection failed at it) parks the message before it comes back: it loses no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_message_a_dead_process_held_is_parked_before_it_comes_back() {
    // Long enough that the consumer below starts well before the dead process' deliveries
    // come back.
    let config = testing::test_config(&nats_url()).with_ack_wait(Duration::from_secs(10));
    let Some(admin) =
        testing::connect_or_skip("transport-nats' hostile-message tests", config.clone()).await
    else {
        return;
    };
    let queue = unique("dead");
    let policy = RetryPolicy::delays([Duration::from_millis(300)])
        .build()
        .expect("a policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    cleaning_up(
        &admin,
        &plan,
        start_after_a_death(admin.clone(), config, queue, plan.clone(), policy),
    )
    .await;
}

async fn start_after_a_death(
    admin: NatsTransport,
    config: transport_nats::NatsConfig,
    queue: String,
    plan: TopologyPlan,
    policy: RetryPolicy,
) {
    const AROUND: usize = 10;
    admin.provision(&plan).await.expect("provision");
    let ids: Vec<String> = (0..2 * AROUND).map(|i| format!("good-{i}")).collect();
    let block = header_block(&[b"Nats-Msg-Id: odd", b"tenant: ac\xffme"]);
    publish_around(&admin, &queue, ids.split_at(AROUND), &block, b"hostile").await;

    // The process that dies: a plain client pulls everything through the consumer, and its
    // connection fails at the hostile message.
    let (lost_tx, mut lost) = tokio::sync::mpsc::unbounded_channel();
    let doomed = async_nats::ConnectOptions::new()
        .event_callback(move |event| {
            let lost_tx = lost_tx.clone();
            async move {
                if event == async_nats::Event::Disconnected {
                    let _ = lost_tx.send(());
                }
            }
        })
        .connect(nats_url())
        .await
        .expect("the doomed process connects");
    let stream = async_nats::jetstream::new(doomed.clone())
        .get_stream(stream_name(&queue))
        .await
        .expect("the work stream");
    let consumer: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(transport_nats::CONSUMER)
        .await
        .expect("its consumer");
    let _batch = consumer
        .batch()
        .max_messages(3 * AROUND)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("a pull");
    tokio::time::timeout(DEADLINE, lost.recv())
        .await
        .expect("the doomed process loses its connection at the hostile message");
    drop(_batch);
    drop(doomed);

    let transport = NatsTransport::connect(config)
        .await
        .expect("the new process connects");
    let consumer = Recording::start(&transport, &queue, policy);
    let good: HashSet<String> = ids.into_iter().collect();
    let explain = async || {
        let done = consumer
            .handled
            .lock()
            .expect("handled")
            .intersection(&good)
            .count();
        format!(
            "{done} of {} handled, {} connections lost, work stream {:?}, parking stream {:?}",
            good.len(),
            transport.connection_losses(),
            admin.count(&queue).await.ok(),
            admin.count(plan.parking_queue()).await.ok()
        )
    };
    wait_until(
        "every good message handled and the hostile one parked",
        async || {
            consumer.handled_all(&good)
                && admin.count(&queue).await.ok() == Some(0)
                && admin.count(plan.parking_queue()).await.ok() == Some(1)
        },
        &explain,
    )
    .await;
    assert_eq!(
        transport.connection_losses(),
        0,
        "parked before it came back: {}",
        explain().await
    );
    consumer.stop().await;
    transport.close().await;
}

/// A walk (what `retryctl` lists, replays and purges with) reads every stored message, and
/// hands out one async-nats cannot read with why and its header block, instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_hands_out_what_async_nats_cannot_read_with_its_bytes() {
    let Some(admin) = admin().await else {
        return;
    };
    let queue = unique("walk");
    let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).expect("a plan");
    cleaning_up(&admin, &plan, async {
        admin.provision(&plan).await.expect("provision");
        let parking = plan.parking_queue().to_owned();
        let blocks: Vec<Vec<u8>> = vec![
            header_block(&[b"Nats-Msg-Id: first"]),
            header_block(&[b"Nats-Msg-Id: odd-1", b"tenant: ac\xffme"]),
            header_block(&[b"Nats-Msg-Id: odd-2", b"no colon here"]),
            header_block(&[b"Nats-Msg-Id: odd-3", b"a: x\ry"]),
            b"NATS/1.0 408 Request Timeout\r\nNats-Msg-Id: status\r\n\r\n".to_vec(),
            header_block(&[b"Nats-Msg-Id: last"]),
        ];
        let (url, subject, stored) = (nats_url(), parking.clone(), blocks.clone());
        tokio::task::spawn_blocking(move || {
            let mut raw = RawPublisher::connect(&url).expect("a raw connection");
            for (i, block) in stored.iter().enumerate() {
                let ack = raw
                    .publish(&subject, block, format!("body-{i}").as_bytes())
                    .expect("stored");
                assert!(!ack.duplicate, "message {i} stored");
            }
        })
        .await
        .expect("the raw publishes");
        let mut walk = admin.walk(&parking).await.expect("a walk");
        let mut seen = Vec::new();
        while let Some(d) = walk.next().await.expect("every message reads") {
            let m = &d.message;
            let undecodable = m.headers().get(UNDECODABLE_HEADER).is_some();
            if undecodable {
                assert_eq!(
                    m.headers().get(HEADER_BLOCK_HEADER),
                    Some(&HeaderValue::Bytes(blocks[seen.len()].clone())),
                    "the block of message {}",
                    seen.len()
                );
            }
            seen.push((
                String::from_utf8_lossy(m.body()).into_owned(),
                m.properties().message_id.clone(),
                undecodable,
            ));
            walk.leave(d.tag);
        }
        walk.end().await.expect("the walk ends");
        let expected: Vec<(String, Option<String>, bool)> = vec![
            ("body-0".into(), Some("first".into()), false),
            ("body-1".into(), None, true),
            ("body-2".into(), None, true),
            ("body-3".into(), None, true),
            ("body-4".into(), Some("status".into()), false),
            ("body-5".into(), Some("last".into()), false),
        ];
        assert_eq!(seen, expected);
    })
    .await;
}

/// A queue read by a transport that never provisioned or verified its plan has no parking
/// queue the transport knows of: its unreadable message is left where it is (and keeps
/// failing connections), never deleted unparked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_known_plan_an_unreadable_message_is_left_in_place() {
    let Some(admin) = admin().await else {
        return;
    };
    let queue = unique("noplan");
    let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).expect("a plan");
    cleaning_up(&admin, &plan, async {
        admin.provision(&plan).await.expect("provision");
        let (url, subject) = (nats_url(), queue.clone());
        tokio::task::spawn_blocking(move || {
            let block = header_block(&[b"tenant: ac\xffme"]);
            RawPublisher::connect(&url)
                .and_then(|mut raw| raw.publish(&subject, &block, b"hostile"))
                .expect("stored")
        })
        .await
        .expect("the raw publish");
        // Knows the queue's consumer, not its plan.
        let transport = NatsTransport::connect(testing::test_config(&nats_url()))
            .await
            .expect("connect");
        let subscription = transport.consume(&queue, 20).await.expect("consume");
        let explain = async || {
            format!(
                "{} connections lost, work stream {:?}, parking stream {:?}",
                transport.connection_losses(),
                admin.count(&queue).await.ok(),
                admin.count(plan.parking_queue()).await.ok()
            )
        };
        // Lost once when first pulled, and again when it came back: it was left.
        wait_until(
            "the message fails a second connection",
            async || transport.connection_losses() >= 2,
            &explain,
        )
        .await;
        assert_eq!(
            admin.count(&queue).await.ok(),
            Some(1),
            "{}",
            explain().await
        );
        assert_eq!(
            admin.count(plan.parking_queue()).await.ok(),
            Some(0),
            "{}",
            explain().await
        );
        drop(subscription);
        transport.close().await;
    })
    .await;
}
