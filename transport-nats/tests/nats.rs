//! transport-nats against the local NATS server (`NATS_URL`, loopback by default): bad input
//! refused by name with nothing consumed, and delays that never wait behind each other.
//! Without a server each test says so loudly and passes, unless `REQUIRE_NATS` is set.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::{Config as StreamConfig, RetentionPolicy};
use retry_core::{
    Consumer, HandlerError, Message, RetryPolicy, Terminal, TopologyPlan, Transport, TransportError,
};
use test_brokers::nats_url;
use transport_nats::testing;
use transport_nats::{NatsConfig, NatsTransport, stream_name};

fn unique(what: &str) -> String {
    test_brokers::unique(&format!("tn-{what}"))
}

async fn connect() -> Option<NatsTransport> {
    let config = NatsConfig::new(nats_url()).with_ack_wait(Duration::from_secs(2));
    testing::connect_or_skip("transport-nats' tests", config).await
}

async fn delete(t: &NatsTransport, plan: &TopologyPlan) {
    testing::delete_plan(t.client(), plan).await;
}

/// A free loopback port, for a server of the test's own.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

#[tokio::test]
async fn a_server_without_jetstream_is_refused_at_connect_by_name() {
    if connect().await.is_none() {
        return;
    }
    let port = free_port();
    let mut server = tokio::process::Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .kill_on_drop(true)
        .spawn()
        .expect("nats-server starts");
    let config = NatsConfig::new(format!("nats://127.0.0.1:{port}"));
    let started = Instant::now();
    let err = loop {
        match NatsTransport::connect(config.clone()).await {
            Err(TransportError::Connection { .. })
                if started.elapsed() < Duration::from_secs(10) =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => break e,
            Ok(_) => panic!("a server without JetStream was accepted"),
        }
    };
    let _ = server.kill().await;
    let text = err.to_string();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err:?}");
    assert!(text.contains("JetStream") && text.contains("-js"), "{text}");
}

#[tokio::test]
async fn credentials_never_appear_in_a_connect_error() {
    let port = free_port();
    let err = NatsTransport::connect(
        NatsConfig::new(format!("nats://app:hunter2@127.0.0.1:{port}"))
            .with_operation_timeout(Duration::from_secs(2)),
    )
    .await
    .expect_err("nothing listens there");
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("app:****@"), "{text}");
}

#[tokio::test]
async fn a_wildcard_queue_name_is_refused_and_nothing_is_created() {
    let Some(t) = connect().await else { return };
    let queue = format!("{}.*", unique("wild"));
    let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).expect("a plan");
    let err = t.provision(&plan).await.expect_err("a wildcard name");
    assert!(err.to_string().contains(&format!("{queue:?}")), "{err}");
    assert!(err.to_string().contains("wildcard"), "{err}");
    let js = async_nats::jetstream::new(t.client().clone());
    assert!(
        js.get_stream(stream_name(&queue)).await.is_err(),
        "nothing created"
    );
    t.close().await;
}

#[tokio::test]
async fn a_stream_with_other_settings_is_named_with_its_field_and_nothing_is_consumed() {
    let Some(t) = connect().await else { return };
    let queue = unique("conflict");
    let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).expect("a plan");
    let js = async_nats::jetstream::new(t.client().clone());
    // Someone made the work stream already, keeping every message (limits retention).
    js.create_stream(StreamConfig {
        name: stream_name(&queue),
        subjects: vec![queue.clone()],
        retention: RetentionPolicy::Limits,
        ..Default::default()
    })
    .await
    .expect("the other stream");
    js.publish(queue.clone(), "keep me".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let policy = RetryPolicy::default();
    let handled = Arc::new(Mutex::new(0));
    let counter = Arc::clone(&handled);
    let consumer = Consumer::builder(t.clone(), queue.clone(), policy, move |_m: Message| {
        *counter.lock().unwrap() += 1;
        async { Ok::<(), HandlerError>(()) }
    })
    .build()
    .expect("a consumer");
    let err = consumer
        .run(std::future::pending::<()>())
        .await
        .expect_err("the conflict stops it");
    let text = format!(
        "{err}: {:?}",
        std::error::Error::source(&err).map(ToString::to_string)
    );
    assert!(
        text.contains(&format!("stream {}", stream_name(&queue))) && text.contains("retention"),
        "{text}"
    );
    assert_eq!(*handled.lock().unwrap(), 0, "nothing consumed");
    assert_eq!(
        t.count(&queue).await.expect("count"),
        1,
        "the message is still there"
    );
    delete(&t, &plan).await;
    t.close().await;
}

