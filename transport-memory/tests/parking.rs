//! The parking lot ([`ParkingLot`]) on the broker model, on virtual time: filters by time,
//! reason and id, a replay paced by its rate, a dry run, a replay that meets its own copies
//! parked again, a copy the broker does not confirm, a connection lost part way, and
//! topology probes a running consumer
//! acknowledges without its handler. The API's round trip (browse, replay by reason, purge
//! by id, the consumer handling the copy on attempt 1) is the conformance suite's
//! `parking_lot` scenario, which runs on this broker too.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use retry_core::headers::{self, REPLAYS};
use retry_core::{
    Consumer, DeadLetterReason, HandlerError, HeaderValue, MIN_REPLAY_RATE, Message, ParkedFilter,
    ParkedReason, ParkingError, ParkingLot, Pick, ReplayOptions, RetryPolicy, Timestamp,
    TopologyPlan,
};
use transport_memory::{Broker, MemoryTransport, Outgoing};

const T0: u64 = 1_700_000_000_000;

fn policy() -> RetryPolicy {
    RetryPolicy::delays([Duration::from_secs(1)])
        .with_max_attempts(1)
        .build()
        .unwrap()
}

/// A broker with `queue`'s plan declared, and the plan.
fn broker(queue: &str) -> (Broker, TopologyPlan) {
    let broker = Broker::builder()
        .with_start_at(Timestamp::from_millis(T0))
        .build();
    let plan = TopologyPlan::new(queue, &policy()).unwrap();
    broker.provision(&plan).unwrap();
    (broker, plan)
}

/// Parks `id` as the engine would have, for `reason`, at `at` ms after T0.
fn park(broker: &Broker, plan: &TopologyPlan, id: &str, reason: &str, at: u64) {
    broker
        .publish(
            Outgoing::to_queue(plan.parking_queue(), format!("body of {id}").into_bytes())
                .with_message_id(id)
                .with_header(headers::REASON, reason)
                .with_header(headers::ATTEMPTS, 3i64)
                .with_header(headers::LAST_FAILURE, (T0 + at) as i64)
                .with_header(headers::LAST_ERROR, format!("{id} failed"))
                .with_header("tenant", "acme"),
        )
        .unwrap();
}

/// The ids in `queue`, in order.
fn ids(broker: &Broker, queue: &str) -> Vec<String> {
    broker
        .messages(queue)
        .unwrap()
        .into_iter()
        .map(|m| m.properties.message_id.unwrap_or_default())
        .collect()
}

#[test]
fn filters_by_parked_time_reason_and_id_and_leaves_the_order() {
    let (broker, plan) = broker("times");
    for (i, reason) in ["permanent", "crash-loop", "permanent", "bogus"]
        .into_iter()
        .enumerate()
    {
        park(&broker, &plan, &format!("m{i}"), reason, 1000 * i as u64);
    }
    let lot = ParkingLot::new(broker.connect(), &plan);
    let browse = |filter: ParkedFilter| {
        let mut seen = Vec::new();
        broker
            .block_on(lot.browse(&filter, |p| {
                seen.push(p.id().unwrap().to_owned());
                ControlFlow::Continue(())
            }))
            .unwrap();
        seen
    };
    let at = |ms: u64| Timestamp::from_millis(T0 + ms);
    assert_eq!(
        browse(ParkedFilter::all().parked_before(at(2000))),
        ["m0", "m1"]
    );
    assert_eq!(
        browse(ParkedFilter::all().parked_after(at(1000))),
        ["m1", "m2", "m3"]
    );
    assert_eq!(
        browse(
            ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent))
                .parked_after(at(1))
        ),
        ["m2"]
    );
    assert_eq!(
        browse(ParkedFilter::reason(ParkedReason::Malformed)),
        ["m3"]
    );
    assert_eq!(browse(ParkedFilter::ids(["m3", "m0", "zz"])), ["m0", "m3"]);
    // A browse that stops early leaves everything too.
    let mut first = None;
    let report = broker
        .block_on(lot.browse(&ParkedFilter::all(), |p| {
            first = Some(p.id().unwrap().to_owned());
            ControlFlow::Break(())
        }))
        .unwrap();
    assert_eq!((first.as_deref(), report.seen), (Some("m0"), 1));
    assert_eq!(
        ids(&broker, plan.parking_queue()),
        ["m0", "m1", "m2", "m3"],
        "every browse put every message back where it was"
    );
}

