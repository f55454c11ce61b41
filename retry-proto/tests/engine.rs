//! Table-driven tests for every decision rule of the engine.

use std::time::Duration;

use retry_proto::headers::{self, Origin};
use retry_proto::*;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn engine(policy: RetryPolicy) -> Engine {
    let plan = TopologyPlan::new("work", &policy).unwrap();
    Engine::new(policy, &plan).unwrap()
}

/// An engine over quorum queues, which count deliveries in `x-delivery-count`.
fn quorum_engine(policy: RetryPolicy) -> Engine {
    let plan = TopologyPlan::builder("work", &policy)
        .with_queue_type(QueueType::Quorum)
        .build()
        .unwrap();
    Engine::new(policy, &plan).unwrap()
}

/// The default policy, but a publish the broker does not confirm requeues at once.
fn no_publish_retries() -> RetryPolicy {
    RetryPolicy::builder()
        .with_publish_retries(0, Duration::ZERO)
        .build()
        .unwrap()
}

/// What a driver does at `now`: fire the waits that are due, then take every action.
fn drain(engine: &mut Engine, now: Timestamp) -> Vec<Action> {
    engine.handle_timeout(now);
    std::iter::from_fn(|| engine.poll_action()).collect()
}

fn facts(headers: &[(&str, HeaderValue)], redelivered: bool) -> DeliveryFacts {
    let h: Headers = headers.iter().cloned().collect();
    DeliveryFacts::decode(
        &h,
        BrokerSignals {
            redelivered,
            delivery_count: None,
        },
        42,
    )
}

/// A fresh delivery from `lane` whose first run failed transiently: its publish is next.
fn failed_once(e: &mut Engine, lane: Lane) -> DeliveryId {
    let id = e.handle_delivery(T0, lane, facts(&[], false), ());
    expect_run(&drain(e, T0));
    e.handle_outcome(T0, id, Outcome::Transient("x".into()))
        .unwrap();
    id
}

fn expect_run(actions: &[Action]) -> (DeliveryId, u32) {
    match actions {
        [Action::RunHandler { delivery, attempt }] => (*delivery, *attempt),
        other => panic!("expected one RunHandler, got {other:?}"),
    }
}

fn expect_publish(actions: &[Action]) -> Publish {
    match actions {
        [Action::Publish { publish, .. }] => publish.clone(),
        other => panic!("expected one Publish, got {other:?}"),
    }
}

fn expect_settle(actions: &[Action]) -> (Settlement, Terminal) {
    match actions {
        [
            Action::Settle {
                settlement,
                terminal,
                ..
            },
        ] => (*settlement, *terminal),
        other => panic!("expected one Settle, got {other:?}"),
    }
}

/// Runs one delivery through one handler outcome and, if a publish follows, a confirm.
/// Returns the publish (if any) and the final settlement.
fn one_round(
    policy: RetryPolicy,
    facts: DeliveryFacts,
    outcome: Outcome,
    confirm: Confirm,
) -> (Option<Publish>, Settlement, Terminal) {
    let mut e = engine(policy);
    let id = e.handle_delivery(T0, Lane::Work, facts, ());
    let (run_id, _) = expect_run(&drain(&mut e, T0));
    assert_eq!(run_id, id);
    e.handle_outcome(T0, id, outcome).unwrap();
    let actions = drain(&mut e, T0);
    if let [Action::Settle { .. }] = actions.as_slice() {
        let (s, t) = expect_settle(&actions);
        return (None, s, t);
    }
    let publish = expect_publish(&actions);
    e.handle_confirm(T0, id, confirm).unwrap();
    let (s, t) = expect_settle(&drain(&mut e, T0));
    assert_eq!(e.in_flight(), 0);
    (Some(publish), s, t)
}

#[test]
fn success_acks_without_publishing() {
    let (publish, settlement, terminal) = one_round(
        RetryPolicy::default(),
        facts(&[], false),
        Outcome::Success,
        Confirm::Ack,
    );
    assert_eq!(publish, None);
    assert_eq!(settlement, Settlement::Ack);
    assert_eq!(terminal, Terminal::Handled { attempt: 1 });
}

