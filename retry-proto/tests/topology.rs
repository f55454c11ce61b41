//! The topology plan: names, arguments, bindings and routes.

use std::time::Duration;

use retry_proto::*;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn args(pairs: &[(&str, HeaderValue)]) -> Headers {
    pairs.iter().cloned().collect()
}

#[test]
fn per_delay_queue_plan_for_the_article_levels() {
    let policy = RetryPolicy::delays([secs(30), secs(600), secs(3600)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new("comments", &policy).unwrap();

    let exchanges: Vec<_> = plan
        .exchanges()
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.durable))
        .collect();
    assert_eq!(
        exchanges,
        [
            ("comments.retry", ExchangeKind::Direct, true),
            ("comments.dead-letter", ExchangeKind::Direct, true),
        ]
    );

    let queues: Vec<_> = plan
        .queues()
        .iter()
        .map(|q| (q.name.as_str(), q.role, q.arguments.to_headers()))
        .collect();
    let s = HeaderValue::from;
    let classic = ("x-queue-type", s("classic"));
    let to_work = [
        ("x-dead-letter-exchange", s("")),
        ("x-dead-letter-routing-key", s("comments")),
    ];
    let delay = |ms: i64| {
        args(&[
            classic.clone(),
            ("x-message-ttl", HeaderValue::Int(ms)),
            to_work[0].clone(),
            to_work[1].clone(),
        ])
    };
    assert_eq!(
        queues,
        [
            (
                "comments",
                QueueRole::Work,
                args(&[
                    classic.clone(),
                    ("x-dead-letter-exchange", s("comments.dead-letter")),
                    ("x-dead-letter-routing-key", s("comments")),
                ])
            ),
            (
                "comments.retry.30s",
                QueueRole::Delay { ttl: secs(30) },
                delay(30_000)
            ),
            (
                "comments.retry.10m",
                QueueRole::Delay { ttl: secs(600) },
                delay(600_000)
            ),
            (
                "comments.retry.1h",
                QueueRole::Delay { ttl: secs(3600) },
                delay(3_600_000)
            ),
            (
                "comments.suspect",
                QueueRole::Isolation,
                args(&[
                    classic.clone(),
                    ("x-dead-letter-exchange", s("comments.dead-letter")),
                    ("x-dead-letter-routing-key", s("comments")),
                ])
            ),
            (
                "comments.crash.30s",
                QueueRole::CrashDelay { ttl: secs(30) },
                args(&[
                    classic.clone(),
                    ("x-message-ttl", HeaderValue::Int(30_000)),
                    ("x-dead-letter-exchange", s("")),
                    ("x-dead-letter-routing-key", s("comments.suspect")),
                ])
            ),
            ("comments.parking", QueueRole::Parking, args(&[classic])),
        ]
    );
    assert!(plan.queues().iter().all(|q| q.durable));

    let bindings: Vec<_> = plan
        .bindings()
        .iter()
        .map(|b| {
            (
                b.exchange.as_str(),
                b.queue.as_str(),
                b.routing_key.as_str(),
            )
        })
        .collect();
    assert_eq!(
        bindings,
        [
            ("comments.retry", "comments.retry.30s", "comments.retry.30s"),
            ("comments.retry", "comments.retry.10m", "comments.retry.10m"),
            ("comments.retry", "comments.retry.1h", "comments.retry.1h"),
            ("comments.retry", "comments.suspect", "comments.suspect"),
            ("comments.retry", "comments.crash.30s", "comments.crash.30s"),
            ("comments.dead-letter", "comments.parking", "comments"),
        ]
    );
    assert_eq!(plan.isolation_queue(), "comments.suspect");
    assert_eq!(&*plan.isolation_route().routing_key, "comments.suspect");
    assert_eq!(plan.parking_queue(), "comments.parking");
    assert_eq!(&*plan.parking_route().exchange, "comments.dead-letter");
    assert_eq!(&*plan.parking_route().routing_key, "comments");
}

#[test]
fn every_route_reaches_a_declared_queue() {
    let policy = RetryPolicy::exponential(secs(1), 2.0, secs(3600))
        .with_max_attempts(15)
        .with_crash_delay(secs(7))
        .build()
        .unwrap();
    let plan = TopologyPlan::new("w", &policy).unwrap();
    let reaches = |exchange: &str, key: &str| {
        plan.bindings()
            .iter()
            .any(|b| b.exchange == exchange && b.routing_key == key)
    };
    for (level, route) in plan.delay_routes() {
        assert!(reaches(&route.exchange, &route.routing_key), "{level:?}");
        let queue = plan
            .queues()
            .iter()
            .find(|q| *q.name == *route.routing_key)
            .unwrap();
        assert_eq!(queue.role, QueueRole::Delay { ttl: *level });
        // Expired messages go back to the work queue through the default exchange.
        assert_eq!(queue.arguments.dead_letter_exchange.as_deref(), Some(""));
        assert_eq!(
            queue.arguments.dead_letter_routing_key.as_deref(),
            Some("w")
        );
    }
    assert!(reaches(
        &plan.parking_route().exchange,
        &plan.parking_route().routing_key
    ));
    // The crash delay has its own queue, which expires into the isolation queue.
    assert!(plan.delay_routes().iter().all(|(l, _)| *l != secs(7)));
    let (crash_delay, crash_route) = plan.crash_route().unwrap();
    assert_eq!(crash_delay, secs(7));
    assert!(reaches(&crash_route.exchange, &crash_route.routing_key));
    let crash_queue = plan
        .queues()
        .iter()
        .find(|q| *q.name == *crash_route.routing_key)
        .unwrap();
    assert_eq!(crash_queue.role, QueueRole::CrashDelay { ttl: secs(7) });
    assert_eq!(
        crash_queue.arguments.dead_letter_routing_key.as_deref(),
        Some(plan.isolation_queue())
    );
    let isolation = plan.isolation_route();
    assert!(reaches(&isolation.exchange, &isolation.routing_key));
    let destinations: Vec<_> = plan
        .delayed_destinations()
        .map(|(d, _, queue)| (d, queue))
        .collect();
    assert_eq!(destinations.last(), Some(&(secs(7), "w.suspect")));
    assert_eq!(destinations.len(), plan.delay_routes().len() + 1);

    // Suspects that crash go straight back with run-handler: no crash-delay queue.
    let run = RetryPolicy::builder()
        .with_on_crash(CrashAction::RunHandler)
        .build()
        .unwrap();
    let plan = TopologyPlan::new("w", &run).unwrap();
    assert_eq!(plan.crash_route(), None);
    assert!(
        plan.queues()
            .iter()
            .all(|q| !matches!(q.role, QueueRole::CrashDelay { .. }))
    );
}