#[test]
fn a_replay_keeps_body_properties_and_user_headers_and_resets_counters() {
    let (broker, plan) = broker("copy");
    park(&broker, &plan, "a", "crash-loop", 5);
    let lot = ParkingLot::new(broker.connect(), &plan);
    let report = broker
        .block_on(lot.replay(&ParkedFilter::all(), ReplayOptions::default(), |_| {}))
        .unwrap();
    assert_eq!((report.replayed, report.left), (1, 0));
    let copy = broker.messages(plan.work_queue()).unwrap().remove(0);
    assert_eq!(copy.body, b"body of a");
    assert_eq!(copy.properties.message_id.as_deref(), Some("a"));
    assert_eq!(
        (copy.exchange.as_str(), copy.routing_key.as_str()),
        ("", "copy")
    );
    let h = &copy.headers;
    assert_eq!(h.get("tenant").and_then(HeaderValue::as_str), Some("acme"));
    for reset in [
        headers::REASON,
        headers::LAST_FAILURE,
        headers::FIRST_FAILURE,
        headers::LAST_ERROR,
    ] {
        assert_eq!(h.get(reset), None, "{reset} kept");
    }
    // Reset to 0, which is not written.
    assert_eq!(h.get(headers::ATTEMPTS), None);
    assert_eq!(h.get(REPLAYS).and_then(HeaderValue::as_u64), Some(1));
    assert_eq!(
        h.get(headers::REPLAYED_AT).and_then(HeaderValue::as_u64),
        Some(T0)
    );
    assert_eq!(
        h.get(headers::PREVIOUS_REASON)
            .and_then(HeaderValue::as_str),
        Some("crash-loop")
    );
    assert_eq!(
        h.get(headers::PREVIOUS_ERROR).and_then(HeaderValue::as_str),
        Some("a failed")
    );
    assert!(broker.messages(plan.parking_queue()).unwrap().is_empty());
}

#[test]
fn a_replay_is_paced_by_its_rate_and_a_dry_run_moves_nothing() {
    let (broker, plan) = broker("paced");
    for i in 0..10 {
        park(&broker, &plan, &format!("m{i}"), "permanent", 0);
    }
    let lot = ParkingLot::new(broker.connect(), &plan);
    let dry = broker
        .block_on(lot.replay(
            &ParkedFilter::all(),
            ReplayOptions::default().with_dry_run(true),
            |_| {},
        ))
        .unwrap();
    assert_eq!((dry.matched, dry.replayed, dry.left), (10, 0, 10));
    assert_eq!(broker.messages(plan.parking_queue()).unwrap().len(), 10);

    let started = broker.now();
    let report = broker
        .block_on(lot.replay(
            &ParkedFilter::all(),
            ReplayOptions::default().with_rate(5.0),
            |_| {},
        ))
        .unwrap();
    assert_eq!(report.replayed, 10);
    // The tenth replay is due 9/5 s after the first.
    assert_eq!(
        broker.now().saturating_duration_since(started),
        Duration::from_millis(1800)
    );
    assert_eq!(ids(&broker, plan.work_queue()).len(), 10);
}

/// A consumer that parks each copy again while the replay runs: each message is replayed
/// once, and its copy parked again is left for the next run.
#[test]
fn a_message_is_replayed_at_most_once_per_run() {
    let (broker, plan) = broker("once");
    for i in 0..5 {
        park(&broker, &plan, &format!("m{i}"), "permanent", 0);
    }
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |_: Message| {
            let runs = Arc::clone(&runs);
            async move {
                // The bug is not fixed for the first three rounds.
                if runs.fetch_add(1, Ordering::SeqCst) < 15 {
                    Err(HandlerError::permanent("still broken"))
                } else {
                    Ok(())
                }
            }
        }
    };
    let consumer = Consumer::builder(broker.connect(), plan.work_queue(), policy(), handler)
        .build()
        .unwrap();
    let lot = ParkingLot::new(broker.connect(), &plan);
    let (report, run) = broker.block_on(async {
        let stop = broker.sleep(Duration::from_secs(10));
        let replay = async {
            // Let the consumer start first.
            broker.sleep(Duration::from_millis(10)).await;
            // Paced, so the consumer parks copies again while the replay still runs.
            let options = ReplayOptions::default().with_rate(10.0);
            lot.replay(&ParkedFilter::all(), options, |_| {}).await
        };
        futures::join!(replay, consumer.run(stop))
    });
    let report = report.unwrap();
    run.unwrap();
    assert_eq!(report.replayed, 5, "{report:?}");
    assert!(
        report.seen > 5,
        "no copy was parked again during the run: {report:?}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 5, "each copy ran once");
    assert_eq!(broker.messages(plan.parking_queue()).unwrap().len(), 5);
}

