//! The engine's success path allocates nothing once it is warm: decoding a delivery's full
//! headers (x-death records, origin strings, a malformed counter), its jitter identity, the
//! admission, the handler's success and the ack.
//!
//! The counting allocator sees every thread of the process, so this test runs without the
//! libtest harness (`harness = false`): under libtest its main thread, waiting on the test's
//! thread, could allocate while the region counts, and did on a loaded machine.

use std::alloc::System;

use retry_proto::*;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn main() {
    the_success_path_does_not_allocate();
    println!("the_success_path_does_not_allocate ... ok");
}

fn the_success_path_does_not_allocate() {
    let policy = RetryPolicy::default();
    let plan = TopologyPlan::new("work", &policy).unwrap();
    let mut engine = Engine::new(policy, &plan).unwrap();
    // A message on its third attempt as a broker delivers it: the engine's headers, its
    // origin strings, two x-death records from the delay queue, and a malformed counter.
    let death = |count: i64| {
        HeaderValue::Table(
            [
                ("count", HeaderValue::Int(count)),
                ("reason", HeaderValue::from("expired")),
                ("queue", HeaderValue::from("work.retry.1s")),
                ("exchange", HeaderValue::from("work.retry")),
                (
                    "routing-keys",
                    HeaderValue::Array(vec![HeaderValue::from("work.retry.1s")]),
                ),
                (
                    "time",
                    HeaderValue::Timestamp(Timestamp::from_millis(1_700_000_003_000)),
                ),
            ]
            .into_iter()
            .collect(),
        )
    };
    let headers: Headers = [
        (headers::ATTEMPTS, HeaderValue::Int(2)),
        (headers::CRASHES, HeaderValue::from("not a number")),
        (headers::FIRST_FAILURE, HeaderValue::Int(1_700_000_000_000)),
        (headers::LAST_FAILURE, HeaderValue::Int(1_700_000_003_000)),
        (headers::LAST_ERROR, HeaderValue::from("timeout")),
        (headers::ORIGIN_QUEUE, HeaderValue::from("work")),
        (headers::ORIGIN_EXCHANGE, HeaderValue::from("orders")),
        (
            headers::ORIGIN_ROUTING_KEY,
            HeaderValue::from("order.created"),
        ),
        (headers::DELAY, HeaderValue::Int(1_000)),
        ("x-death", HeaderValue::Array(vec![death(1), death(1)])),
        ("tenant", HeaderValue::from("acme")),
    ]
    .into_iter()
    .collect();
    let body = [b'x'; 256];
    let now = Timestamp::from_millis(1_700_000_010_000);
    let cycle = |engine: &mut Engine| {
        let identity = message_identity(Some("order-7"), &body);
        let facts = DeliveryFacts::decode(&headers, BrokerSignals::default(), identity);
        assert_eq!((facts.deaths, facts.crashes), (2, 0));
        assert!(facts.malformed.contains(headers::CRASHES));
        let id = engine.handle_delivery(now, Lane::Work, facts, ());
        let Some(Action::RunHandler { attempt: 3, .. }) = engine.poll_action() else {
            panic!("expected a handler run");
        };
        engine.handle_outcome(now, id, Outcome::Success).unwrap();
        let Some(Action::Settle {
            settlement: Settlement::Ack,
            ..
        }) = engine.poll_action()
        else {
            panic!("expected an ack");
        };
    };
    // Warm up: the slot table and the action queue grow once.
    cycle(&mut engine);

    let region = Region::new(GLOBAL);
    for _ in 0..1_000 {
        cycle(&mut engine);
    }
    let stats = region.change();
    assert_eq!(stats.allocations, 0, "{stats:?}");
    assert_eq!(stats.reallocations, 0, "{stats:?}");
}
