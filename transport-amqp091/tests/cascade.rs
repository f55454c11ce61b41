//! The delay cascade on the real RabbitMQ: provisioning it (shared by every work queue that
//! uses it, idempotent, conflicts named), the route a clone takes through it, and tearing it
//! down apart from the work queues.
//!
//! Every test uses a cascade prefix of its own, so it can delete its cascade without touching
//! anyone else's; a guard deletes what a test made even when the test fails.

mod common;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use lapin::Channel;
use lapin::types::{AMQPValue, FieldTable};
use retry_core::headers::EngineHeaders;
use retry_core::{
    Cascade, CascadePlan, DelayStrategy, Message, MessageParts, Properties, Publish, PublishResult,
    RetryPolicy, Route, TopologyPlan, Transport, TransportError,
};
use test_brokers::LogRecorder;
use transport_amqp091::AmqpTransport;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A cascade prefix no other test run uses.
fn prefix(test: &str) -> String {
    format!("test.{}", unique(test))
}

/// The plan for `queue` with `delays`, through the cascade `cascade`.
fn plan(queue: &str, delays: &[Duration], cascade: Cascade) -> TopologyPlan {
    let policy = RetryPolicy::delays(delays.iter().copied()).build().unwrap();
    TopologyPlan::builder(queue, &policy)
        .with_strategy(DelayStrategy::Cascade(cascade))
        .build()
        .unwrap()
}

/// The process-wide log recorder, installed once for every test of this binary: lapin and
/// this crate's tasks log where only the global subscriber sees them.
fn logs() -> &'static LogRecorder {
    static LOGS: OnceLock<LogRecorder> = OnceLock::new();
    LOGS.get_or_init(|| {
        let recorder = LogRecorder::default();
        tracing::subscriber::set_global_default(recorder.clone()).expect("the only subscriber");
        recorder
    })
}

/// `rabbitmqctl list_exchanges` names that start with `prefix`, sorted.
async fn list_exchanges(prefix: &str) -> Vec<String> {
    let prefix = prefix.to_owned();
    tokio::task::spawn_blocking(move || {
        let listing = rabbitmqctl(&["list_exchanges", "name", "type", "--formatter", "json"]);
        let rows: serde_json::Value = serde_json::from_str(&listing).expect("json");
        let mut names: Vec<String> = rows
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| {
                let name = r["name"].as_str()?;
                assert!(
                    !name.starts_with(&prefix) || r["type"] == "topic",
                    "cascade exchange {name} is not a topic exchange: {r}"
                );
                name.starts_with(&prefix).then(|| name.to_owned())
            })
            .collect();
        names.sort();
        names
    })
    .await
    .unwrap()
}

/// The names of the queues that start with `prefix`, sorted.
async fn queue_names(prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = list_queues(prefix)
        .await
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect();
    names.sort();
    names
}

/// Every object of `cascade` as a provisioning report names it, cascade order.
fn cascade_objects(cascade: &CascadePlan) -> Vec<String> {
    cascade
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(cascade.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect()
}

/// Every object of `plan` itself (not its cascade) as a provisioning report names it.
fn own_objects(plan: &TopologyPlan) -> Vec<String> {
    plan.exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect()
}

/// Every binding of `cascade` and the cascade bindings of `plans`, as `list_bindings`
/// shows them: (source, destination, routing key), sorted.
fn cascade_bindings(
    cascade: &CascadePlan,
    plans: &[&TopologyPlan],
) -> Vec<(String, String, String)> {
    let mut all: Vec<_> = cascade
        .bindings()
        .iter()
        .map(|b| (b.exchange.clone(), b.queue.clone(), b.routing_key.clone()))
        .chain(cascade.exchange_bindings().iter().map(|b| {
            (
                b.source.clone(),
                b.destination.clone(),
                b.routing_key.clone(),
            )
        }))
        .chain(plans.iter().flat_map(|p| {
            p.bindings()
                .iter()
                .filter(|b| b.exchange == cascade.delivery_exchange())
                .map(|b| (b.exchange.clone(), b.queue.clone(), b.routing_key.clone()))
        }))
        .collect();
    all.sort();
    all
}

/// A clone of a message from `queue`, with `id` as its message id and body.
fn message(queue: &str, id: &str) -> Message {
    Message::new(MessageParts {
        queue: queue.into(),
        exchange: String::new(),
        routing_key: queue.into(),
        body: id.as_bytes().to_vec(),
        properties: Properties {
            message_id: Some(id.into()),
            persistent: true,
            ..Properties::default()
        },
        ..MessageParts::default()
    })
}

/// Publishes a clone of message `id` on `route`, as the engine would, and checks the
/// broker's plain positive confirm.
async fn publish(t: &AmqpTransport, queue: &str, id: &str, route: Route, delay: Duration) {
    let publish = Publish {
        route,
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
            reason: None,
            delay: Some(delay),
            suspect: None,
        },
    };
    let result = t.publish(&message(queue, id), &publish).await;
    assert!(
        matches!(result, PublishResult::Confirmed),
        "the clone {id} through the cascade: {result:?}"
    );
}