#[test]
fn a_connection_lost_part_way_loses_nothing() {
    let (broker, plan) = broker("lost");
    for i in 0..20 {
        park(&broker, &plan, &format!("m{i:02}"), "permanent", 0);
    }
    let transport: MemoryTransport = broker.connect().without_recovery();
    let id = transport.connection_id();
    let lot = ParkingLot::new(transport, &plan);
    let filter = ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent));
    let err = broker
        .block_on(lot.replay(&filter, ReplayOptions::default(), |report| {
            if report.replayed == 7 {
                broker.close_connection(id, "forced");
            }
        }))
        .unwrap_err();
    assert!(
        matches!(err, ParkingError::Interrupted { .. }),
        "{err}: {err:?}"
    );
    assert_eq!(err.report().replayed, 7, "{err}");
    let mut all: BTreeMap<String, usize> = BTreeMap::new();
    for q in [plan.parking_queue(), plan.work_queue()] {
        for id in ids(&broker, q) {
            *all.entry(id).or_default() += 1;
        }
    }
    assert_eq!(
        all.len(),
        20,
        "every message is parked or replayed: {all:?}"
    );
    assert_eq!(ids(&broker, plan.work_queue()).len(), 7);
}

/// A copy the broker refuses (a negative confirm) or never takes (a lost publish) stops the
/// replay with the message named, and its original stays parked, unchanged: it is acked
/// only after its copy is confirmed.
#[test]
fn a_copy_the_broker_does_not_confirm_leaves_its_original_parked() {
    for lose in [false, true] {
        let (broker, plan) = broker(if lose { "lost-copy" } else { "refused-copy" });
        for i in 0..5 {
            park(&broker, &plan, &format!("m{i}"), "permanent", 0);
        }
        let before = broker.messages(plan.parking_queue()).unwrap();
        let lot = ParkingLot::new(broker.connect(), &plan);
        let err = broker
            .block_on(
                lot.replay(&ParkedFilter::all(), ReplayOptions::default(), |report| {
                    if report.replayed == 2 {
                        if lose {
                            broker.lose_publishes(1);
                        } else {
                            broker.refuse_publishes(1);
                        }
                    }
                }),
            )
            .unwrap_err();
        let ParkingError::Interrupted { report, source } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(report.replayed, 2, "{err}");
        match &**source {
            ParkingError::CopyRefused {
                message, source, ..
            } => {
                assert_eq!(message, "m2", "{err}");
                assert_eq!(source.is_some(), lose, "{err:?}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ids(&broker, plan.work_queue()), ["m0", "m1"]);
        let after = broker.messages(plan.parking_queue()).unwrap();
        assert_eq!(after.len(), 3, "m2 and the two after it stay parked");
        for message in &after {
            let was = before
                .iter()
                .find(|b| b.properties.message_id == message.properties.message_id)
                .unwrap();
            assert_eq!(
                (&message.headers, &message.body),
                (&was.headers, &was.body),
                "{:?} changed",
                message.properties.message_id
            );
        }
    }
}

#[test]
fn a_rate_below_the_slowest_is_refused_before_anything_is_read() {
    let (broker, plan) = broker("rates");
    park(&broker, &plan, "a", "permanent", 0);
    let lot = ParkingLot::new(broker.connect(), &plan);
    // 1e-300 a second once panicked pacing the second message (a wait of 1e300 s).
    for rate in [
        0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        1e-300,
        MIN_REPLAY_RATE / 2.0,
    ] {
        let options = ReplayOptions::default().with_rate(rate);
        let err = broker
            .block_on(lot.replay(&ParkedFilter::all(), options, |_| {}))
            .unwrap_err();
        assert!(
            matches!(err, ParkingError::InvalidRate { .. }),
            "{rate}: {err:?}"
        );
        assert!(err.to_string().contains("replay rate"), "{err}");
    }
    assert_eq!(ids(&broker, plan.parking_queue()), ["a"]);
    assert_eq!(broker.stats(plan.parking_queue()).unwrap().unacked, 0);
}

#[test]
fn an_unknown_parking_queue_is_an_error_naming_it() {
    let broker = Broker::new();
    let lot = ParkingLot::with_queues(broker.connect(), "nowhere", "nowhere.parking");
    let err = broker
        .block_on(lot.purge(&ParkedFilter::all(), |_| {}))
        .unwrap_err();
    assert!(
        matches!(&err, ParkingError::UnknownQueue { queue } if queue == "nowhere.parking"),
        "{err:?}"
    );
    assert_eq!(err.to_string(), "queue \"nowhere.parking\" does not exist");
}

#[test]
fn a_running_consumer_acknowledges_probes_without_running_its_handler() {
    let (broker, plan) = broker("probed");
    let runs = Arc::new(AtomicU32::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |_: Message| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<(), HandlerError>(()) }
        }
    };
    broker
        .publish(
            Outgoing::to_queue(plan.work_queue(), b"probe".to_vec())
                .with_header(headers::PROBE, "p-1"),
        )
        .unwrap();
    broker
        .publish(Outgoing::to_queue(plan.work_queue(), b"work".to_vec()))
        .unwrap();
    // The crash-delay queue's probe comes back to the isolation queue, where suspects run
    // alone.
    broker
        .publish(
            Outgoing::to_queue(plan.isolation_queue(), b"probe".to_vec())
                .with_header(headers::PROBE, "p-2"),
        )
        .unwrap();
    let consumer = Consumer::builder(broker.connect(), plan.work_queue(), policy(), handler)
        .build()
        .unwrap();
    let report = broker
        .block_on(consumer.run(broker.sleep(Duration::from_secs(1))))
        .unwrap();
    assert_eq!((report.probes, report.received, report.handled), (2, 1, 1));
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran for a probe"
    );
    for queue in [plan.work_queue(), plan.isolation_queue()] {
        let stats = broker.stats(queue).unwrap();
        assert_eq!((stats.ready, stats.unacked), (0, 0), "{queue}");
    }
}