/// A retry-after between the plan's levels is due at its own time: published behind a 3 s
/// retry, a 1.5 s one comes back first, though both go through the 3 s delay stream (on
/// RabbitMQ it would wait behind the 3 s one at the queue's head, its per-message TTL
/// expiring only there).
#[tokio::test]
async fn a_short_delay_never_waits_behind_a_long_one_in_the_same_delay_queue() {
    let Some(t) = connect().await else { return };
    let queue = unique("hol");
    let policy = RetryPolicy::delays([Duration::from_secs(1), Duration::from_secs(3)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    t.provision(&plan).await.expect("provision");
    let js = async_nats::jetstream::new(t.client().clone());
    for body in ["slow", "fast"] {
        js.publish(queue.clone(), body.into())
            .await
            .expect("publish")
            .await
            .expect("stored");
    }
    let runs: Arc<Mutex<Vec<(String, u32, Instant)>>> = Arc::default();
    let seen = Arc::clone(&runs);
    let handler = move |m: Message| {
        let body = String::from_utf8_lossy(m.body()).into_owned();
        seen.lock()
            .unwrap()
            .push((body.clone(), m.attempt(), Instant::now()));
        async move {
            match (body.as_str(), m.attempt()) {
                ("slow", 1) => Err(HandlerError::retry_after(Duration::from_secs(3), "later")),
                ("fast", 1) => Err(HandlerError::retry_after(
                    Duration::from_millis(1_500),
                    "soon",
                )),
                _ => Ok(()),
            }
        }
    };
    let finished = Arc::new(Mutex::new(0));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let done_tx = Mutex::new(Some(done_tx));
    let count = Arc::clone(&finished);
    let consumer = Consumer::builder(t.clone(), queue.clone(), policy, handler)
        .with_prefetch(1)
        .with_on_terminal(move |_, terminal| {
            if matches!(terminal, Terminal::Handled { .. }) {
                let mut n = count.lock().unwrap();
                *n += 1;
                if *n == 2 {
                    done_tx.lock().unwrap().take().map(|tx| tx.send(()));
                }
            }
        })
        .build()
        .expect("a consumer");
    let run = consumer.run(async {
        let _ = done_rx.await;
    });
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("both handled within 30 s")
        .expect("the consumer ran");
    let runs = runs.lock().unwrap().clone();
    let at = |body: &str, attempt: u32| {
        runs.iter()
            .find(|(b, a, _)| b == body && *a == attempt)
            .map(|(_, _, at)| *at)
            .unwrap_or_else(|| panic!("{body} run {attempt}: {runs:?}"))
    };
    assert!(
        at("slow", 1) <= at("fast", 1),
        "the 3 s retry was published first"
    );
    assert!(
        at("fast", 2) < at("slow", 2),
        "the 1.5 s retry came back first: {runs:?}"
    );
    let fast = at("fast", 2) - at("fast", 1);
    let slow = at("slow", 2) - at("slow", 1);
    // Due times are wall-clock milliseconds, the runs are timed on the monotonic clock: the
    // two may disagree by a few milliseconds over a few seconds.
    let slack = Duration::from_millis(10);
    assert!(fast + slack >= Duration::from_millis(1_500), "{fast:?}");
    assert!(slow + slack >= Duration::from_secs(3), "{slow:?}");
    println!("1.5 s retry back after {fast:?}, 3 s retry after {slow:?}");
    delete(&t, &plan).await;
    t.close().await;
}

/// A server that says it is 2.6.0: just enough of the NATS protocol for a client to
/// connect (its INFO, then PONG to every PING).
async fn old_server() -> (u16, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let port = listener.local_addr().expect("its address").port();
    let task = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let info = r#"INFO {"server_id":"OLD","server_name":"old","version":"2.6.0","proto":1,"go":"go1.17","host":"127.0.0.1","port":4222,"headers":true,"max_payload":1048576}"#;
                if write
                    .write_all(format!("{info}\r\n").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let mut lines = BufReader::new(read).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line.starts_with("PING") && write.write_all(b"PONG\r\n").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, task)
}

#[tokio::test]
async fn a_server_older_than_2_7_1_is_refused_at_connect_naming_its_version() {
    let (port, server) = old_server().await;
    let err = NatsTransport::connect(
        NatsConfig::new(format!("nats://127.0.0.1:{port}"))
            .with_operation_timeout(Duration::from_secs(5)),
    )
    .await
    .expect_err("2.6.0 is too old");
    server.abort();
    let text = err.to_string();
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err:?}");
    assert!(text.contains("2.6.0") && text.contains("2.7.1"), "{text}");
}

/// A handler that runs for three ack waits is never handed its message again: every
/// unsettled delivery of a subscription is kept alive (`+WPI`) by the subscription's
/// keeper, the deliveries that arrive together and those that arrive later alike.
#[tokio::test]
async fn a_handler_longer_than_the_ack_wait_runs_once() {
    let Some(t) = connect().await else { return };
    let queue = unique("long");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    t.provision(&plan).await.expect("provision");
    let js = async_nats::jetstream::new(t.client().clone());
    let publish = |body: &'static str| {
        let (js, queue) = (js.clone(), queue.clone());
        async move {
            js.publish(queue, body.into())
                .await
                .expect("publish")
                .await
                .expect("stored");
        }
    };
    for body in ["a", "b"] {
        publish(body).await;
    }
    let runs: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let seen = Arc::clone(&runs);
    let handler = move |m: Message| {
        let body = String::from_utf8_lossy(m.body()).into_owned();
        seen.lock().unwrap().push((body, m.attempt()));
        async move {
            // Three ack waits of the test connection (2 s).
            tokio::time::sleep(Duration::from_secs(6)).await;
            Ok::<(), HandlerError>(())
        }
    };
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let done_tx = Mutex::new(Some(done_tx));
    let handled = Arc::new(Mutex::new(0));
    let count = Arc::clone(&handled);
    let consumer = Consumer::builder(t.clone(), queue.clone(), policy, handler)
        .with_prefetch(10)
        .with_on_terminal(move |_, terminal| {
            if matches!(terminal, Terminal::Handled { .. }) {
                let mut n = count.lock().unwrap();
                *n += 1;
                if *n == 3 {
                    done_tx.lock().unwrap().take().map(|tx| tx.send(()));
                }
            }
        })
        .build()
        .expect("a consumer");
    let late = async {
        // One more, a second after the others, so it is kept alive from another point of
        // the keeper's period.
        tokio::time::sleep(Duration::from_secs(1)).await;
        publish("c").await;
    };
    let run = consumer.run(async {
        let _ = done_rx.await;
    });
    let (report, ()) =
        tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(run, late) })
            .await
            .expect("all handled within 30 s");
    let report = report.expect("the consumer ran");
    let mut runs = runs.lock().unwrap().clone();
    runs.sort();
    assert_eq!(
        runs,
        [("a".into(), 1), ("b".into(), 1), ("c".into(), 1)],
        "{report:?}"
    );
    assert_eq!((report.handled, report.isolated), (3, 0), "{report:?}");
    delete(&t, &plan).await;
    t.close().await;
}