/// Polls `queue` every 5 ms for `within`; every message taken, with when it was taken.
async fn arrivals(ch: &Channel, queue: &str, n: usize, within: Duration) -> Vec<(String, Instant)> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    while seen.len() < n && Instant::now() < deadline {
        match get(ch, queue).await {
            Some(got) => seen.push((got.message_id.unwrap_or_default(), Instant::now())),
            None => tokio::time::sleep(ms(5)).await,
        }
    }
    seen
}

#[tokio::test]
async fn provisioning_a_cascade_twice_verifies_everything_the_second_time() {
    let logs = logs();
    let Some(config) = broker("cascade-idempotent").await else {
        return;
    };
    let p = prefix("idem");
    let q = unique("casc-idem");
    let plan = plan(&q, &[ms(300), ms(700)], Cascade::new().with_prefix(&p));
    let cascade = plan.cascade().unwrap();
    assert_eq!(cascade.levels(), 7, "70 units of 10 ms need 7 bits");
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;

    let first = t.provision_inspected(&plan).await.unwrap();
    let everything: Vec<String> = cascade_objects(cascade)
        .into_iter()
        .chain(own_objects(&plan))
        .collect();
    assert_eq!(
        first.created, everything,
        "the cascade first, then the plan's own"
    );
    assert!(first.verified.is_empty(), "{first:?}");

    // What the broker has: topic exchanges, level queues with their TTL and dead-lettering,
    // and every binding, exchange-to-exchange ones included.
    let exchanges: Vec<String> = {
        let mut names: Vec<String> = cascade.exchanges().iter().map(|e| e.name.clone()).collect();
        names.sort();
        names
    };
    assert_eq!(list_exchanges(&p).await, exchanges);
    let rows = list_queues(&p).await;
    assert_eq!(rows.len(), cascade.queues().len(), "{rows:?}");
    for spec in cascade.queues() {
        let row = rows
            .iter()
            .find(|r| r["name"] == spec.name.as_str())
            .unwrap();
        assert_eq!(row["durable"], true, "{row}");
        let args = row["arguments"].to_string();
        let ttl = spec.arguments.message_ttl.unwrap().as_millis();
        assert!(
            args.contains(&format!("\"x-message-ttl\",\"long\",{ttl}]")),
            "{args}"
        );
        let below = spec.arguments.dead_letter_exchange.as_deref().unwrap();
        assert!(
            args.contains(&format!(
                "\"x-dead-letter-exchange\",\"longstr\",\"{below}\""
            )),
            "{args}"
        );
        assert!(!args.contains("x-dead-letter-routing-key"), "{args}");
    }
    assert_eq!(list_bindings(&p).await, cascade_bindings(cascade, &[&plan]));

    // Again, inspected: nothing created, everything verified, no binding added.
    let second = t.provision_inspected(&plan).await.unwrap();
    assert!(second.created.is_empty(), "{second:?}");
    assert_eq!(second.verified, everything);
    // And as a consumer's start does it: declared without asking, none refused, and one
    // INFO line that counts the cascade.
    t.provision(&plan).await.unwrap();
    let declared = t.last_provision_report().unwrap();
    assert_eq!(declared.declared, everything);
    assert_eq!(list_bindings(&p).await, cascade_bindings(cascade, &[&plan]));
    let queue = format!("queue={q}");
    let summary: Vec<String> = logs
        .containing("message=topology declared")
        .into_iter()
        .filter(|l| l.split(' ').any(|w| w == queue))
        .collect();
    assert_eq!(summary.len(), 1, "{summary:#?}");
    let bindings =
        plan.bindings().len() + cascade.bindings().len() + cascade.exchange_bindings().len();
    for field in [
        format!(
            "exchanges={}",
            plan.exchanges().len() + cascade.exchanges().len()
        ),
        format!("queues={}", plan.queues().len() + cascade.queues().len()),
        format!("bindings={bindings}"),
        "cascade_levels=7".to_owned(),
    ] {
        assert!(
            summary[0].split(' ').any(|w| w == field),
            "{field} in {}",
            summary[0]
        );
    }

    t.teardown(&plan).await.unwrap();
    t.teardown_cascade(cascade).await.unwrap();
    assert!(queue_names(&p).await.is_empty());
    assert!(list_exchanges(&p).await.is_empty());
}

