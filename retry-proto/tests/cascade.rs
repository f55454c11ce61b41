//! The delay cascade: its topology as data, its routing keys, and the engine's routes
//! through it.

use std::time::Duration;

use retry_proto::headers;
use retry_proto::*;

const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn cascade_plan(queue: &str, policy: &RetryPolicy, cascade: Cascade) -> TopologyPlan {
    TopologyPlan::builder(queue, policy)
        .with_strategy(DelayStrategy::Cascade(cascade))
        .build()
        .unwrap()
}

/// The 32 bit words of a key, lowest first, from the bits given highest first.
fn bits(binary: &str) -> String {
    let mut words: Vec<&str> = binary
        .chars()
        .rev()
        .map(|c| if c == '1' { "1" } else { "0" })
        .collect();
    words.resize(32, "0");
    words.join(".")
}

#[test]
fn golden_routing_keys() {
    let policy = RetryPolicy::delays([secs(60)]).build().unwrap();
    let plan = cascade_plan("comments", &policy, Cascade::new());
    let cascade = plan.cascade().unwrap();
    // 60 s is 6,000 units of 10 ms: 13 bits.
    assert_eq!(cascade.levels(), 13);
    assert_eq!(cascade.max_delay(), ms(81_910));
    // (delay, bits of its units highest first, hops)
    let table = [
        (ms(0), "0", 0),
        (ms(1), "1", 1),
        (ms(10), "1", 1),
        (ms(15), "10", 1),
        (ms(50), "101", 2),
        (secs(1), "1100100", 3),
        (secs(20), "11111010000", 6),
        (secs(60), "1011101110000", 7),
    ];
    for (delay, binary, hops) in table {
        let (route, expiration) = plan.route_for(delay).unwrap();
        let want = format!("{}.comments", bits(binary));
        assert_eq!(&*route.routing_key, want, "{delay:?}");
        assert_eq!(&*route.exchange, "retry.cascade.10ms.12", "{delay:?}");
        assert_eq!(expiration, None, "every level has its own TTL");
        assert_eq!(cascade.hops(delay), hops, "{delay:?}");
        assert_eq!(cascade.destination_of(&want), Some("comments"));
        assert_eq!(cascade.delay_of(&want), Some(cascade.rounded(delay)));
    }
    assert_eq!(cascade.rounded(ms(15)), ms(20));
    assert_eq!(
        cascade.units(secs(3600)),
        8191,
        "a delay past the top is cut to the most the cascade holds"
    );
    assert_eq!(cascade.destination_of("comments.retry.1m"), None);
    assert_eq!(cascade.delay_of("comments"), None);
}

#[test]
fn golden_topology_of_a_three_level_cascade() {
    let policy = RetryPolicy::delays([secs(1), secs(5)]).build().unwrap();
    let plan = cascade_plan("orders", &policy, Cascade::new().with_unit(secs(1)));
    let cascade = plan.cascade().unwrap();
    assert_eq!(cascade.levels(), 3, "5 units need 3 bits");

    let exchanges: Vec<_> = cascade
        .exchanges()
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.durable))
        .collect();
    assert_eq!(
        exchanges,
        [
            ("retry.cascade.1s.deliver", ExchangeKind::Topic, true),
            ("retry.cascade.1s.00", ExchangeKind::Topic, true),
            ("retry.cascade.1s.01", ExchangeKind::Topic, true),
            ("retry.cascade.1s.02", ExchangeKind::Topic, true),
        ]
    );
    let level = |ttl: i64, next: &str| -> Headers {
        [
            ("x-queue-type", HeaderValue::from("classic")),
            ("x-message-ttl", HeaderValue::Int(ttl)),
            ("x-dead-letter-exchange", HeaderValue::from(next)),
        ]
        .into_iter()
        .collect()
    };
    let queues: Vec<_> = cascade
        .queues()
        .iter()
        .map(|q| (q.name.as_str(), q.role, q.arguments.to_headers()))
        .collect();
    assert_eq!(
        queues,
        [
            (
                "retry.cascade.1s.00",
                QueueRole::CascadeLevel {
                    level: 0,
                    ttl: secs(1)
                },
                level(1_000, "retry.cascade.1s.deliver")
            ),
            (
                "retry.cascade.1s.01",
                QueueRole::CascadeLevel {
                    level: 1,
                    ttl: secs(2)
                },
                level(2_000, "retry.cascade.1s.00")
            ),
            (
                "retry.cascade.1s.02",
                QueueRole::CascadeLevel {
                    level: 2,
                    ttl: secs(4)
                },
                level(4_000, "retry.cascade.1s.01")
            ),
        ]
    );
    let to_queues: Vec<_> = cascade
        .bindings()
        .iter()
        .map(|b| {
            (
                b.exchange.as_str(),
                b.routing_key.as_str(),
                b.queue.as_str(),
            )
        })
        .collect();
    assert_eq!(
        to_queues,
        [
            ("retry.cascade.1s.00", "1.#", "retry.cascade.1s.00"),
            ("retry.cascade.1s.01", "*.1.#", "retry.cascade.1s.01"),
            ("retry.cascade.1s.02", "*.*.1.#", "retry.cascade.1s.02"),
        ]
    );
    let onwards: Vec<_> = cascade
        .exchange_bindings()
        .iter()
        .map(|b| {
            (
                b.source.as_str(),
                b.routing_key.as_str(),
                b.destination.as_str(),
            )
        })
        .collect();
    assert_eq!(
        onwards,
        [
            ("retry.cascade.1s.00", "0.#", "retry.cascade.1s.deliver"),
            ("retry.cascade.1s.01", "*.0.#", "retry.cascade.1s.00"),
            ("retry.cascade.1s.02", "*.*.0.#", "retry.cascade.1s.01"),
        ]
    );

    // The work queue's own objects: no delay queues, and a binding from the delivery
    // exchange that matches its name exactly after the 32 bit words.
    assert!(
        plan.queues()
            .iter()
            .all(|q| !matches!(q.role, QueueRole::Delay { .. }))
    );
    assert!(plan.delay_routes().is_empty());
    let delivery: Vec<_> = plan
        .bindings()
        .iter()
        .filter(|b| b.exchange == "retry.cascade.1s.deliver")
        .map(|b| (b.queue.as_str(), b.routing_key.clone()))
        .collect();
    let pattern = |q: &str| format!("{}{q}", "*.".repeat(32));
    assert_eq!(
        delivery,
        [
            ("orders", pattern("orders")),
            // The default policy diverts crashed suspects through a crash delay.
            ("orders.suspect", pattern("orders.suspect")),
        ]
    );
}