#[tokio::test]
async fn a_fetch_from_an_idle_queue_answers_at_once_and_a_waiting_message_is_fetched() {
    if connect().await.is_none() {
        return;
    }
    // A fetch wait no test waits out: only a fetch that skips it answers in time.
    let long = Duration::from_secs(300);
    let config = NatsConfig::new(nats_url()).with_fetch_wait(long);
    let t = NatsTransport::connect(config).await.expect("connect");
    let queue = unique("idle-fetch");
    let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).unwrap();
    t.provision(&plan).await.unwrap();
    let isolation = plan.isolation_queue().to_owned();
    let bound = Duration::from_secs(60);
    let empty = tokio::time::timeout(bound, t.fetch(&isolation)).await;
    assert!(
        matches!(empty, Ok(Ok(None))),
        "an empty queue answers None without the fetch wait: {empty:?}"
    );
    test_brokers::nats::publish(t.client(), &isolation, "suspect-1", "suspect", &[]).await;
    let fetched = tokio::time::timeout(bound, t.fetch(&isolation))
        .await
        .expect("a waiting message is fetched at once")
        .unwrap()
        .expect("the message");
    assert_eq!(fetched.message.body(), b"suspect");
    delete(&t, &plan).await;
}

fn clone_to(queue: &str) -> (retry_core::Message, retry_core::Publish) {
    use retry_core::headers::EngineHeaders;
    use retry_core::{MessageParts, Publish, Route};
    let original = Message::new(MessageParts {
        queue: queue.to_owned(),
        routing_key: queue.to_owned(),
        body: b"a clone".to_vec(),
        ..MessageParts::default()
    });
    let publish = Publish {
        route: Route {
            exchange: "".into(),
            routing_key: queue.into(),
        },
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
            reason: None,
            delay: None,
            suspect: None,
        },
    };
    (original, publish)
}