#[test]
fn transient_failures_follow_the_schedule_then_dead_letter() {
    let spring = RetryPolicy::exponential(secs(1), 3.0, secs(10))
        .with_max_attempts(5)
        .build()
        .unwrap();
    // (failed runs so far on the message, expected route, expected delay)
    let table = [
        (0, Some("work.retry.1s"), 1),
        (1, Some("work.retry.3s"), 3),
        (2, Some("work.retry.9s"), 9),
        (3, Some("work.retry.10s"), 10),
        (4, None, 0),
    ];
    for (attempts, route, delay) in table {
        let f = facts(&[(headers::ATTEMPTS, HeaderValue::Int(attempts))], false);
        let (publish, settlement, terminal) = one_round(
            spring.clone(),
            f,
            Outcome::Transient("boom".into()),
            Confirm::Ack,
        );
        let publish = publish.unwrap();
        assert_eq!(settlement, Settlement::Ack);
        match route {
            Some(key) => {
                assert_eq!(&*publish.route.exchange, "work.retry");
                assert_eq!(
                    &*publish.route.routing_key, key,
                    "after {attempts} failures"
                );
                assert_eq!(publish.expiration, None);
                assert_eq!(publish.headers.attempts, attempts as u32 + 1);
                assert_eq!(publish.headers.delay, Some(secs(delay)));
                assert_eq!(publish.headers.reason, None);
                assert_eq!(
                    terminal,
                    Terminal::Retried {
                        attempts: attempts as u32 + 1,
                        delay: secs(delay)
                    }
                );
            }
            None => {
                assert_eq!(&*publish.route.exchange, "work.dead-letter");
                assert_eq!(&*publish.route.routing_key, "work");
                assert_eq!(
                    publish.headers.reason,
                    Some(DeadLetterReason::AttemptsExhausted)
                );
                assert_eq!(publish.headers.attempts, 5);
                assert_eq!(
                    terminal,
                    Terminal::DeadLettered {
                        reason: DeadLetterReason::AttemptsExhausted
                    }
                );
            }
        }
    }
}

#[test]
fn exhausted_messages_are_dropped_when_the_policy_says_so() {
    let policy = RetryPolicy::delays([secs(1)])
        .with_on_exhausted(Exhausted::Drop)
        .build()
        .unwrap();
    let f = facts(&[(headers::ATTEMPTS, HeaderValue::Int(1))], false);
    let (publish, settlement, terminal) = one_round(
        policy.clone(),
        f,
        Outcome::Transient("x".into()),
        Confirm::Ack,
    );
    assert_eq!(publish, None);
    assert_eq!(settlement, Settlement::Ack);
    assert_eq!(
        terminal,
        Terminal::Dropped {
            reason: DeadLetterReason::AttemptsExhausted
        }
    );
    // Permanent failures are still parked: dropping is only for exhausted retries.
    let (publish, _, terminal) = one_round(
        policy,
        facts(&[], false),
        Outcome::Permanent("bad".into()),
        Confirm::Ack,
    );
    assert!(publish.is_some());
    assert_eq!(
        terminal,
        Terminal::DeadLettered {
            reason: DeadLetterReason::Permanent
        }
    );
}

#[test]
fn permanent_failure_is_parked_at_once_with_diagnostics() {
    let policy = RetryPolicy::default();
    let first = Timestamp::from_millis(T0.as_millis() - 5_000);
    let f = facts(
        &[
            (headers::ATTEMPTS, HeaderValue::Int(1)),
            (headers::CRASHES, HeaderValue::Int(1)),
            (
                headers::FIRST_FAILURE,
                HeaderValue::Int(first.as_millis() as i64),
            ),
        ],
        false,
    );
    let long_cause = "x".repeat(5_000);
    let (publish, settlement, terminal) =
        one_round(policy, f, Outcome::Permanent(long_cause), Confirm::Ack);
    let publish = publish.unwrap();
    assert_eq!(settlement, Settlement::Ack);
    assert_eq!(
        terminal,
        Terminal::DeadLettered {
            reason: DeadLetterReason::Permanent
        }
    );
    assert_eq!(&*publish.route.exchange, "work.dead-letter");
    let h = &publish.headers;
    assert_eq!(h.reason, Some(DeadLetterReason::Permanent));
    assert_eq!((h.attempts, h.crashes), (2, 1));
    assert_eq!((h.first_failure, h.last_failure), (Some(first), Some(T0)));
    assert!(h.last_error.as_ref().unwrap().len() <= headers::MAX_ERROR_LEN);

    // The headers a transport writes carry all of it, plus the origin.
    let original: Headers = [("x-death", HeaderValue::Array(vec![]))]
        .into_iter()
        .collect();
    let origin = Origin {
        queue: "work",
        exchange: "orders",
        routing_key: "order.created",
    };
    let written = headers::clone_headers(&original, origin, h);
    let record = ParkedRecord::decode(&written);
    assert_eq!(record.reason, Some(DeadLetterReason::Permanent));
    assert_eq!(record.attempts, 2);
    assert_eq!(record.crashes, 1);
    assert_eq!(record.first_failure, Some(first));
    assert_eq!(record.last_failure, Some(T0));
    assert_eq!(record.origin_queue, Some("work"));
    assert_eq!(record.origin_exchange, Some("orders"));
    assert_eq!(record.origin_routing_key, Some("order.created"));
    assert!(record.last_error.unwrap().ends_with('…'));
    assert!(record.malformed.is_empty());
    assert!(written.get("x-death").is_none());
}

#[test]
fn a_refused_returned_or_failed_publish_requeues_the_original() {
    for confirm in [Confirm::Nack, Confirm::Returned, Confirm::Failed] {
        for outcome in [
            Outcome::Transient("t".into()),
            Outcome::Permanent("p".into()),
        ] {
            let (publish, settlement, terminal) =
                one_round(no_publish_retries(), facts(&[], false), outcome, confirm);
            assert!(publish.is_some());
            assert_eq!(settlement, Settlement::Requeue, "{confirm:?}");
            assert_eq!(terminal, Terminal::Requeued { cause: confirm });
        }
    }
}