#[test]
fn two_work_queues_share_one_cascade() {
    let short = RetryPolicy::delays([secs(1)]).build().unwrap();
    let long = RetryPolicy::delays([secs(1), secs(600)]).build().unwrap();
    let a = cascade_plan("alpha", &short, Cascade::new());
    let b = cascade_plan("beta", &short, Cascade::new());
    assert_eq!(a.cascade(), b.cascade(), "same policy, same cascade");
    let c = cascade_plan("gamma", &long, Cascade::new());
    let (small, big) = (a.cascade().unwrap(), c.cascade().unwrap());
    assert!(big.levels() > small.levels());
    let n = small.queues().len();
    assert_eq!(
        small.queues(),
        &big.queues()[..n],
        "the longer policy's cascade adds levels on top of the same ones"
    );
    assert_eq!(small.exchange_bindings(), &big.exchange_bindings()[..n]);
    assert_eq!(small.bindings(), &big.bindings()[..n]);
    assert_eq!(small.delivery_exchange(), big.delivery_exchange());
    // Nothing of one work queue's is in the cascade.
    for name in ["alpha", "beta", "gamma"] {
        assert!(
            big.queues().iter().all(|q| !q.name.contains(name)),
            "{name}"
        );
    }
}

#[test]
fn quorum_cascades_are_separate_and_dead_letter_at_least_once() {
    let policy = RetryPolicy::delays([secs(1)]).build().unwrap();
    let plan = TopologyPlan::builder("q", &policy)
        .with_queue_type(QueueType::Quorum)
        .with_strategy(DelayStrategy::Cascade(
            Cascade::new().with_prefix("shop.delays"),
        ))
        .build()
        .unwrap();
    let cascade = plan.cascade().unwrap();
    assert_eq!(cascade.entry_exchange(), "shop.delays.10ms.quorum.06");
    for q in cascade.queues() {
        assert_eq!(q.arguments.queue_type, QueueType::Quorum, "{}", q.name);
        assert!(q.arguments.at_least_once, "{}", q.name);
        assert_eq!(q.arguments.overflow, Some(Overflow::RejectPublish));
    }
}

#[test]
fn crash_delays_go_through_the_cascade_to_the_isolation_queue() {
    let policy = RetryPolicy::delays([secs(30)])
        .with_crash_delay(secs(5))
        .build()
        .unwrap();
    let plan = cascade_plan("work", &policy, Cascade::new());
    assert_eq!(plan.crash_route(), None, "no crash-delay queue");
    let route = plan.divert_route(secs(5));
    assert_eq!(
        &*route.routing_key,
        format!("{}.work.suspect", bits("111110100"))
    );
    assert_eq!(&plan.divert_route(Duration::ZERO), plan.isolation_route());
    assert!(
        plan.bindings()
            .iter()
            .any(|b| b.queue == "work.suspect" && b.exchange == "retry.cascade.10ms.deliver"),
        "the isolation queue is bound to the delivery exchange"
    );

    // The engine sends a crashed suspect that way.
    let mut e = Engine::new(policy, &plan).unwrap();
    let f = DeliveryFacts::decode(
        &[(headers::ATTEMPTS, HeaderValue::Int(1))]
            .into_iter()
            .collect(),
        BrokerSignals {
            redelivered: true,
            delivery_count: None,
        },
        7,
    );
    e.handle_delivery(T0, Lane::Isolation, f, ());
    let Some(Action::Publish { publish, .. }) = e.poll_action() else {
        panic!("a diverted suspect is published");
    };
    assert_eq!(publish.route, route);
    assert_eq!(publish.expiration, None);
}

