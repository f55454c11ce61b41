//! The parking lot on RabbitMQ, beyond the conformance suite's `parking_lot` scenario: a walk
//! puts back what it leaves, in place, while its connection stays open; a replayed copy
//! keeps the user's headers in their AMQP types; and a replay whose connection the broker
//! closes part way loses nothing.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::BasicGetOptions;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use retry_core::{
    DeadLetterReason, ParkedFilter, ParkedReason, ParkingError, ParkingLot, ParkingReport,
    ReplayOptions, RetryPolicy, TopologyPlan, Transport,
};
use transport_amqp091::AmqpTransport;

/// Parks `id` in `queue` as the engine would have, for `reason`.
async fn park(ch: &Channel, queue: &str, id: &str, reason: &str) {
    let headers = common::table([
        (
            "x-retry-reason",
            AMQPValue::LongString(LongString::from(reason)),
        ),
        ("x-retry-attempts", AMQPValue::LongLongInt(2)),
    ]);
    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(headers);
    common::publish_with(ch, queue, format!("body of {id}").as_bytes(), properties).await;
}

/// What a test of the parking lot works with: a provisioned plan deleted at the end, the
/// transport, and a raw connection for setting up and looking.
struct Setup {
    queue: String,
    plan: TopologyPlan,
    transport: Arc<AmqpTransport>,
    conn: Connection,
    ch: Channel,
    _cleanup: common::Cleanup,
}

impl Setup {
    async fn new(test: &str, prefix: &str) -> Option<Setup> {
        let config = common::broker(test).await?;
        let queue = common::unique(prefix);
        let plan = plan(&queue);
        let mut cleanup = common::Cleanup::new(common::amqp_url());
        cleanup.plan(&plan);
        let transport = Arc::new(common::transport(&config).await);
        transport.provision(&plan).await.unwrap();
        let (conn, ch) = common::raw().await;
        Some(Setup {
            queue,
            plan,
            transport,
            conn,
            ch,
            _cleanup: cleanup,
        })
    }

    async fn close(self) {
        let _ = self.conn.close(200, "done".into()).await;
        (*self.transport).close().await.unwrap();
    }
}

/// Takes every message from `queue`: their ids, in order.
async fn drain(ch: &Channel, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(got) = common::get(ch, queue).await {
        ids.push(got.message_id.unwrap_or_default());
    }
    ids
}

fn plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .build()
        .unwrap();
    TopologyPlan::new(queue, &policy).unwrap()
}

fn permanent() -> ParkedFilter {
    ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent))
}

#[tokio::test]
async fn a_walk_puts_back_what_it_leaves_in_place_while_its_connection_stays_open() {
    let Some(setup) = Setup::new("parking walk", "parking-walk").await else {
        return;
    };
    let Setup {
        queue,
        plan,
        transport,
        ch,
        ..
    } = &setup;
    let parking = plan.parking_queue();
    let ids: Vec<String> = (0..20).map(|i| format!("m{i:02}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let reason = if i % 4 == 0 {
            "permanent"
        } else {
            "attempts-exhausted"
        };
        park(ch, parking, id, reason).await;
    }

    let lot = ParkingLot::new(Arc::clone(transport), plan);
    let report = lot
        .replay(&permanent(), ReplayOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!((report.replayed, report.left), (5, 15), "{report:?}");
    // The transport's connection is still open: what the walk left is back, none of it
    // unacknowledged, in its order.
    let (ready, unacked) = common::ready_and_unacked_settled(parking).await;
    assert_eq!((ready, unacked), (15, 0));
    let kept: Vec<String> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 4 != 0)
        .map(|(_, id)| id.clone())
        .collect();
    let mut browsed = Vec::new();
    lot.browse(&ParkedFilter::all(), |p| {
        browsed.push(p.id().unwrap().to_owned());
        std::ops::ControlFlow::Continue(())
    })
    .await
    .unwrap();
    assert_eq!(browsed, kept, "a walk moved what it left");
    assert_eq!(drain(ch, queue).await.len(), 5);
    assert_eq!(drain(ch, parking).await, kept);
    setup.close().await;
}