#[test]
fn nothing_is_settled_before_the_confirm() {
    let mut e = engine(RetryPolicy::default());
    let id = failed_once(&mut e, Lane::Work);
    expect_publish(&drain(&mut e, T0));
    // However long the confirm takes, nothing else comes out.
    let later = T0 + secs(3600);
    assert_eq!(drain(&mut e, later), vec![]);
    assert_eq!(e.poll_timeout(), None);
    assert_eq!(e.in_flight(), 1);
    e.handle_confirm(later, id, Confirm::Ack).unwrap();
    let (settlement, _) = expect_settle(&drain(&mut e, later));
    assert_eq!(settlement, Settlement::Ack);
}

#[test]
fn immediate_retries_run_in_process_before_delayed_ones() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_immediate_retries(2, Duration::from_millis(100))
        .build()
        .unwrap();
    assert_eq!(policy.max_attempts(), 4);
    let mut e = engine(policy);
    let id = e.handle_delivery(T0, Lane::Work, facts(&[], false), ());
    assert_eq!(expect_run(&drain(&mut e, T0)).1, 1);

    let mut now = T0;
    for attempt in 2..=3 {
        e.handle_outcome(now, id, Outcome::Transient(format!("fail {attempt}")))
            .unwrap();
        // Waiting in-process: no action until the wait is over.
        assert_eq!(drain(&mut e, now), vec![]);
        let due = now + Duration::from_millis(100);
        assert_eq!(e.poll_timeout(), Some(due));
        // A spurious timeout fires nothing, and polling alone never fires a wait.
        e.handle_timeout(now + Duration::from_millis(99));
        assert_eq!(e.poll_action(), None);
        now = due;
        assert_eq!(e.poll_action(), None, "poll_action only drains");
        assert_eq!(expect_run(&drain(&mut e, now)), (id, attempt));
        assert_eq!(e.poll_timeout(), None);
    }
    e.handle_outcome(now, id, Outcome::Transient("fail 3".into()))
        .unwrap();
    let publish = expect_publish(&drain(&mut e, now));
    assert_eq!(&*publish.route.routing_key, "work.retry.30s");
    assert_eq!(publish.headers.attempts, 3);
    assert_eq!(publish.headers.first_failure, Some(T0));
    assert_eq!(publish.headers.last_failure, Some(now));
    assert_eq!(publish.headers.last_error.as_deref(), Some("fail 3"));
}

#[test]
fn zero_wait_immediate_retry_runs_at_once() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_immediate_retries(1, Duration::ZERO)
        .build()
        .unwrap();
    let mut e = engine(policy);
    let id = failed_once(&mut e, Lane::Work);
    assert_eq!(expect_run(&drain(&mut e, T0)), (id, 2));
    e.handle_outcome(T0, id, Outcome::Success).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, T0)),
        (Settlement::Ack, Terminal::Handled { attempt: 2 })
    );
}

#[test]
fn retry_after_uses_the_asked_delay_clamped_to_the_policy() {
    let policy = RetryPolicy::delays([secs(10), secs(60), secs(600)])
        .build()
        .unwrap();
    // (asked, expected delay, expected route, expected expiration)
    let table = [
        (secs(1), secs(10), "work.retry.10s", None),
        (secs(10), secs(10), "work.retry.10s", None),
        (secs(30), secs(30), "work.retry.1m", Some(secs(30))),
        (secs(600), secs(600), "work.retry.10m", None),
        (secs(86_400), secs(600), "work.retry.10m", None),
    ];
    for (asked, delay, route, expiration) in table {
        let (publish, _, terminal) = one_round(
            policy.clone(),
            facts(&[], false),
            Outcome::RetryAfter(asked, "429".into()),
            Confirm::Ack,
        );
        let publish = publish.unwrap();
        assert_eq!(&*publish.route.routing_key, route, "asked {asked:?}");
        assert_eq!(publish.expiration, expiration, "asked {asked:?}");
        assert_eq!(publish.headers.delay, Some(delay));
        assert_eq!(terminal, Terminal::Retried { attempts: 1, delay });
    }
}

#[test]
fn retry_after_still_respects_max_attempts() {
    let policy = RetryPolicy::delays([secs(10)]).build().unwrap();
    let f = facts(&[(headers::ATTEMPTS, HeaderValue::Int(1))], false);
    let (_, _, terminal) = one_round(
        policy,
        f,
        Outcome::RetryAfter(secs(5), "429".into()),
        Confirm::Ack,
    );
    assert_eq!(
        terminal,
        Terminal::DeadLettered {
            reason: DeadLetterReason::AttemptsExhausted
        }
    );
}