#[test]
fn quorum_queues_use_at_least_once_dead_lettering() {
    let policy = RetryPolicy::delays([secs(5)]).build().unwrap();
    let plan = TopologyPlan::builder("orders", &policy)
        .with_queue_type(QueueType::Quorum)
        .with_delivery_limit(4)
        .build()
        .unwrap();
    for q in plan.queues() {
        let a = q.arguments.to_headers();
        assert_eq!(a.get("x-queue-type"), Some(&HeaderValue::from("quorum")));
        let dead_letters = q.role != QueueRole::Parking;
        assert_eq!(
            a.get("x-dead-letter-strategy"),
            dead_letters
                .then(|| HeaderValue::from("at-least-once"))
                .as_ref(),
            "{}",
            q.name
        );
        assert_eq!(
            a.get("x-overflow"),
            dead_letters
                .then(|| HeaderValue::from("reject-publish"))
                .as_ref()
        );
        // The broker's delivery limit backs up the crash limit on both intakes.
        assert_eq!(
            a.get("x-delivery-limit"),
            matches!(q.role, QueueRole::Work | QueueRole::Isolation)
                .then_some(HeaderValue::Int(4))
                .as_ref(),
            "{}",
            q.name
        );
    }
}

#[test]
fn bad_queue_names_are_refused() {
    let policy = RetryPolicy::default();
    assert_eq!(
        TopologyPlan::new("", &policy),
        Err(TopologyError::EmptyQueueName)
    );
    assert!(matches!(
        TopologyPlan::new("amq.gen-1", &policy),
        Err(TopologyError::ReservedQueueName { .. })
    ));
    let long = "q".repeat(250);
    match TopologyPlan::new(&long, &policy) {
        Err(TopologyError::NameTooLong { derived, len, .. }) => {
            assert!(derived.ends_with(".dead-letter"));
            assert_eq!(len, derived.len());
            assert!(len > MAX_NAME_LEN);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn delay_names_are_compact_and_deterministic() {
    let table = [
        (Duration::from_millis(250), "250ms"),
        (secs(1), "1s"),
        (secs(90), "1m30s"),
        (secs(3600), "1h"),
        (secs(86_400 + 3600), "1d1h"),
        (Duration::from_millis(u32::MAX as u64), "49d17h2m47s295ms"),
    ];
    for (d, name) in table {
        assert_eq!(format_delay(d), name);
    }
}

#[test]
fn a_replication_factor_reaches_every_queue_and_needs_quorum() {
    let policy = RetryPolicy::delays([secs(5), secs(60)])
        .with_crash_delay(secs(2))
        .build()
        .unwrap();
    let replicated = |strategy: DelayStrategy| {
        TopologyPlan::builder("orders", &policy)
            .with_queue_type(QueueType::Quorum)
            .with_replication_factor(3)
            .with_strategy(strategy)
            .build()
            .unwrap()
    };
    let per_delay = replicated(DelayStrategy::PerDelayQueue);
    let cascade = replicated(DelayStrategy::Cascade(Cascade::new()));
    let queues = per_delay
        .queues()
        .iter()
        .chain(cascade.queues())
        .chain(cascade.cascade().unwrap().queues());
    let mut roles = std::collections::HashSet::new();
    for q in queues {
        roles.insert(std::mem::discriminant(&q.role));
        let a = q.arguments.to_headers();
        assert_eq!(
            a.get("x-quorum-initial-group-size"),
            Some(&HeaderValue::Int(3)),
            "{}",
            q.name
        );
    }
    // Work, delay, isolation, crash delay, parking and cascade levels.
    assert_eq!(roles.len(), 6, "{roles:?}");

    let unreplicated = TopologyPlan::builder("orders", &policy)
        .with_queue_type(QueueType::Quorum)
        .build()
        .unwrap();
    assert!(unreplicated.queues().iter().all(|q| {
        q.arguments
            .to_headers()
            .get("x-quorum-initial-group-size")
            .is_none()
    }));

    let classic = TopologyPlan::builder("orders", &policy)
        .with_replication_factor(2)
        .build()
        .unwrap_err();
    assert_eq!(classic, TopologyError::ReplicationNeedsQuorum { nodes: 2 });
    assert!(classic.to_string().contains("quorum"), "{classic}");
    let zero = TopologyPlan::builder("orders", &policy)
        .with_queue_type(QueueType::Quorum)
        .with_replication_factor(0)
        .build()
        .unwrap_err();
    assert_eq!(zero, TopologyError::ZeroReplicationFactor);
}