/// A purge that takes only what its pick takes: the rest of what the filter matches stays,
/// and is not counted as matched.
#[test]
fn a_purge_takes_only_what_its_pick_takes() {
    let (broker, plan) = broker("picked");
    for i in 0..6 {
        park(&broker, &plan, &format!("m{i}"), "permanent", 0);
    }
    let lot = ParkingLot::new(broker.connect(), &plan);
    let report = broker
        .block_on(lot.purge_picked(
            &ParkedFilter::all(),
            |m: &Message| {
                let id = m.properties().message_id.as_deref().unwrap_or("");
                if ["m1", "m4"].contains(&id) {
                    Pick::Take
                } else {
                    Pick::Leave
                }
            },
            |_| {},
        ))
        .unwrap();
    assert_eq!(
        (report.seen, report.matched, report.purged, report.left),
        (6, 2, 2, 4)
    );
    assert_eq!(
        ids(&broker, plan.parking_queue()),
        ["m0", "m2", "m3", "m5"],
        "the order of what was left is kept"
    );
    assert_eq!(broker.stats(plan.parking_queue()).unwrap().unacked, 0);
}

/// A pick that stops the walk is asked once a paced message's turn has come: a replay
/// cancelled while it waits replays nothing more, and leaves every message in place.
#[test]
fn a_paced_replay_stopped_by_its_pick_replays_nothing_more() {
    let (broker, plan) = broker("stopped");
    for i in 0..5 {
        park(&broker, &plan, &format!("m{i}"), "permanent", 0);
    }
    let lot = ParkingLot::new(broker.connect(), &plan);
    let cancel_at = Timestamp::from_millis(T0 + 1500);
    let clock = broker.clone();
    let mut asked = Vec::new();
    let report = broker
        .block_on(lot.replay_picked(
            &ParkedFilter::all(),
            ReplayOptions::default().with_rate(1.0),
            |m: &Message| {
                asked.push((
                    m.properties().message_id.clone().unwrap_or_default(),
                    clock.now(),
                ));
                if clock.now() >= cancel_at {
                    Pick::Stop
                } else {
                    Pick::Take
                }
            },
            |_| {},
        ))
        .unwrap();
    // m0 at once, m1 after 1 s; m2's turn comes at 2 s, after the cancel: it is not replayed.
    assert_eq!((report.replayed, report.matched), (2, 2), "{report:?}");
    assert_eq!(asked.len(), 3);
    assert_eq!(asked[2].1, Timestamp::from_millis(T0 + 2000));
    assert_eq!(ids(&broker, plan.work_queue()), ["m0", "m1"]);
    assert_eq!(ids(&broker, plan.parking_queue()), ["m2", "m3", "m4"]);
    assert_eq!(broker.stats(plan.parking_queue()).unwrap().unacked, 0);
}