#[test]
fn elapsed_cap_dead_letters_with_its_reason() {
    let policy = RetryPolicy::delays([secs(60), secs(600)])
        .with_max_elapsed(secs(300))
        .build()
        .unwrap();
    // (seconds since first failure, expected)
    let table = [
        (0, None),
        (240, None), // 240 + 60 = 300: still within the cap
        (241, Some(DeadLetterReason::MaxElapsed)),
        (10_000, Some(DeadLetterReason::MaxElapsed)),
    ];
    for (ago, expected) in table {
        let first = Timestamp::from_millis(T0.as_millis() - ago * 1000);
        let f = facts(
            &[(
                headers::FIRST_FAILURE,
                HeaderValue::Int(first.as_millis() as i64),
            )],
            false,
        );
        let (_, _, terminal) = one_round(
            policy.clone(),
            f,
            Outcome::Transient("x".into()),
            Confirm::Ack,
        );
        match expected {
            None => assert!(matches!(terminal, Terminal::Retried { .. }), "{ago}"),
            Some(reason) => assert_eq!(terminal, Terminal::DeadLettered { reason }, "{ago}"),
        }
    }
}

#[test]
fn a_redelivered_work_delivery_is_isolated_as_a_suspect_without_counting_a_crash() {
    let policy = RetryPolicy::delays([secs(30), secs(600)]).build().unwrap();
    let mut e = engine(policy);
    let f = facts(
        &[
            (headers::ATTEMPTS, HeaderValue::Int(1)),
            (headers::CRASHES, HeaderValue::Int(2)),
            (headers::FIRST_FAILURE, HeaderValue::Int(5_000)),
        ],
        true,
    );
    let id = e.handle_delivery(T0, Lane::Work, f, ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*publish.route.exchange, "work.retry");
    assert_eq!(&*publish.route.routing_key, "work.suspect");
    assert_eq!(publish.expiration, None);
    let h = &publish.headers;
    assert_eq!((h.attempts, h.crashes), (1, 2), "nothing is counted");
    assert_eq!(
        (h.first_failure, h.last_failure),
        (None, None),
        "dates kept"
    );
    assert_eq!((&h.last_error, h.reason, h.delay), (&None, None, None));
    e.handle_confirm(T0, id, Confirm::Ack).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, T0)),
        (Settlement::Ack, Terminal::Isolated)
    );

    // A quorum queue's count is evidence too.
    let mut e = quorum_engine(RetryPolicy::default());
    e.handle_delivery(
        T0,
        Lane::Work,
        facts(&[("x-delivery-count", HeaderValue::Int(1))], false),
        (),
    );
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*publish.route.routing_key, "work.suspect");
}

#[test]
fn a_fresh_suspect_runs_and_takes_the_normal_retry_path() {
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let mut e = engine(policy);
    let id = e.handle_delivery(T0, Lane::Isolation, facts(&[], false), ());
    let (_, attempt) = expect_run(&drain(&mut e, T0));
    assert_eq!(attempt, 1);
    e.handle_outcome(T0, id, Outcome::Transient("x".into()))
        .unwrap();
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(
        &*publish.route.routing_key, "work.retry.30s",
        "back to the work queue"
    );
    assert_eq!(publish.headers.crashes, 0);
}

#[test]
fn a_suspect_redelivered_from_the_isolation_queue_counts_a_crash_and_waits_the_crash_delay() {
    let policy = RetryPolicy::delays([secs(30), secs(600)])
        .with_crash_delay(secs(5))
        .build()
        .unwrap();
    let mut e = engine(policy);
    let f = facts(&[(headers::ATTEMPTS, HeaderValue::Int(1))], true);
    let id = e.handle_delivery(T0, Lane::Isolation, f, ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*publish.route.routing_key, "work.crash.5s");
    assert_eq!(publish.headers.crashes, 1);
    assert_eq!(
        publish.headers.attempts, 1,
        "a crash is not a failed attempt"
    );
    assert_eq!(publish.headers.delay, Some(secs(5)));
    assert_eq!(publish.headers.first_failure, Some(T0));
    assert!(publish.headers.last_error.unwrap().contains("crash"));
    e.handle_confirm(T0, id, Confirm::Ack).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, T0)),
        (
            Settlement::Ack,
            Terminal::Diverted {
                crashes: 1,
                delay: secs(5)
            }
        )
    );
}

#[test]
fn crash_limit_parks_with_reason_crash_loop() {
    let policy = RetryPolicy::default(); // crash limit 3
    // (crashes recorded, redelivered, x-delivery-count, expected): one crash per redelivery
    // from the isolation queue, whatever the broker's count.
    let table: [(i64, bool, Option<i64>, Option<u32>); 6] = [
        (0, true, None, Some(1)),
        (2, true, None, Some(3)),
        (3, true, None, None),
        (0, false, Some(3), Some(1)),
        (3, false, Some(1), None),
        (1, true, Some(3), Some(2)),
    ];
    for (crashes, redelivered, count, diverted_with) in table {
        let mut h = vec![(headers::CRASHES, HeaderValue::Int(crashes))];
        if let Some(n) = count {
            h.push(("x-delivery-count", HeaderValue::Int(n)));
        }
        let mut e = quorum_engine(policy.clone());
        let id = e.handle_delivery(T0, Lane::Isolation, facts(&h, redelivered), ());
        let publish = expect_publish(&drain(&mut e, T0));
        e.handle_confirm(T0, id, Confirm::Ack).unwrap();
        let (_, terminal) = expect_settle(&drain(&mut e, T0));
        match diverted_with {
            Some(n) => {
                assert_eq!(publish.headers.crashes, n);
                assert!(matches!(terminal, Terminal::Diverted { crashes, .. } if crashes == n));
            }
            None => {
                assert_eq!(&*publish.route.exchange, "work.dead-letter");
                assert_eq!(publish.headers.reason, Some(DeadLetterReason::CrashLoop));
                assert_eq!(publish.headers.crashes, 4);
                assert_eq!(
                    terminal,
                    Terminal::DeadLettered {
                        reason: DeadLetterReason::CrashLoop
                    }
                );
            }
        }
    }
}

