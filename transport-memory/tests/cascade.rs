//! The delay cascade on the broker model: exchange-to-exchange bindings, provisioning a
//! shared cascade, and every delayed clone back after exactly its delay rounded up to the
//! cascade's unit, measured on the virtual clock.

use std::collections::HashMap;
use std::time::Duration;

use retry_core::{
    Cascade, CascadePlan, CrashAction, DelayStrategy, ExchangeKind, HeaderValue, Jitter, QueueType,
    RetryPolicy, Timestamp, TopologyPlan, splitmix64,
};
use transport_memory::{
    Broker, BrokerError, EventKind, Fate, Outgoing, PublishOutcome, Publisher, QueueOptions,
    Report, Script, Simulation, SimulationBuilder, Step, Stop,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn cascade() -> DelayStrategy {
    DelayStrategy::Cascade(Cascade::new())
}

/// A simulation of `queue` whose delays go through the default cascade (10 ms unit), giving
/// up after a virtual hour so a clone the cascade loses fails the test instead of spinning.
fn cascade_simulation(queue: &str, policy: RetryPolicy) -> SimulationBuilder {
    Simulation::builder(queue, policy)
        .with_strategy(cascade())
        .with_horizon(secs(3600))
}

fn cascade_plan(queue: &str, policy: &RetryPolicy) -> TopologyPlan {
    TopologyPlan::builder(queue, policy)
        .with_strategy(cascade())
        .build()
        .unwrap()
}

/// One trip of a clone through the cascade, as the broker's trace shows it.
#[derive(Debug)]
struct Trip {
    /// The delay its routing key asks for.
    asked: Duration,
    /// When the engine published it to the cascade's entry exchange.
    published: Timestamp,
    /// When it entered its destination queue.
    arrived: Timestamp,
}

impl Trip {
    fn took(&self) -> Duration {
        self.arrived.saturating_duration_since(self.published)
    }
}

/// Every message's trips through `cascade`, in order, from the trace: from each publish to
/// the entry exchange to the moment the broker puts that clone into the queue its routing
/// key names (a clone of no units is routed there by the publish itself). Panics on a trip
/// that never arrives.
fn trips(report: &Report, cascade: &CascadePlan) -> HashMap<String, Vec<Trip>> {
    let mut out: HashMap<String, Vec<Trip>> = HashMap::new();
    // Per message: the trip under way, and the queue it is going to.
    let mut under_way: HashMap<String, (Trip, String)> = HashMap::new();
    for event in report.trace.events() {
        let Some(message) = event.kind.message() else {
            continue;
        };
        let label = message.label.to_string();
        let reached = match &event.kind {
            EventKind::Published {
                exchange,
                routing_key,
                outcome,
                ..
            } if &**exchange == cascade.entry_exchange() => {
                let destination = cascade
                    .destination_of(routing_key)
                    .unwrap_or_else(|| panic!("{routing_key:?} is not a cascade key"))
                    .to_owned();
                let trip = Trip {
                    asked: cascade.delay_of(routing_key).unwrap(),
                    published: event.at,
                    arrived: event.at,
                };
                let previous = under_way.insert(label.clone(), (trip, destination));
                assert!(previous.is_none(), "{label}: two clones in the cascade");
                match outcome {
                    PublishOutcome::Routed(queues) => queues.clone(),
                    other => panic!("{label}: publish to the cascade {other:?}"),
                }
            }
            EventKind::DeadLettered { routed, .. } => routed.clone(),
            _ => continue,
        };
        let arrived = under_way
            .get(&label)
            .is_some_and(|(_, destination)| reached.iter().any(|q| **q == **destination));
        if arrived && let Some((mut trip, _)) = under_way.remove(&label) {
            trip.arrived = event.at;
            out.entry(label).or_default().push(trip);
        }
    }
    assert!(
        under_way.is_empty(),
        "clones still in the cascade: {under_way:?}"
    );
    out
}

fn since(report: &Report, at: Timestamp) -> Duration {
    at.saturating_duration_since(report.started_at)
}

/// When each run of message `id` started, from the start of the simulation.
fn run_times(report: &Report, id: &str) -> Vec<Duration> {
    let m = report.message(id).unwrap();
    m.runs.iter().map(|r| since(report, r.at)).collect()
}

/// A 60 s retry-after, then a 1 s one, both handled at once: the long clone is published
/// first. 500 ms and 60 s bound the policy's delays, so neither is clamped, and with one TTL
/// queue per delay both go to the 60 s queue, the short one with a per-message expiration.
fn long_then_short(strategy: DelayStrategy) -> Report {
    let policy = RetryPolicy::delays([ms(500), secs(60)]).build().unwrap();
    let mut sim = Simulation::builder("orders", policy)
        .with_strategy(strategy)
        .with_prefetch(1)
        .with_horizon(secs(3600))
        .build()
        .unwrap();
    let after = |d| Script::steps([Step::retry_after(d, "429 Too Many Requests"), Step::Succeed]);
    sim.publish("long", after(secs(60))).unwrap();
    sim.publish("short", after(secs(1))).unwrap();
    let report = sim.run_until_quiet();
    assert_eq!(report.stop, Stop::Quiet);
    for id in ["long", "short"] {
        assert!(
            matches!(report.fate(id), Some(Fate::Handled { attempt: 2, .. })),
            "{id}:\n{}",
            report.summary()
        );
    }
    // Both clones were published at the start, the long one first.
    let clone = |id: &str| {
        let mut events = report.trace.events().iter().enumerate();
        events
            .find(|(_, e)| match &e.kind {
                EventKind::Published { message, by, .. } => {
                    &*message.label == id && matches!(by, Publisher::Connection(_))
                }
                _ => false,
            })
            .map(|(i, e)| (i, e.at))
            .unwrap()
    };
    let ((long, long_at), (short, short_at)) = (clone("long"), clone("short"));
    assert!(long < short);
    assert_eq!((long_at, short_at), (report.started_at, report.started_at));
    report
}

#[test]
fn a_short_retry_after_queued_behind_a_long_one_comes_back_on_time_through_the_cascade() {
    let report = long_then_short(cascade());
    assert_eq!(run_times(&report, "long"), [secs(0), secs(60)]);
    assert_eq!(
        run_times(&report, "short"),
        [secs(0), secs(1)],
        "the 1 s clone is not held behind the 60 s one:\n{}",
        report.trace
    );
}

#[test]
fn with_one_queue_per_delay_a_short_retry_after_waits_behind_a_long_one() {
    // The limitation the cascade lifts: a broker expires messages only at a queue's head.
    let report = long_then_short(DelayStrategy::PerDelayQueue);
    assert_eq!(run_times(&report, "long"), [secs(0), secs(60)]);
    assert_eq!(run_times(&report, "short"), [secs(0), secs(60)]);
}

#[test]
fn a_thousand_random_delays_each_come_back_after_exactly_that_delay_rounded_up_to_the_unit() {
    // 1 ms to 60 s bound the policy's delays, so no retry-after below is clamped.
    let policy = RetryPolicy::delays([ms(1), secs(60)]).build().unwrap();
    let mut sim = cascade_simulation("orders", policy).build().unwrap();
    let cascade = sim.plan().cascade().unwrap().clone();
    assert_eq!(cascade.unit(), ms(10));
    let mut asked = HashMap::new();
    for i in 0..1_000u64 {
        let r = splitmix64(0x0ca5_cade ^ i);
        // Nanoseconds, whole milliseconds, or whole units: rounded up, and left alone.
        let delay = match i % 3 {
            0 => Duration::from_nanos(1_000_000 + r % 59_999_000_000),
            1 => ms(1 + r % 60_000),
            _ => ms(10 * (1 + r % 6_000)),
        };
        let id = format!("m{i}");
        let script = Script::steps([Step::retry_after(delay, "try later"), Step::Succeed]);
        sim.publish(&id, script).unwrap();
        asked.insert(id, delay);
    }
    let report = sim.run_until_quiet();
    assert_eq!(report.stop, Stop::Quiet);
    let trips = trips(&report, &cascade);
    let mut rounded_up = 0;
    for (id, delay) in &asked {
        let m = report.message(id).unwrap();
        assert!(
            matches!(m.fate, Fate::Handled { attempt: 2, .. }),
            "{id}: {}",
            m.fate
        );
        assert_eq!(
            m.delays,
            [*delay],
            "{id}: the engine kept the delay asked for"
        );
        let want = cascade.rounded(*delay);
        assert!(want >= *delay && want < *delay + ms(10), "{id}: {want:?}");
        rounded_up += usize::from(want != *delay);
        let [trip] = &trips[id][..] else {
            panic!("{id}: {:?}", trips[id]);
        };
        assert_eq!(trip.asked, want, "{id}: its routing key");
        assert_eq!(
            trip.took(),
            want,
            "{id}: back in the work queue after {delay:?}"
        );
        assert_eq!(trip.published, report.started_at);
        assert_eq!(
            m.runs[1].at, trip.arrived,
            "{id}: its handler ran as it arrived"
        );
    }
    assert!(rounded_up > 500, "most delays here are not whole units");
    // Every level queue is empty again.
    for q in cascade.queues() {
        assert_eq!(sim.broker().ready(&q.name), Some(0), "{}", q.name);
    }
}

#[test]
fn a_crashed_suspect_waits_exactly_its_crash_delay_rounded_up_to_the_unit() {
    let crash_delay = ms(1_234);
    let policy = RetryPolicy::delays([secs(1)])
        .with_on_crash(CrashAction::Divert)
        .with_crash_delay(crash_delay)
        .build()
        .unwrap();
    let mut sim = cascade_simulation("orders", policy)
        .with_prefetch(1)
        .with_restart_delay(ms(500))
        .build()
        .unwrap();
    let plan = sim.plan().clone();
    let cascade = plan.cascade().unwrap().clone();
    assert_eq!(cascade.rounded(crash_delay), ms(1_240));
    sim.publish("poison", Script::always(Step::Crash)).unwrap();
    let report = sim.run_until_quiet();
    assert_eq!(report.stop, Stop::Quiet);

    let poison = report.message("poison").unwrap();
    assert_eq!(
        poison.fate,
        Fate::Parked {
            reason: "crash-loop".into()
        }
    );
    // A suspect after its first crash, then three crashes diverted through the cascade
    // (the default crash limit), the fourth parking it.
    assert_eq!(poison.delays, [crash_delay; 3]);
    let trips = &trips(&report, &cascade)["poison"];
    assert_eq!(trips.len(), 3, "{trips:?}");
    for (i, trip) in trips.iter().enumerate() {
        assert_eq!(trip.asked, ms(1_240), "trip {i}");
        assert_eq!(trip.took(), ms(1_240), "trip {i}");
        // It went back to the isolation queue, where a consumer took it at once to run
        // alone: the runs after the first two are each the end of a trip.
        assert_eq!(poison.runs[i + 2].at, trip.arrived, "trip {i}");
        assert!(poison.runs[i + 2].solo);
    }
    assert!(
        report
            .trace
            .events()
            .iter()
            .any(|e| matches!(&e.kind, EventKind::DeadLettered { routed, .. }
                if routed.iter().any(|q| **q == *plan.isolation_queue()))),
        "the cascade delivered to the isolation queue"
    );
}

#[test]
fn jittered_delays_each_come_back_after_exactly_that_delay_rounded_up_to_the_unit() {
    let policy = RetryPolicy::exponential(secs(1), 2.0, secs(30))
        .with_max_attempts(6)
        .with_jitter(Jitter::Full)
        .build()
        .unwrap();
    let mut sim = cascade_simulation("orders", policy).build().unwrap();
    let cascade = sim.plan().cascade().unwrap().clone();
    for i in 0..100 {
        sim.publish(format!("m{i}"), Script::fail_times(5)).unwrap();
    }
    let report = sim.run_until_quiet();
    assert_eq!(report.stop, Stop::Quiet);
    let trips = trips(&report, &cascade);
    let (mut delays, mut rounded_up) = (0, 0);
    for i in 0..100 {
        let id = format!("m{i}");
        let m = report.message(&id).unwrap();
        assert!(
            matches!(m.fate, Fate::Handled { attempt: 6, .. }),
            "{id}: {}",
            m.fate
        );
        assert_eq!(m.delays.len(), 5, "{id}");
        assert_eq!(trips[&id].len(), 5, "{id}");
        for (k, (delay, trip)) in m.delays.iter().zip(&trips[&id]).enumerate() {
            let want = cascade.rounded(*delay);
            assert_eq!(trip.asked, want, "{id} retry {k}");
            assert_eq!(trip.took(), want, "{id} retry {k}: {delay:?}");
            assert_eq!(m.runs[k + 1].at, trip.arrived, "{id} retry {k}");
            delays += 1;
            rounded_up += usize::from(want != *delay);
        }
    }
    assert_eq!(delays, 500);
    assert!(
        rounded_up > 250,
        "jitter draws whole milliseconds, not units"
    );
}

/// The names of the broker's cascade queues.
fn cascade_queues(broker: &Broker) -> Vec<String> {
    broker
        .queue_names()
        .into_iter()
        .filter(|q| q.starts_with("retry.cascade."))
        .collect()
}

#[test]
fn provisioning_a_cascade_plan_twice_is_a_no_op() {
    let policy = RetryPolicy::delays([secs(1), secs(5)]).build().unwrap();
    let plan = cascade_plan("orders", &policy);
    let cascade = plan.cascade().unwrap();
    let broker = Broker::new();
    broker.provision(&plan).unwrap();
    let queues = broker.queue_names();
    broker.provision(&plan).unwrap();
    broker.provision_cascade(cascade).unwrap();
    assert_eq!(broker.queue_names(), queues);
    let levels: Vec<_> = cascade.queues().iter().map(|q| q.name.clone()).collect();
    assert_eq!(cascade_queues(&broker), levels);
    assert_eq!(levels.len(), 9, "5 s is 500 units of 10 ms: 9 bits");

    // Still one copy per clone, back after exactly its delay.
    arrives_after_exactly(&broker, &plan, ms(3_210));
    broker.advance(secs(60));
    assert_eq!(broker.ready("orders"), Some(1));
}

/// Publishes a clone on `plan`'s route for `delay` and checks that it reaches the empty
/// work queue exactly `delay` later, not a millisecond sooner.
fn arrives_after_exactly(broker: &Broker, plan: &TopologyPlan, delay: Duration) {
    let (route, _) = plan.route_for(delay).unwrap();
    let queue = plan.work_queue();
    broker
        .publish(Outgoing::new(
            &*route.exchange,
            &*route.routing_key,
            b"x".to_vec(),
        ))
        .unwrap();
    broker.advance(delay - ms(1));
    assert_eq!(broker.ready(queue), Some(0), "{delay:?}: early");
    broker.advance(ms(1));
    assert_eq!(broker.ready(queue), Some(1), "{delay:?}: on time");
}

#[test]
fn a_level_queue_declared_otherwise_is_reported() {
    let policy = RetryPolicy::delays([secs(1)]).build().unwrap();
    let plan = cascade_plan("orders", &policy);
    let broker = Broker::new();
    broker
        .declare_queue(
            "retry.cascade.10ms.03",
            QueueOptions::new().with_message_ttl(secs(80)),
        )
        .unwrap();
    let err = broker.provision(&plan).unwrap_err();
    assert!(
        matches!(&err, BrokerError::Inequivalent { object, argument, .. }
            if object == "queue 'retry.cascade.10ms.03'" && argument == "x-message-ttl"),
        "{err}"
    );
}

#[test]
fn a_quorum_cascade_is_provisioned_and_carries_clones() {
    let policy = RetryPolicy::delays([secs(1)]).build().unwrap();
    let plan = TopologyPlan::builder("orders", &policy)
        .with_queue_type(QueueType::Quorum)
        .with_strategy(cascade())
        .build()
        .unwrap();
    let broker = Broker::new();
    broker.provision(&plan).unwrap();
    broker.provision(&plan).unwrap();
    assert!(broker.ready("retry.cascade.10ms.quorum.00").is_some());
    arrives_after_exactly(&broker, &plan, ms(990));
}

#[test]
fn two_work_queues_share_one_cascade_and_each_gets_only_its_own_clones() {
    // "eu.orders" ends with "orders": the delivery exchange must tell them apart.
    let short = RetryPolicy::delays([secs(1)]).build().unwrap();
    let long = RetryPolicy::delays([secs(60)]).build().unwrap();
    let orders = cascade_plan("orders", &short);
    let eu = cascade_plan("eu.orders", &long);
    assert_eq!(orders.cascade().unwrap().levels(), 7);
    assert_eq!(eu.cascade().unwrap().levels(), 13);
    let broker = Broker::new();
    broker.provision(&orders).unwrap();
    broker.provision(&eu).unwrap();
    broker.provision(&orders).unwrap();
    let levels: Vec<_> = eu
        .cascade()
        .unwrap()
        .queues()
        .iter()
        .map(|q| q.name.clone())
        .collect();
    assert_eq!(
        cascade_queues(&broker),
        levels,
        "the longer plan added levels on top of the shorter one's, and nothing else"
    );

    let send = |plan: &TopologyPlan, delay: Duration, id: &str| {
        let (route, _) = plan.route_for(delay).unwrap();
        let message =
            Outgoing::new(&*route.exchange, &*route.routing_key, b"x".to_vec()).with_message_id(id);
        broker.publish(message).unwrap();
    };
    send(&eu, ms(700), "eu-1");
    send(&orders, ms(700), "orders-1");
    send(&eu, secs(45), "eu-2");
    send(&orders, ms(250), "orders-2");
    send(&orders, Duration::ZERO, "orders-0");
    // Step the clock from deadline to deadline, noting when each clone reaches which queue.
    let mut arrivals: Vec<(String, &str, Duration)> = Vec::new();
    let mut note = |broker: &Broker| {
        let now = broker
            .now()
            .saturating_duration_since(transport_memory::DEFAULT_START);
        for queue in ["orders", "eu.orders"] {
            for m in broker.messages(queue).unwrap() {
                if !arrivals.iter().any(|(id, _, _)| **id == *m.label) {
                    arrivals.push((m.label.to_string(), queue, now));
                }
            }
        }
    };
    note(&broker);
    while broker.step().is_some() {
        note(&broker);
    }
    assert_eq!(
        arrivals,
        [
            ("orders-0".to_owned(), "orders", Duration::ZERO),
            ("orders-2".to_owned(), "orders", ms(250)),
            ("orders-1".to_owned(), "orders", ms(700)),
            ("eu-1".to_owned(), "eu.orders", ms(700)),
            ("eu-2".to_owned(), "eu.orders", secs(45)),
        ],
        "a clone of no delay goes straight down; each other one arrives after exactly its \
         delay, in its own work queue"
    );
    assert_eq!(broker.ready("orders"), Some(3));
    assert_eq!(broker.ready("eu.orders"), Some(2));

    // The delivery exchange routes by the whole destination, never a suffix of it.
    let deliver = orders.cascade().unwrap().delivery_exchange();
    let key = |queue: &str| format!("{}{queue}", "0.".repeat(32));
    broker
        .publish(Outgoing::new(deliver, key("orders"), b"x".to_vec()).with_message_id("direct"))
        .unwrap();
    assert_eq!(broker.ready("orders"), Some(4));
    assert_eq!(broker.ready("eu.orders"), Some(2));
    broker
        .publish(Outgoing::new(deliver, key("eu.orders"), b"x".to_vec()))
        .unwrap();
    assert_eq!(broker.ready("orders"), Some(4));
    assert_eq!(broker.ready("eu.orders"), Some(3));
}

// Exchange-to-exchange bindings, on the broker alone.

fn queue(broker: &Broker, name: &str) {
    broker.declare_queue(name, QueueOptions::new()).unwrap();
}

#[test]
fn a_chain_of_exchange_bindings_routes_to_the_end_with_the_key_unchanged() {
    let broker = Broker::new();
    broker.declare_exchange("a", ExchangeKind::Topic).unwrap();
    broker.declare_exchange("b", ExchangeKind::Direct).unwrap();
    broker.declare_exchange("c", ExchangeKind::Fanout).unwrap();
    queue(&broker, "out");
    queue(&broker, "b-side");
    broker.bind_exchange("a", "b", "order.*").unwrap();
    broker.bind_exchange("b", "c", "order.created").unwrap();
    broker.bind("c", "out", "ignored by fanout").unwrap();
    broker.bind("b", "b-side", "order.paid").unwrap();

    broker
        .publish(Outgoing::new("a", "order.created", b"1".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::new("a", "order.paid", b"2".to_vec()))
        .unwrap();
    broker
        .publish(Outgoing::new("a", "invoice.created", b"3".to_vec()))
        .unwrap();
    let out = broker.messages("out").unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(
        (out[0].exchange.as_str(), out[0].routing_key.as_str()),
        ("a", "order.created")
    );
    assert_eq!(broker.ready("b-side"), Some(1));
}

#[test]
fn a_queue_reached_through_several_exchange_bindings_gets_one_copy() {
    let broker = Broker::new();
    for x in ["x", "y1", "y2"] {
        broker.declare_exchange(x, ExchangeKind::Topic).unwrap();
    }
    queue(&broker, "q");
    queue(&broker, "only-y2");
    broker.bind_exchange("x", "y1", "#").unwrap();
    broker.bind_exchange("x", "y2", "k.#").unwrap();
    broker.bind_exchange("y1", "y2", "#").unwrap();
    broker.bind("y1", "q", "k.*").unwrap();
    broker.bind("y2", "q", "#").unwrap();
    broker.bind("x", "q", "k.v").unwrap();
    broker.bind("y2", "only-y2", "k.v").unwrap();
    // Binding again changes nothing.
    broker.bind_exchange("x", "y1", "#").unwrap();

    let confirm = broker
        .publish(Outgoing::new("x", "k.v", b"x".to_vec()).with_mandatory(true))
        .unwrap();
    assert_eq!(confirm, retry_core::Confirm::Ack);
    assert_eq!(broker.ready("q"), Some(1));
    assert_eq!(broker.ready("only-y2"), Some(1));
}

#[test]
fn a_cycle_of_exchange_bindings_ends() {
    let broker = Broker::new();
    broker.declare_exchange("a", ExchangeKind::Topic).unwrap();
    broker.declare_exchange("b", ExchangeKind::Fanout).unwrap();
    queue(&broker, "q");
    broker.bind_exchange("a", "b", "#").unwrap();
    broker.bind_exchange("b", "a", "").unwrap();
    broker.bind_exchange("a", "a", "#").unwrap();
    broker.bind("b", "q", "").unwrap();
    for start in ["a", "b"] {
        broker
            .publish(Outgoing::new(start, "k", b"x".to_vec()))
            .unwrap();
    }
    assert_eq!(broker.ready("q"), Some(2));

    // Unroutable through the cycle: returned, not lost in it.
    let broker = Broker::new();
    broker.declare_exchange("a", ExchangeKind::Direct).unwrap();
    broker.declare_exchange("b", ExchangeKind::Direct).unwrap();
    broker.bind_exchange("a", "b", "k").unwrap();
    broker.bind_exchange("b", "a", "k").unwrap();
    let confirm = broker
        .publish(Outgoing::new("a", "k", b"x".to_vec()).with_mandatory(true))
        .unwrap();
    assert_eq!(confirm, retry_core::Confirm::Returned);
}

#[test]
fn binding_a_missing_exchange_or_the_default_exchange_is_refused() {
    let broker = Broker::new();
    broker.declare_exchange("a", ExchangeKind::Topic).unwrap();
    assert_eq!(
        broker.bind_exchange("a", "nowhere", "#"),
        Err(BrokerError::ExchangeNotFound("nowhere".into()))
    );
    assert_eq!(
        broker.bind_exchange("nowhere", "a", "#"),
        Err(BrokerError::ExchangeNotFound("nowhere".into()))
    );
    for (source, destination) in [("", "a"), ("a", "")] {
        let err = broker.bind_exchange(source, destination, "#").unwrap_err();
        assert!(
            matches!(&err, BrokerError::AccessRefused(why) if why.contains("default exchange")),
            "{source:?} -> {destination:?}: {err}"
        );
    }
    // The built-in exchanges can be bound, as on RabbitMQ.
    broker.bind_exchange("amq.topic", "a", "#").unwrap();
}

#[test]
fn a_dead_letter_without_a_routing_key_keeps_its_own_through_exchange_bindings() {
    let broker = Broker::new();
    broker.declare_exchange("in", ExchangeKind::Topic).unwrap();
    broker.declare_exchange("dlx", ExchangeKind::Topic).unwrap();
    broker
        .declare_exchange("by-kind", ExchangeKind::Direct)
        .unwrap();
    broker
        .declare_queue(
            "wait",
            QueueOptions::new()
                .with_message_ttl(secs(5))
                .with_dead_letter_exchange("dlx"),
        )
        .unwrap();
    queue(&broker, "created");
    queue(&broker, "paid");
    broker.bind("in", "wait", "order.#").unwrap();
    broker.bind_exchange("dlx", "by-kind", "order.*").unwrap();
    broker.bind("by-kind", "created", "order.created").unwrap();
    broker.bind("by-kind", "paid", "order.paid").unwrap();

    broker
        .publish(Outgoing::new("in", "order.paid", b"x".to_vec()))
        .unwrap();
    broker.advance(secs(5));
    assert_eq!(broker.ready("created"), Some(0));
    let paid = broker.messages("paid").unwrap();
    assert_eq!(paid.len(), 1);
    assert_eq!(
        (paid[0].exchange.as_str(), paid[0].routing_key.as_str()),
        ("dlx", "order.paid")
    );
    let Some(HeaderValue::Array(deaths)) = paid[0].headers.get("x-death") else {
        panic!("no x-death: {:?}", paid[0].headers);
    };
    assert_eq!(deaths.len(), 1);
}

#[test]
fn a_dead_letter_cycle_through_exchange_bindings_is_still_dropped() {
    // An expired message that an exchange binding routes back into its own queue, with no
    // consumer's rejection on the way, loops no more on the model than on RabbitMQ.
    let broker = Broker::new();
    broker.declare_exchange("dlx", ExchangeKind::Topic).unwrap();
    broker
        .declare_exchange("back", ExchangeKind::Topic)
        .unwrap();
    broker
        .declare_queue(
            "loop",
            QueueOptions::new()
                .with_message_ttl(secs(1))
                .with_dead_letter_exchange("dlx"),
        )
        .unwrap();
    queue(&broker, "watcher");
    broker.bind_exchange("dlx", "back", "#").unwrap();
    broker.bind("back", "loop", "#").unwrap();
    broker.bind("back", "watcher", "#").unwrap();
    broker
        .publish(Outgoing::to_queue("loop", b"x".to_vec()))
        .unwrap();
    broker.advance(secs(10));
    assert_eq!(broker.ready("loop"), Some(0));
    assert_eq!(broker.ready("watcher"), Some(1));
    assert_eq!(broker.next_deadline(), None);
}

#[test]
fn an_exchange_binding_routes_the_dead_letters_waiting_for_a_route() {
    // A quorum queue with at-least-once dead-lettering keeps a dead letter its exchange
    // cannot route; binding a way out releases it.
    let broker = Broker::new();
    broker.declare_exchange("dlx", ExchangeKind::Topic).unwrap();
    broker
        .declare_exchange("later", ExchangeKind::Topic)
        .unwrap();
    broker
        .declare_queue(
            "wait",
            QueueOptions::new()
                .with_queue_type(QueueType::Quorum)
                .with_message_ttl(secs(1))
                .with_dead_letter_exchange("dlx")
                .with_overflow(transport_memory::QueueOverflow::RejectPublish)
                .with_at_least_once(true),
        )
        .unwrap();
    queue(&broker, "out");
    broker.bind("later", "out", "#").unwrap();
    broker
        .publish(Outgoing::to_queue("wait", b"x".to_vec()))
        .unwrap();
    broker.advance(secs(1));
    assert_eq!(broker.stats("wait").unwrap().stuck_dead_letters, 1);
    broker.bind_exchange("dlx", "later", "#").unwrap();
    assert_eq!(broker.stats("wait").unwrap().stuck_dead_letters, 0);
    assert_eq!(broker.ready("out"), Some(1));
}