#[test]
fn the_engine_routes_a_retry_after_by_its_exact_delay() {
    let policy = RetryPolicy::delays([secs(10), secs(60)]).build().unwrap();
    let plan = cascade_plan("work", &policy, Cascade::new());
    for asked in [ms(1_234), secs(20), secs(59)] {
        let mut e = Engine::new(policy.clone(), &plan).unwrap();
        let f = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), 1);
        let id = e.handle_delivery(T0, Lane::Work, f, ());
        e.handle_timeout(T0);
        assert!(matches!(e.poll_action(), Some(Action::RunHandler { .. })));
        e.handle_outcome(T0, id, Outcome::RetryAfter(asked, "429".into()))
            .unwrap();
        let Some(Action::Publish { publish, .. }) = e.poll_action() else {
            panic!("a retry is published");
        };
        let clamped = asked.clamp(secs(10), secs(60));
        assert_eq!(publish.route, plan.route_for(clamped).unwrap().0);
        assert_eq!(
            plan.cascade().unwrap().delay_of(&publish.route.routing_key),
            Some(clamped),
            "asked {asked:?}, clamped into the policy's bounds"
        );
        assert_eq!(publish.expiration, None);
    }
}

#[test]
fn a_plan_whose_cascade_is_too_short_for_the_policy_is_refused() {
    let short = RetryPolicy::delays([secs(1)]).build().unwrap();
    let long = RetryPolicy::delays([secs(1), secs(60)]).build().unwrap();
    let plan = cascade_plan("work", &short, Cascade::new());
    let err = Engine::<()>::new(long, &plan).unwrap_err();
    assert_eq!(
        err,
        PlanMismatch::BeyondCascade {
            queue: "work".into(),
            delay: secs(60),
            max: ms(1_270),
        }
    );
    assert!(err.to_string().contains("holds at most 1.27s"), "{err}");
}

#[test]
fn bad_cascade_settings_are_refused_by_name() {
    let policy = RetryPolicy::delays([secs(60)]).build().unwrap();
    let build = |queue: &str, cascade: Cascade| {
        TopologyPlan::builder(queue, &policy)
            .with_strategy(DelayStrategy::Cascade(cascade))
            .build()
            .unwrap_err()
    };
    assert_eq!(
        build("q", Cascade::new().with_unit(Duration::ZERO)),
        TopologyError::InvalidCascadeUnit {
            unit: Duration::ZERO
        }
    );
    assert_eq!(
        build("q", Cascade::new().with_unit(Duration::from_micros(1_500))),
        TopologyError::InvalidCascadeUnit {
            unit: Duration::from_micros(1_500)
        }
    );
    for levels in [0, 12, 33] {
        assert_eq!(
            build("q", Cascade::new().with_levels(levels)),
            TopologyError::CascadeLevels {
                levels,
                needed: 13,
                longest: secs(60)
            },
            "{levels} levels"
        );
    }
    let e = build(
        "q",
        Cascade::new()
            .with_unit(Duration::from_secs(1))
            .with_levels(32),
    );
    assert!(
        matches!(e, TopologyError::CascadeLevelTooLong { level: 31, .. }),
        "{e:?}"
    );
    for prefix in ["", "amq.delays"] {
        assert_eq!(
            build("q", Cascade::new().with_prefix(prefix)),
            TopologyError::InvalidCascadePrefix {
                prefix: prefix.into()
            }
        );
    }
    for queue in ["orders.*", "a.#.b"] {
        let e = build(queue, Cascade::new());
        assert_eq!(e, TopologyError::WildcardInQueueName { name: queue.into() });
        assert!(e.to_string().contains(queue), "{e}");
    }
    // 64 bytes of bit words ride in front of the queue name in the routing key.
    let long = "q".repeat(200);
    TopologyPlan::new(&long, &policy).expect("a 200-byte queue name fits without a cascade");
    let e = build(&long, Cascade::new());
    assert!(
        matches!(&e, TopologyError::NameTooLong { len: 272, .. }),
        "{e:?}"
    );
}