#[test]
fn the_work_lane_never_counts_a_crash_however_often_it_is_redelivered() {
    let mut e = engine(RetryPolicy::default());
    let h = [
        (headers::CRASHES, HeaderValue::Int(3)),
        ("x-delivery-count", HeaderValue::Int(50)),
    ];
    e.handle_delivery(T0, Lane::Work, facts(&h, true), ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*publish.route.routing_key, "work.suspect");
    assert_eq!(publish.headers.crashes, 3);
    assert_eq!(publish.headers.reason, None);
}

#[test]
fn run_handler_mode_sends_a_crashed_suspect_straight_back_to_the_isolation_queue() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_on_crash(CrashAction::RunHandler)
        .with_crash_limit(1)
        .build()
        .unwrap();
    let plan = TopologyPlan::new("work", &policy).unwrap();
    assert_eq!(plan.crash_route(), None, "no crash-delay queue");
    let mut e = engine(policy.clone());
    let id = e.handle_delivery(T0, Lane::Isolation, facts(&[], true), ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*publish.route.routing_key, "work.suspect");
    assert_eq!((publish.headers.crashes, publish.headers.delay), (1, None));
    e.handle_confirm(T0, id, Confirm::Ack).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, T0)).1,
        Terminal::Diverted {
            crashes: 1,
            delay: Duration::ZERO
        }
    );

    // A second crash goes past the limit of 1.
    let mut e = engine(policy);
    let h = [(headers::CRASHES, HeaderValue::Int(1))];
    e.handle_delivery(T0, Lane::Isolation, facts(&h, true), ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(publish.headers.reason, Some(DeadLetterReason::CrashLoop));
}

#[test]
fn an_excused_suspect_runs_again_without_counting_a_crash() {
    let mut e = engine(RetryPolicy::default());
    e.excuse(42);
    let id = e.handle_delivery(T0, Lane::Isolation, facts(&[], true), ());
    expect_run(&drain(&mut e, T0));
    e.handle_outcome(T0, id, Outcome::Success).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, T0)).1,
        Terminal::Handled { attempt: 1 }
    );
    // An excuse is used once.
    e.handle_delivery(T0, Lane::Isolation, facts(&[], true), ());
    let publish = expect_publish(&drain(&mut e, T0));
    assert_eq!(publish.headers.crashes, 1);
}

/// The copy the engine puts in the isolation queue for a redelivered work delivery, as
/// the isolation queue would deliver it: with the headers the engine wrote.
fn isolated_copy(e: &mut Engine) -> Headers {
    let id = e.handle_delivery(T0, Lane::Work, facts(&[], true), ());
    let publish = expect_publish(&drain(e, T0));
    assert_eq!(&*publish.route.routing_key, "work.suspect");
    e.handle_confirm(T0, id, Confirm::Ack).unwrap();
    assert_eq!(expect_settle(&drain(e, T0)).1, Terminal::Isolated);
    let mut headers = Headers::new();
    publish.headers.write_into(&mut headers);
    headers
}

#[test]
fn an_excuse_belongs_to_one_copy_not_to_every_message_with_the_same_id() {
    // Two suspects with the same message id (the same identity, 42), isolated apart.
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let mut e = engine(policy);
    let first = isolated_copy(&mut e);
    let second = isolated_copy(&mut e);
    let signals = |redelivered| BrokerSignals {
        redelivered,
        delivery_count: None,
    };

    // The first runs alone and fails; its retry cannot be published, so it is requeued
    // and excused: it will come back redelivered through no crash of its own.
    let id = e.handle_delivery(
        T0,
        Lane::Isolation,
        DeliveryFacts::decode(&first, signals(false), 42),
        (),
    );
    expect_run(&drain(&mut e, T0));
    e.handle_outcome(T0, id, Outcome::Transient("x".into()))
        .unwrap();
    expect_publish(&drain(&mut e, T0));
    e.handle_confirm(T0, id, Confirm::Failed).unwrap();
    let mut t = T0;
    let settled = loop {
        let actions = drain(&mut e, t);
        match actions.as_slice() {
            [Action::Publish { .. }] => e.handle_confirm(t, id, Confirm::Failed).unwrap(),
            [] => t = e.poll_timeout().expect("a publish retry is due"),
            _ => break expect_settle(&actions),
        }
    };
    assert_eq!(settled.0, Settlement::Requeue);

    // The second crashed its consumer running alone: that is a crash, whatever excuse the
    // first has.
    e.handle_delivery(
        T0,
        Lane::Isolation,
        DeliveryFacts::decode(&second, signals(true), 42),
        (),
    );
    let diverted = expect_publish(&drain(&mut e, T0));
    assert_eq!(diverted.headers.crashes, 1, "the second's crash is counted");

    // The first comes back redelivered and is excused: it runs again, no crash counted.
    e.handle_delivery(
        T0,
        Lane::Isolation,
        DeliveryFacts::decode(&first, signals(true), 42),
        (),
    );
    expect_run(&drain(&mut e, T0));
}