/// A parked message as a Java or .NET publisher would have sent it: headers of the narrower
/// AMQP types, which the engine's header model reads as 64-bit integers, doubles and long
/// strings. Its replayed copy carries them with their own types, and its properties as
/// they were; only the engine's headers are new.
#[tokio::test]
async fn a_replay_keeps_the_users_headers_and_properties_as_they_were_encoded() {
    let Some(setup) = Setup::new("parking encodings", "parking-types").await else {
        return;
    };
    let Setup {
        queue,
        plan,
        transport,
        ch,
        ..
    } = &setup;
    let mut headers = common::table(common::narrow_headers());
    headers.insert(
        "x-retry-reason".into(),
        AMQPValue::LongString("permanent".into()),
    );
    headers.insert("x-retry-attempts".into(), AMQPValue::LongInt(3));
    let properties = BasicProperties::default()
        .with_message_id("typed".into())
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_correlation_id("corr-1".into())
        .with_reply_to("replies".into())
        .with_timestamp(1_796_160_047)
        .with_priority(4)
        .with_type("comment.created".into())
        .with_app_id("publisher".into())
        .with_delivery_mode(2);
    let body: &[u8] = b"\x00\xffnot text";
    let parked = properties.clone().with_headers(headers);
    common::publish_with(ch, plan.parking_queue(), body, parked).await;

    let lot = ParkingLot::new(Arc::clone(transport), plan);
    let report = lot
        .replay(&permanent(), ReplayOptions::default(), |_| {})
        .await
        .unwrap();
    assert_eq!(report.replayed, 1, "{report:?}");
    let copy = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
        .expect("the replayed copy");
    let copy = copy.delivery;
    assert_eq!(copy.data, body);
    let written = copy.properties.headers().clone().expect("headers");
    common::assert_narrow_headers_kept(&written);
    let written = written.inner();
    assert_eq!(
        (
            written.get("x-retry-attempts"),
            written.get("x-retry-crashes")
        ),
        (None, None),
        "the engine's counters are reset (a count of 0 is not written)"
    );
    assert_eq!(
        written.get("x-retry-previous-reason"),
        Some(&AMQPValue::LongString("permanent".into()))
    );
    assert_eq!(
        copy.properties.with_headers(FieldTable::default()),
        properties.with_headers(FieldTable::default()),
        "the properties are the parked message's"
    );
    setup.close().await;
}

// Two workers: the replay blocks one of them while the broker closes its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_whose_connection_the_broker_closes_part_way_loses_nothing() {
    killed_part_way(false).await;
}

/// The same, with the replay going on only once lapin has recovered the connection and the
/// walk's channel: the walk must see that the broker put back what it held, not read it
/// again on the new channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_goes_on_after_a_recovery_stops_and_loses_nothing() {
    killed_part_way(true).await;
}

async fn killed_part_way(resume_after_recovery: bool) {
    let Some(config) = common::broker("parking killed").await else {
        return;
    };
    let name = config.connection_name().unwrap().to_owned();
    let queue = common::unique("parking-killed");
    let plan = plan(&queue);
    let mut cleanup = common::Cleanup::new(common::amqp_url());
    cleanup.plan(&plan);
    let transport = Arc::new(AmqpTransport::connect(config.clone()).await.unwrap());
    transport.provision(&plan).await.unwrap();
    let (conn, ch) = common::raw().await;
    let parking = plan.parking_queue();
    let total = 200;
    for i in 0..total {
        let reason = if i % 2 == 0 {
            "permanent"
        } else {
            "crash-loop"
        };
        park(&ch, parking, &format!("m{i:03}"), reason).await;
    }

    // The replay waits inside its progress report until the broker has closed its
    // connection, and then goes on as if nothing happened.
    let lot = ParkingLot::new(Arc::clone(&transport), &plan);
    let (kill, killed) = tokio::sync::oneshot::channel::<()>();
    let (closed_tx, closed) = std::sync::mpsc::channel::<usize>();
    let closer = tokio::spawn(async move {
        if killed.await.is_ok() {
            let n = common::close_connection(&name).await;
            let _ = closed_tx.send(n);
        }
    });
    let mut kill = Some(kill);
    let closed_count = Arc::new(AtomicUsize::new(0));
    let progress = {
        let closed_count = Arc::clone(&closed_count);
        let transport = Arc::clone(&transport);
        move |report: &ParkingReport| {
            if report.replayed == 10
                && let Some(kill) = kill.take()
            {
                let _ = kill.send(());
                closed_count.store(closed.recv().unwrap_or(0), Ordering::SeqCst);
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while resume_after_recovery
                    && transport.recoveries() == 0
                    && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    };
    let result = lot
        .replay(&permanent(), ReplayOptions::default(), progress)
        .await;
    closer.await.unwrap();
    assert_eq!(
        closed_count.load(Ordering::SeqCst),
        1,
        "the replay's connection was closed"
    );
    if resume_after_recovery {
        assert_eq!(transport.recoveries(), 1, "the connection was recovered");
    }
    let err = result.expect_err("the replay outlived its connection");
    assert!(
        matches!(err, ParkingError::Interrupted { .. }),
        "{err}: {err:?}"
    );
    let replayed = err.report().replayed;
    assert!((10..100).contains(&replayed), "{err}");

    // The broker has put back everything the walk held: every message is parked or in the
    // work queue, the crash-loop ones all still parked.
    let work = drain(&ch, &queue).await;
    let parked = drain(&ch, parking).await;
    let mut seen: BTreeMap<&str, u32> = BTreeMap::new();
    for id in work.iter().chain(&parked) {
        *seen.entry(id).or_default() += 1;
    }
    let lost: Vec<String> = (0..total)
        .map(|i| format!("m{i:03}"))
        .filter(|id| !seen.contains_key(id.as_str()))
        .collect();
    assert_eq!(lost, Vec::<String>::new(), "lost");
    let duplicates = seen.values().filter(|n| **n > 1).count();
    assert!(duplicates <= 1, "{duplicates} duplicates: {seen:?}");
    assert!(
        work.len() as u64 >= replayed,
        "{} in the work queue, {replayed} replayed",
        work.len()
    );
    assert!(
        work.iter()
            .all(|id| id[1..].parse::<u32>().unwrap() % 2 == 0),
        "only permanent ones replayed: {work:?}"
    );

    let _ = conn.close(200, "done".into()).await;
}