/// A publish no stream answers ("no responders", which async-nats reports as a missing
/// stream) is unroutable only when the stream truly does not exist: a server still
/// restoring its streams after a restart answers the same way, and the engine must then try
/// the route again, not take it for missing. The stream is made present yet silent by
/// moving its subjects off the queue's.
#[tokio::test]
async fn a_publish_no_stream_answers_is_returned_only_when_the_stream_is_gone() {
    use retry_core::PublishResult;
    let Some(t) = connect().await else { return };
    let queue = unique("noresp");
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    t.provision(&plan).await.expect("provision");
    let (original, publish) = clone_to(&queue);
    let js = async_nats::jetstream::new(t.client().clone());
    let answered = t.publish(&original, &publish).await;
    assert!(matches!(answered, PublishResult::Confirmed), "{answered:?}");

    let mut stream = js.get_stream(stream_name(&queue)).await.expect("stream");
    let mut config = stream.info().await.expect("its info").config.clone();
    config.subjects = vec![format!("{queue}.elsewhere")];
    js.update_stream(config).await.expect("subjects moved");
    let silent = t.publish(&original, &publish).await;
    assert!(
        matches!(
            silent,
            PublishResult::Failed(TransportError::Connection { .. })
        ),
        "the stream exists: a failure to try again, not {silent:?}"
    );

    js.delete_stream(stream_name(&queue))
        .await
        .expect("stream deleted");
    let missing = t.publish(&original, &publish).await;
    assert!(
        matches!(missing, PublishResult::Returned),
        "the stream is gone: unroutable, not {missing:?}"
    );
    delete(&t, &plan).await;
}

/// A work-queue stream can keep copies of messages its consumer has acked, below the
/// consumer's ack floor (a server killed with SIGKILL before it wrote their deletes leaves
/// them): they are never delivered again, so `count` must not report them as a backlog.
/// Here the stream keeps them because its retention is `limits`: the queue's consumer acks
/// the first two of three messages, and all three stay stored.
#[tokio::test]
async fn copies_below_the_ack_floor_are_not_counted_as_waiting() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use retry_core::Settlement;
    let Some(t) = connect().await else { return };
    let queue = unique("floor");
    let js = async_nats::jetstream::new(t.client().clone());
    let stream = js
        .create_stream(StreamConfig {
            name: stream_name(&queue),
            subjects: vec![queue.clone()],
            retention: RetentionPolicy::Limits,
            ..Default::default()
        })
        .await
        .expect("a stream that keeps acked messages");
    stream
        .create_consumer(pull::Config {
            durable_name: Some(transport_nats::CONSUMER.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(2),
            max_deliver: -1,
            max_ack_pending: -1,
            ..Default::default()
        })
        .await
        .expect("the queue's consumer");
    for id in ["m-1", "m-2", "m-3"] {
        test_brokers::nats::publish(t.client(), &queue, id, id, &[]).await;
    }
    let fetch = async || {
        let d = t.fetch(&queue).await.expect("fetch");
        if let Some(d) = &d {
            t.settle(&d.tag, Settlement::Ack).await.expect("ack");
        }
        d.map(|d| {
            d.message
                .properties()
                .message_id
                .clone()
                .unwrap_or_default()
        })
    };
    assert_eq!(fetch().await.as_deref(), Some("m-1"));
    assert_eq!(fetch().await.as_deref(), Some("m-2"));

    let counted = t.count(&queue).await.expect("count");
    let mut handed = Vec::new();
    while let Some(id) = fetch().await {
        handed.push(id);
    }
    assert_eq!(handed, ["m-3"], "the consumer acked m-1 and m-2");
    assert_eq!(
        counted,
        handed.len() as u64,
        "count says what the consumer hands out"
    );
    assert_eq!(t.count(&queue).await.expect("count"), 0, "nothing waits");
    let _ = js.delete_stream(stream_name(&queue)).await;
}