#[test]
fn a_refused_publish_is_retried_with_doubling_waits_before_the_original_is_requeued() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_publish_retries(2, Duration::from_millis(100))
        .build()
        .unwrap();
    let mut e = engine(policy);
    let id = failed_once(&mut e, Lane::Work);
    let first = expect_publish(&drain(&mut e, T0));
    e.handle_confirm(T0, id, Confirm::Nack).unwrap();
    assert_eq!(
        drain(&mut e, T0),
        vec![],
        "nothing settles while retries remain"
    );
    let t1 = T0 + Duration::from_millis(100);
    assert_eq!(e.poll_timeout(), Some(t1));
    assert_eq!(
        expect_publish(&drain(&mut e, t1)),
        first,
        "the same clone again"
    );
    e.handle_confirm(t1, id, Confirm::Returned).unwrap();
    assert_eq!(e.poll_timeout(), Some(t1 + Duration::from_millis(200)));
    assert_eq!(drain(&mut e, t1 + Duration::from_millis(199)), vec![]);
    let t2 = t1 + Duration::from_millis(200);
    expect_publish(&drain(&mut e, t2));
    e.handle_confirm(t2, id, Confirm::Failed).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, t2)),
        (
            Settlement::Requeue,
            Terminal::Requeued {
                cause: Confirm::Failed
            }
        )
    );

    // A retry that is confirmed acks as if the first publish had been.
    let mut e = engine(RetryPolicy::delays([secs(30)]).build().unwrap());
    let id = failed_once(&mut e, Lane::Work);
    drain(&mut e, T0);
    e.handle_confirm(T0, id, Confirm::Nack).unwrap();
    let t1 = T0 + Duration::from_millis(100);
    expect_publish(&drain(&mut e, t1));
    e.handle_confirm(t1, id, Confirm::Ack).unwrap();
    assert_eq!(
        expect_settle(&drain(&mut e, t1)),
        (
            Settlement::Ack,
            Terminal::Retried {
                attempts: 1,
                delay: secs(30)
            }
        )
    );
}

#[test]
fn a_suspect_whose_clone_is_refused_is_put_back_fresh_for_any_process_to_run() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_publish_retries(0, Duration::ZERO)
        .build()
        .unwrap();
    let suspect = [
        (headers::ATTEMPTS, HeaderValue::Int(1)),
        (headers::CRASHES, HeaderValue::Int(1)),
        (headers::SUSPECT, HeaderValue::Int(77)),
    ];
    for confirm in [Confirm::Nack, Confirm::Returned, Confirm::Failed] {
        let mut e = engine(policy.clone());
        let id = e.handle_delivery(T0, Lane::Isolation, facts(&suspect, false), ());
        expect_run(&drain(&mut e, T0));
        e.handle_outcome(T0, id, Outcome::Transient("x".into()))
            .unwrap();
        assert_eq!(expect_publish(&drain(&mut e, T0)).headers.attempts, 2);
        // Requeued, it would come back redelivered: a crash to any process but this one.
        // A fresh copy goes back to the isolation queue instead, as it came: the run that
        // could not be recorded is not counted.
        e.handle_confirm(T0, id, confirm).unwrap();
        let fresh = expect_publish(&drain(&mut e, T0));
        assert_eq!(&*fresh.route.routing_key, "work.suspect", "{confirm:?}");
        assert_eq!(fresh.headers.attempts, 1);
        assert_eq!(fresh.headers.crashes, 1);
        assert!(
            fresh.headers.suspect.is_some_and(|t| t != 77),
            "a token of its own"
        );
        e.handle_confirm(T0, id, Confirm::Ack).unwrap();
        assert_eq!(
            expect_settle(&drain(&mut e, T0)),
            (Settlement::Ack, Terminal::Isolated)
        );
    }
}

#[test]
fn a_suspect_requeued_after_its_publish_failed_is_not_blamed_when_it_returns() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_publish_retries(0, Duration::ZERO)
        .build()
        .unwrap();
    let mut e = engine(policy);
    let id = failed_once(&mut e, Lane::Isolation);
    drain(&mut e, T0);
    e.handle_confirm(T0, id, Confirm::Nack).unwrap();
    // Its fresh copy is refused too: the original is requeued, and excused.
    expect_publish(&drain(&mut e, T0));
    e.handle_confirm(T0, id, Confirm::Nack).unwrap();
    assert_eq!(expect_settle(&drain(&mut e, T0)).0, Settlement::Requeue);
    // Back from the isolation queue, redelivered: it runs, no crash counted.
    e.handle_delivery(T0, Lane::Isolation, facts(&[], true), ());
    let (_, attempt) = expect_run(&drain(&mut e, T0));
    assert_eq!(attempt, 1);
}

