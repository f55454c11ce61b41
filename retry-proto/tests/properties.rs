//! Property tests of the engine's invariants.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;
use retry_proto::headers::{self, Origin};
use retry_proto::*;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn arb_duration(max_ms: u64) -> impl Strategy<Value = Duration> {
    (0..=max_ms).prop_map(Duration::from_millis)
}

fn arb_backoff() -> impl Strategy<Value = Backoff> {
    prop_oneof![
        arb_duration(600_000).prop_map(Backoff::Fixed),
        (arb_duration(10_000), arb_duration(10_000), 0u64..600_000).prop_map(
            |(initial, step, extra)| Backoff::Linear {
                initial,
                step,
                max: initial + Duration::from_millis(extra)
            }
        ),
        (arb_duration(10_000), 1.0f64..5.0, 0u64..86_400_000).prop_map(
            |(initial, multiplier, extra)| Backoff::Exponential {
                initial,
                multiplier,
                max: initial + Duration::from_millis(extra)
            }
        ),
        prop::collection::vec(arb_duration(86_400_000), 1..6).prop_map(Backoff::List),
    ]
}

fn arb_jitter() -> impl Strategy<Value = Jitter> {
    prop_oneof![
        Just(Jitter::None),
        Just(Jitter::Full),
        Just(Jitter::Equal),
        Just(Jitter::Decorrelated),
    ]
}

prop_compose! {
    fn arb_policy()(
        backoff in arb_backoff(),
        jitter in arb_jitter(),
        attempts in 1u32..10,
        immediate in 0u32..3,
        wait in arb_duration(1_000),
        crash_limit in 0u32..4,
        run_on_crash in any::<bool>(),
        drop in any::<bool>(),
        elapsed in prop::option::of(1u64..100_000_000),
        publish_retries in 0u32..3,
        publish_wait in 1u64..1_000,
    ) -> RetryPolicy {
        let mut b = RetryPolicy::builder()
            .with_backoff(backoff)
            .with_jitter(jitter)
            .with_max_attempts(attempts)
            .with_immediate_retries(immediate, wait)
            .with_crash_limit(crash_limit)
            .with_on_crash(if run_on_crash { CrashAction::RunHandler } else { CrashAction::Divert })
            .with_on_exhausted(if drop { Exhausted::Drop } else { Exhausted::DeadLetter })
            .with_publish_retries(publish_retries, Duration::from_millis(publish_wait));
        if let Some(ms) = elapsed {
            b = b.with_max_elapsed(Duration::from_millis(ms));
        }
        b.build().expect("generated policies are valid")
    }
}

#[derive(Clone, Debug)]
enum Fate {
    Success,
    Transient,
    Permanent,
    RetryAfter(u64),
    /// The consumer dies holding the delivery: it comes back redelivered to its queue.
    Crash,
}

fn arb_fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        1 => Just(Fate::Success),
        4 => Just(Fate::Transient),
        1 => Just(Fate::Permanent),
        1 => (0u64..100_000_000).prop_map(Fate::RetryAfter),
        1 => Just(Fate::Crash),
    ]
}

fn outcome(fate: &Fate) -> Outcome {
    match fate {
        Fate::Success => Outcome::Success,
        Fate::Transient | Fate::Crash => Outcome::Transient("failed".into()),
        Fate::Permanent => Outcome::Permanent("bad".into()),
        Fate::RetryAfter(ms) => Outcome::RetryAfter(Duration::from_millis(*ms), "429".into()),
    }
}

/// How one message's life went.
struct Life {
    /// The run numbers the engine asked for.
    runs: Vec<u32>,
    /// Crashes while it ran from the work queue, beside other deliveries.
    work_crashes: u32,
    /// Crashes while it ran alone, from the isolation queue.
    solo_crashes: u32,
    /// The crash count its last copy carried.
    recorded_crashes: u32,
    /// How it ended.
    terminal: Terminal,
}