#[tokio::test]
async fn two_work_queues_share_one_cascade_and_teardown_leaves_it_to_the_other() {
    let Some(config) = broker("cascade-shared").await else {
        return;
    };
    let p = prefix("shared");
    let short_q = unique("casc-short");
    let long_q = unique("casc-long");
    let settings = Cascade::new().with_prefix(&p).with_unit(ms(100));
    // 3 units need levels 0 and 1; 10 units need 0 to 3.
    let short = plan(&short_q, &[ms(300)], settings.clone());
    let long = plan(&long_q, &[ms(1_000)], settings);
    let (small, big) = (short.cascade().unwrap(), long.cascade().unwrap());
    assert_eq!((small.levels(), big.levels()), (2, 4));
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&short);
    cleanup.plan(&long);
    let t = transport(&config).await;

    let first = t.provision_inspected(&short).await.unwrap();
    assert_eq!(
        first.created.len(),
        small.exchanges().len() + small.queues().len() + own_objects(&short).len()
    );
    let second = t.provision_inspected(&long).await.unwrap();
    // The second work queue creates its own objects and the two levels above, and finds the
    // delivery exchange and the lower levels there.
    let shared = cascade_objects(small);
    let mut created = second.created.clone();
    created.sort();
    let mut want: Vec<String> = cascade_objects(big)
        .into_iter()
        .filter(|o| !shared.contains(o))
        .chain(own_objects(&long))
        .collect();
    want.sort();
    assert_eq!(created, want);
    assert_eq!(
        want.len(),
        2 * 2 + own_objects(&long).len(),
        "two levels above: {want:?}"
    );
    assert_eq!(second.verified, shared);
    assert_eq!(
        list_bindings(&p).await,
        cascade_bindings(big, &[&short, &long])
    );

    // Each work queue's clones come out at its own work queue, through the same levels.
    let (_conn, ch) = raw().await;
    publish(
        &t,
        &short_q,
        "s",
        short.route_for(ms(300)).unwrap().0,
        ms(300),
    )
    .await;
    publish(
        &t,
        &long_q,
        "l",
        long.route_for(ms(500)).unwrap().0,
        ms(500),
    )
    .await;
    assert_eq!(
        arrivals(&ch, &short_q, 1, Duration::from_secs(5))
            .await
            .len(),
        1
    );
    assert_eq!(
        arrivals(&ch, &long_q, 1, Duration::from_secs(5))
            .await
            .len(),
        1
    );

    // One work queue's teardown leaves the cascade to the other.
    t.teardown(&short).await.unwrap();
    let mut whole: Vec<String> = big.queues().iter().map(|q| q.name.clone()).collect();
    whole.sort();
    assert_eq!(queue_names(&p).await, whole);
    let mut exchanges: Vec<String> = big.exchanges().iter().map(|e| e.name.clone()).collect();
    exchanges.sort();
    assert_eq!(list_exchanges(&p).await, exchanges);
    assert_eq!(list_bindings(&p).await, cascade_bindings(big, &[&long]));
    publish(
        &t,
        &long_q,
        "l2",
        long.route_for(ms(700)).unwrap().0,
        ms(700),
    )
    .await;
    assert_eq!(
        arrivals(&ch, &long_q, 1, Duration::from_secs(5))
            .await
            .len(),
        1
    );
    t.teardown(&long).await.unwrap();
    assert_eq!(
        queue_names(&p).await,
        whole,
        "the last work queue's teardown too"
    );

    // Only `teardown_cascade` deletes it, bindings and all.
    t.teardown_cascade(big).await.unwrap();
    assert!(queue_names(&p).await.is_empty());
    assert!(list_exchanges(&p).await.is_empty());
    assert!(list_bindings(&p).await.is_empty());
}