#[test]
fn malformed_headers_are_read_as_absent() {
    let garbage = [
        HeaderValue::Str("3".into()),
        HeaderValue::Int(-1),
        HeaderValue::Int(i64::MAX),
        HeaderValue::UInt(u64::MAX),
        HeaderValue::Bytes(vec![0xff, 0xfe, 0x00]),
        HeaderValue::Float(2.0),
        HeaderValue::Null,
        HeaderValue::Array(vec![HeaderValue::Int(1)]),
    ];
    for value in garbage {
        let f = facts(
            &[
                (headers::ATTEMPTS, value.clone()),
                (headers::CRASHES, value.clone()),
                (headers::FIRST_FAILURE, value.clone()),
                ("x-delivery-count", value.clone()),
                ("x-death", value.clone()),
            ],
            false,
        );
        assert_eq!(f.attempts, 0, "{value:?}");
        assert_eq!(f.crashes, 0);
        assert_eq!(f.first_failure, None);
        assert_eq!(f.delivery_count, 0);
        assert_eq!(f.deaths, 0);
        let names: Vec<_> = f.malformed.names().collect();
        assert_eq!(
            names,
            [
                headers::ATTEMPTS,
                headers::CRASHES,
                headers::FIRST_FAILURE,
                "x-death",
                "x-delivery-count"
            ],
            "{value:?}"
        );
        // And the engine treats the delivery as a fresh one.
        let (_, _, terminal) = one_round(RetryPolicy::default(), f, Outcome::Success, Confirm::Ack);
        assert_eq!(terminal, Terminal::Handled { attempt: 1 });
    }
}

#[test]
fn broker_counters_are_read() {
    let death = |count: i64| {
        HeaderValue::Table(
            [
                ("count", HeaderValue::Int(count)),
                ("reason", HeaderValue::from("expired")),
                ("queue", HeaderValue::from("work.retry.30s")),
            ]
            .into_iter()
            .collect(),
        )
    };
    let h: Headers = [
        ("x-death", HeaderValue::Array(vec![death(2), death(3)])),
        ("x-delivery-count", HeaderValue::Int(1)),
    ]
    .into_iter()
    .collect();
    let f = DeliveryFacts::decode(
        &h,
        BrokerSignals {
            redelivered: false,
            delivery_count: Some(4),
        },
        0,
    );
    assert_eq!(f.deaths, 5);
    assert_eq!((f.delivery_count, f.x_delivery_count), (4, 1));
    assert_eq!(
        f.crash_evidence(),
        4,
        "the larger of x-delivery-count and AMQP 1.0's"
    );
    assert_eq!(f.crash_evidence(), 4);
    assert!(f.malformed.is_empty());

    // One bad entry makes the whole x-death unusable, and says so.
    let h: Headers = [(
        "x-death",
        HeaderValue::Array(vec![death(2), HeaderValue::Int(7)]),
    )]
    .into_iter()
    .collect();
    let f = DeliveryFacts::decode(&h, BrokerSignals::default(), 0);
    assert_eq!(f.deaths, 0);
    assert!(f.malformed.contains("x-death"));
}

#[test]
fn engine_refuses_inputs_out_of_turn() {
    let mut e = engine(RetryPolicy::default());
    let id = e.handle_delivery(T0, Lane::Work, facts(&[], false), ());
    drain(&mut e, T0);
    assert_eq!(
        e.handle_confirm(T0, id, Confirm::Ack),
        Err(EngineError::UnexpectedConfirm(id))
    );
    e.handle_outcome(T0, id, Outcome::Transient("x".into()))
        .unwrap();
    assert_eq!(
        e.handle_outcome(T0, id, Outcome::Success),
        Err(EngineError::UnexpectedOutcome(id))
    );
    e.handle_confirm(T0, id, Confirm::Ack).unwrap();
    drain(&mut e, T0);
    // Finished: the handle is stale, even after its slot is reused.
    assert_eq!(
        e.handle_outcome(T0, id, Outcome::Success),
        Err(EngineError::UnknownDelivery(id))
    );
    let next = e.handle_delivery(T0, Lane::Work, facts(&[], false), ());
    assert_ne!(next, id);
    assert_eq!(
        e.handle_confirm(T0, id, Confirm::Ack),
        Err(EngineError::UnknownDelivery(id))
    );
}

#[test]
fn forget_leaves_a_delivery_to_the_broker() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_immediate_retries(1, secs(1))
        .build()
        .unwrap();
    let mut e = engine(policy);
    let waiting = e.handle_delivery(T0, Lane::Work, facts(&[], false), ());
    let running = e.handle_delivery(T0, Lane::Work, facts(&[], false), ());
    drain(&mut e, T0);
    e.handle_outcome(T0, waiting, Outcome::Transient("x".into()))
        .unwrap();
    assert_eq!(e.forget(waiting), Some(()));
    assert_eq!(e.forget(running), Some(()));
    assert_eq!(e.forget(running), None);
    assert_eq!(e.in_flight(), 0);
    assert_eq!(e.poll_timeout(), None);
    assert_eq!(drain(&mut e, T0 + secs(10)), vec![]);
}