/// Follows one message through the broker: every clone comes back as a new delivery with the
/// clone's headers, from the queue its route leads to (the work queue, or the isolation
/// queue); a crash brings the same delivery back redelivered to the queue it came from.
fn life_of_a_message(policy: &RetryPolicy, fates: &[Fate], seed: u64) -> Life {
    let plan = TopologyPlan::new("q", policy).unwrap();
    let into_isolation = |route: &Route| {
        route == plan.isolation_route() || plan.crash_route().is_some_and(|(_, r)| r == route)
    };
    let mut engine = Engine::new(policy.clone(), &plan).unwrap();
    let mut headers = Headers::new();
    let mut redelivered = false;
    let mut lane = Lane::Work;
    let mut now = T0;
    let mut life = Life {
        runs: Vec::new(),
        work_crashes: 0,
        solo_crashes: 0,
        recorded_crashes: 0,
        terminal: Terminal::Isolated,
    };
    let mut fates = fates.iter().cycle();
    for _hop in 0..1_000 {
        let facts = DeliveryFacts::decode(
            &headers,
            BrokerSignals {
                redelivered,
                delivery_count: None,
            },
            seed,
        );
        let id = engine.handle_delivery(now, lane, facts, ());
        redelivered = false;
        let mut crashed = false;
        let mut next_lane = lane;
        while let Some(action) = engine.poll_action().or_else(|| {
            now = engine.poll_timeout()?;
            engine.handle_timeout(now);
            engine.poll_action()
        }) {
            match action {
                Action::RunHandler { delivery, attempt } => {
                    life.runs.push(attempt);
                    let fate = fates.next().unwrap();
                    if let Fate::Crash = fate {
                        assert!(engine.forget(delivery).is_some());
                        crashed = true;
                        break;
                    }
                    engine.handle_outcome(now, delivery, outcome(fate)).unwrap();
                }
                Action::Publish { delivery, publish } => {
                    let origin = Origin {
                        queue: "q",
                        exchange: "",
                        routing_key: "q",
                    };
                    headers = headers::clone_headers(&headers, origin, &publish.headers);
                    next_lane = if into_isolation(&publish.route) {
                        Lane::Isolation
                    } else {
                        Lane::Work
                    };
                    engine.handle_confirm(now, delivery, Confirm::Ack).unwrap();
                }
                Action::Settle { terminal, .. } => match terminal {
                    Terminal::Retried { delay, .. } | Terminal::Diverted { delay, .. } => {
                        now = now + delay;
                        break;
                    }
                    Terminal::Isolated => break,
                    other => {
                        life.recorded_crashes = ParkedRecord::decode(&headers).crashes;
                        life.terminal = other;
                        return life;
                    }
                },
            }
        }
        if crashed {
            redelivered = true;
            match lane {
                Lane::Work => life.work_crashes += 1,
                Lane::Isolation => life.solo_crashes += 1,
            }
        } else {
            lane = next_lane;
        }
        assert_eq!(engine.in_flight(), 0, "{id:?} left in flight");
    }
    panic!("message never finished: runs {:?}", life.runs);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn attempts_never_exceed_the_policy(
        policy in arb_policy(),
        fates in prop::collection::vec(arb_fate(), 1..20),
        seed in any::<u64>(),
    ) {
        let life = life_of_a_message(&policy, &fates, seed);
        let runs = &life.runs;
        prop_assert!(runs.iter().all(|a| *a >= 1 && *a <= policy.max_attempts()), "{runs:?}");
        if let Terminal::DeadLettered { reason: DeadLetterReason::AttemptsExhausted }
            | Terminal::Dropped { reason: DeadLetterReason::AttemptsExhausted } = life.terminal
        {
            prop_assert_eq!(runs.last().copied(), Some(policy.max_attempts()));
        }
    }

    #[test]
    fn only_crashes_while_running_alone_are_counted(
        policy in arb_policy(),
        fates in prop::collection::vec(arb_fate(), 1..20),
        seed in any::<u64>(),
    ) {
        let life = life_of_a_message(&policy, &fates, seed);
        prop_assert_eq!(life.recorded_crashes, life.solo_crashes);
        let crash_loop = DeadLetterReason::CrashLoop;
        let parked_for_crashes = life.terminal == Terminal::DeadLettered { reason: crash_loop };
        prop_assert_eq!(parked_for_crashes, life.solo_crashes > policy.crash_limit());
        if parked_for_crashes {
            prop_assert_eq!(life.solo_crashes, policy.crash_limit() + 1);
        }
        // However often it went down beside other deliveries, that alone never parks it.
        if life.solo_crashes == 0 {
            prop_assert_ne!(life.terminal, Terminal::DeadLettered { reason: crash_loop });
        }
    }

    #[test]
    fn delays_stay_within_their_bounds(policy in arb_policy(), seed in any::<u64>()) {
        let plan = TopologyPlan::new("q", &policy).unwrap();
        let bounds = policy.delay_bounds();
        for retry in policy.schedule(seed) {
            match retry {
                Retry::Immediate { wait } => prop_assert_eq!(wait, policy.immediate_wait()),
                Retry::Delayed { delay, index } => {
                    let (min, max) = bounds.unwrap();
                    prop_assert!(delay >= min && delay <= max, "{delay:?} not in {min:?}..={max:?}");
                    prop_assert!(delay <= policy.backoff().delay(index).max(max));
                    let (route, expiration) = plan.route_for(delay).unwrap();
                    let level = plan.delay_routes().iter().find(|(_, r)| *r == route).unwrap().0;
                    prop_assert!(delay <= level);
                    prop_assert_eq!(expiration, (delay < level).then_some(delay));
                }
            }
        }
        for asked in [Duration::ZERO, Duration::from_secs(1), MAX_TTL] {
            if let (Some(d), Some((min, max))) = (policy.clamp_delay(asked), bounds) {
                prop_assert!(d >= min && d <= max);
            }
        }
    }

    #[test]
    fn delay_levels_are_the_distinct_base_delays(
        backoff in arb_backoff(),
        attempts in 1u32..3_000,
    ) {
        let built = RetryPolicy::builder()
            .with_backoff(backoff.clone())
            .with_max_attempts(attempts)
            .build();
        let mut naive: Vec<Duration> = (0..attempts - 1).map(|i| backoff.delay(i)).collect();
        naive.sort_unstable();
        naive.dedup();
        match built {
            Ok(policy) => prop_assert_eq!(policy.delay_levels(), naive.as_slice()),
            Err(PolicyError::TooManyDelayLevels { count, retries, max, .. }) => {
                prop_assert_eq!(count, naive.len() as u64);
                prop_assert_eq!(retries, attempts - 1);
                prop_assert!(naive.len() > max);
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule(policy in arb_policy(), seed in any::<u64>()) {
        let a: Vec<_> = policy.schedule(seed).collect();
        let b: Vec<_> = policy.clone().schedule(seed).collect();
        prop_assert_eq!(a.len() as u32, policy.max_attempts() - 1);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn every_delivery_ends_once_and_never_before_its_confirm(
        policy in arb_policy(),
        deliveries in prop::collection::vec((any::<bool>(), any::<bool>(), 0i64..12, 0i64..5), 1..12),
        choices in prop::collection::vec((any::<prop::sample::Index>(), arb_fate(), 0u8..4), 1..400),
    ) {
        let plan = TopologyPlan::new("q", &policy).unwrap();
        let mut engine = Engine::new(policy.clone(), &plan).unwrap();
        let mut now = T0;
        let mut ids = Vec::new();
        for (i, (isolation, redelivered, attempts, crashes)) in deliveries.iter().enumerate() {
            let lane = if *isolation { Lane::Isolation } else { Lane::Work };
            let h: Headers = [
                (headers::ATTEMPTS, HeaderValue::Int(*attempts)),
                (headers::CRASHES, HeaderValue::Int(*crashes)),
            ].into_iter().collect();
            let f = DeliveryFacts::decode(&h, BrokerSignals { redelivered: *redelivered, delivery_count: None }, i as u64);
            ids.push(engine.handle_delivery(now, lane, f, ()));
        }
        let mut running = BTreeSet::new();
        let mut publishing = BTreeMap::new();
        let mut confirmed = BTreeMap::new();
        let mut settled = BTreeMap::new();
        let mut choices = choices.iter().cycle();
        for _ in 0..10_000 {
            engine.handle_timeout(now);
            while let Some(action) = engine.poll_action() {
                match action {
                    Action::RunHandler { delivery, .. } => {
                        prop_assert!(!settled.contains_key(&delivery));
                        prop_assert!(running.insert(delivery));
                    }
                    Action::Publish { delivery, .. } => {
                        prop_assert!(!settled.contains_key(&delivery));
                        prop_assert!(publishing.insert(delivery, ()).is_none(), "two publishes in flight");
                    }
                    Action::Settle { delivery, settlement, terminal, .. } => {
                        prop_assert!(settled.insert(delivery, terminal).is_none(), "settled twice");
                        prop_assert!(!running.contains(&delivery));
                        prop_assert!(!publishing.contains_key(&delivery), "settled before the confirm");
                        let published = confirmed.remove(&delivery);
                        match terminal {
                            Terminal::Retried { .. } | Terminal::Isolated | Terminal::Diverted { .. } | Terminal::DeadLettered { .. } => {
                                prop_assert_eq!(published, Some(Confirm::Ack));
                                prop_assert_eq!(settlement, Settlement::Ack);
                            }
                            Terminal::Requeued { cause } => {
                                prop_assert_eq!(published, Some(cause));
                                prop_assert_ne!(cause, Confirm::Ack);
                                prop_assert_eq!(settlement, Settlement::Requeue);
                            }
                            Terminal::Handled { .. } | Terminal::Dropped { .. } => {
                                prop_assert_eq!(published, None);
                                prop_assert_eq!(settlement, Settlement::Ack);
                            }
                        }
                    }
                }
            }
            if settled.len() == ids.len() {
                break;
            }
            let (pick, fate, confirm) = choices.next().unwrap();
            let pending: Vec<_> = running.iter().map(|d| (*d, true))
                .chain(publishing.keys().map(|d| (*d, false)))
                .collect();
            if pending.is_empty() {
                let due = engine.poll_timeout();
                prop_assert!(due.is_some(), "stuck with nothing pending");
                now = due.unwrap();
                continue;
            }
            let (id, is_run) = pending[pick.index(pending.len())];
            if is_run {
                running.remove(&id);
                engine.handle_outcome(now, id, outcome(fate)).unwrap();
            } else {
                publishing.remove(&id);
                let c = [Confirm::Ack, Confirm::Nack, Confirm::Returned, Confirm::Failed][*confirm as usize];
                confirmed.insert(id, c);
                engine.handle_confirm(now, id, c).unwrap();
            }
        }
        prop_assert_eq!(settled.len(), ids.len());
        prop_assert_eq!(engine.in_flight(), 0);
        engine.handle_timeout(now + MAX_TTL);
        prop_assert_eq!(engine.poll_action(), None);
    }

    #[test]
    fn decoding_arbitrary_headers_never_panics(
        values in prop::collection::vec((0usize..7, arb_value()), 0..10),
        redelivered in any::<bool>(),
        count in any::<Option<u32>>(),
    ) {
        let names = [
            headers::ATTEMPTS, headers::CRASHES, headers::FIRST_FAILURE,
            headers::LAST_FAILURE, "x-death", "x-delivery-count", headers::REASON,
        ];
        let h: Headers = values.into_iter().map(|(i, v)| (names[i], v)).collect();
        let f = DeliveryFacts::decode(&h, BrokerSignals { redelivered, delivery_count: count }, 0);
        prop_assert!(u64::from(f.attempts) <= MAX_COUNTER);
        prop_assert!(u64::from(f.delivery_count) <= MAX_COUNTER);
        let _ = ParkedRecord::decode(&h);
        let _ = admit(&RetryPolicy::default(), Lane::Work, &f);
        let _ = admit(&RetryPolicy::default(), Lane::Isolation, &f);
    }
}

fn arb_value() -> impl Strategy<Value = HeaderValue> {
    let leaf = prop_oneof![
        Just(HeaderValue::Null),
        any::<bool>().prop_map(HeaderValue::Bool),
        any::<i64>().prop_map(HeaderValue::Int),
        any::<u64>().prop_map(HeaderValue::UInt),
        any::<f64>().prop_map(HeaderValue::Float),
        ".{0,8}".prop_map(HeaderValue::Str),
        prop::collection::vec(any::<u8>(), 0..8).prop_map(HeaderValue::Bytes),
        any::<u64>().prop_map(|n| HeaderValue::Timestamp(Timestamp::from_millis(n))),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(HeaderValue::Array),
            prop::collection::vec(("count|reason|.{0,4}", inner), 0..4)
                .prop_map(|kv| HeaderValue::Table(kv.into_iter().collect())),
        ]
    })
}