#[tokio::test]
async fn a_clone_waits_its_delay_and_a_short_one_overtakes_a_long_one() {
    let Some(config) = broker("cascade-delays").await else {
        return;
    };
    let p = prefix("delays");
    let q = unique("casc-delays");
    // A 10 ms unit: 2 s is 200 units (levels 3, 6 and 7), 100 ms is 10 (levels 1 and 3).
    let plan = plan(&q, &[ms(100), ms(2_000)], Cascade::new().with_prefix(&p));
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let (_conn, ch) = raw().await;

    let (long, short) = (ms(2_000), ms(100));
    let long_sent = Instant::now();
    publish(&t, &q, "long", plan.route_for(long).unwrap().0, long).await;
    let short_sent = Instant::now();
    publish(&t, &q, "short", plan.route_for(short).unwrap().0, short).await;
    let got = arrivals(&ch, &q, 2, Duration::from_secs(10)).await;
    let order: Vec<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        order,
        ["short", "long"],
        "the short delay must not wait behind the long"
    );
    let short_waited = got[0].1 - short_sent;
    let long_waited = got[1].1 - long_sent;
    assert!(short_waited >= short, "arrived after {short_waited:?}");
    assert!(long_waited >= long, "arrived after {long_waited:?}");
    assert!(
        got[0].1 - long_sent < long,
        "the short clone came only after the long one's delay: {:?}",
        got[0].1 - long_sent
    );

    // A crashed suspect goes the same way to the isolation queue.
    let crash = ms(50);
    let sent = Instant::now();
    publish(&t, &q, "suspect", plan.divert_route(crash), crash).await;
    let got = arrivals(&ch, plan.isolation_queue(), 1, Duration::from_secs(5)).await;
    assert_eq!(
        got.len(),
        1,
        "the suspect reached {}",
        plan.isolation_queue()
    );
    assert!(
        got[0].1 - sent >= crash,
        "arrived after {:?}",
        got[0].1 - sent
    );
    assert_eq!(message_count(&ch, &q).await.unwrap(), 0);
}

#[tokio::test]
async fn a_conflicting_level_queue_is_reported_by_name() {
    let Some(config) = broker("cascade-conflict").await else {
        return;
    };
    let p = prefix("conflict");
    let q = unique("casc-conflict");
    let plan = plan(&q, &[ms(500)], Cascade::new().with_prefix(&p));
    let cascade = plan.cascade().unwrap();
    let level = &cascade.queues()[2];
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    cleanup.queue(level.name.clone());
    let (_conn, ch) = raw().await;
    // Level 2 exists already, with another TTL.
    let mut args = FieldTable::default();
    args.insert("x-message-ttl".into(), AMQPValue::LongInt(5_000));
    declare_durable(&ch, &level.name, args).await;

    let t = transport(&config).await;
    for inspected in [false, true] {
        let err = if inspected {
            t.provision_inspected(&plan).await.map(drop).unwrap_err()
        } else {
            t.provision(&plan).await.unwrap_err()
        };
        let TransportError::TopologyConflict {
            object,
            argument,
            existing,
            wanted,
        } = &err
        else {
            panic!("expected a conflict, got {err}");
        };
        assert_eq!(object, &format!("queue {:?}", level.name), "{err}");
        assert!(
            argument == "x-message-ttl" || argument.starts_with("x-dead-letter"),
            "{err}"
        );
        assert!(!existing.is_empty() && !wanted.is_empty(), "{err}");
    }
    // Declared first, the cascade stopped the plan's own objects from being declared.
    assert!(queue_names(&q).await.is_empty());

    ch.queue_delete(level.name.as_str().into(), Default::default())
        .await
        .unwrap();
    t.teardown(&plan).await.unwrap();
    t.teardown_cascade(cascade).await.unwrap();
    assert!(queue_names(&p).await.is_empty());
    assert!(list_exchanges(&p).await.is_empty());
}