#[test]
fn engine_refuses_a_plan_made_for_another_policy() {
    let short = RetryPolicy::delays([secs(1)]).build().unwrap();
    let long = RetryPolicy::delays([secs(1), secs(60)]).build().unwrap();
    let plan = TopologyPlan::new("work", &short).unwrap();
    let err = Engine::<()>::new(long, &plan).unwrap_err();
    assert_eq!(
        err,
        PlanMismatch::MissingDelayLevel {
            queue: "work".into(),
            delay: secs(60)
        }
    );
    assert!(err.to_string().contains("60s"));

    let divert = RetryPolicy::delays([secs(1)])
        .with_crash_delay(secs(20))
        .build()
        .unwrap();
    let plan = TopologyPlan::new("work", &short).unwrap();
    let err = Engine::<()>::new(divert, &plan).unwrap_err();
    assert_eq!(
        err,
        PlanMismatch::MissingCrashDelay {
            queue: "work".into(),
            missing: "work.crash.20s".into(),
            delay: secs(20)
        }
    );
    assert!(err.to_string().contains("work.crash.20s"));
}

#[test]
fn jittered_delays_route_to_the_level_that_holds_them() {
    let policy = RetryPolicy::delays([secs(10), secs(100)])
        .with_jitter(Jitter::Full)
        .build()
        .unwrap();
    let plan = TopologyPlan::new("work", &policy).unwrap();
    for seed in 0..200u64 {
        let mut e = Engine::new(policy.clone(), &plan).unwrap();
        let f = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), seed);
        let id = e.handle_delivery(T0, Lane::Work, f, ());
        drain(&mut e, T0);
        e.handle_outcome(T0, id, Outcome::Transient("x".into()))
            .unwrap();
        let publish = expect_publish(&drain(&mut e, T0));
        let delay = publish.headers.delay.unwrap();
        assert!(delay <= secs(10));
        assert_eq!(&*publish.route.routing_key, "work.retry.10s");
        assert_eq!(publish.expiration, (delay < secs(10)).then_some(delay));
    }
}

#[test]
fn a_publisher_supplied_delivery_count_is_ignored_on_classic_queues() {
    // A shovel or a forwarding application copied x-delivery-count from another queue.
    let forged = || facts(&[("x-delivery-count", HeaderValue::Int(4))], false);
    let policy = RetryPolicy::builder().with_crash_limit(3).build().unwrap();

    // Classic queues never set it: the handler runs, in either lane.
    let mut e = engine(policy.clone());
    for lane in [Lane::Work, Lane::Isolation] {
        let id = e.handle_delivery(T0, lane, forged(), ());
        assert_eq!(expect_run(&drain(&mut e, T0)), (id, 1), "{lane:?}");
    }

    // A quorum queue sets it on each redelivery: there the same delivery is a suspect in
    // the work lane, and a crash in the isolation lane.
    let mut e = quorum_engine(policy);
    e.handle_delivery(T0, Lane::Work, forged(), ());
    let isolate = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*isolate.route.routing_key, "work.suspect");
    e.handle_delivery(T0, Lane::Isolation, forged(), ());
    let divert = expect_publish(&drain(&mut e, T0));
    assert_eq!(&*divert.route.routing_key, "work.crash.1s");
    assert_eq!(divert.headers.crashes, 1);
}

#[test]
fn the_callers_data_comes_back_with_the_settlement() {
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new("work", &policy).unwrap();
    let mut e: Engine<String> = Engine::new(policy, &plan).unwrap();
    let retried = e.handle_delivery(T0, Lane::Work, facts(&[], false), "tag-1".into());
    let handled = e.handle_delivery(T0, Lane::Work, facts(&[], false), "tag-2".into());
    let forgotten = e.handle_delivery(T0, Lane::Work, facts(&[], false), "tag-3".into());
    e.handle_timeout(T0);
    while e.poll_action().is_some() {}
    assert_eq!(e.data(handled).map(String::as_str), Some("tag-2"));
    e.data_mut(handled).unwrap().push_str("+seen");

    e.handle_outcome(T0, retried, Outcome::Transient("x".into()))
        .unwrap();
    e.handle_outcome(T0, handled, Outcome::Success).unwrap();
    assert!(
        matches!(e.poll_action(), Some(Action::Publish { delivery, .. }) if delivery == retried)
    );
    match e.poll_action() {
        Some(Action::Settle { delivery, data, .. }) => {
            assert_eq!(delivery, handled);
            assert_eq!(data, "tag-2+seen");
        }
        other => panic!("expected the handled delivery's settlement, got {other:?}"),
    }
    // Until its confirm, the retried delivery's data stays with the engine.
    assert_eq!(e.data(retried).map(String::as_str), Some("tag-1"));
    e.handle_confirm(T0, retried, Confirm::Ack).unwrap();
    assert!(matches!(
        e.poll_action(),
        Some(Action::Settle { data, .. }) if data == "tag-1"
    ));
    assert_eq!(
        e.data(retried),
        None,
        "a settled delivery's handle is stale"
    );

    assert_eq!(e.forget_all(), vec![(forgotten, "tag-3".to_owned())]);
    assert_eq!(e.in_flight(), 0);
    assert_eq!(e.poll_action(), None);
}
