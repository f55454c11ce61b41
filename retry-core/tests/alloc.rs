//! The success path allocates nothing once the engine is warm. This file holds a single test
//! so that no other test thread allocates while it counts.

use std::alloc::System;

use retry_core::*;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

#[test]
fn the_success_path_does_not_allocate() {
    let policy = RetryPolicy::default();
    let plan = TopologyPlan::new("work", &policy).unwrap();
    let mut engine = Engine::new(policy, &plan).unwrap();
    // A message on its third attempt, with a full set of engine and broker headers.
    let headers: Headers = [
        (headers::ATTEMPTS, HeaderValue::Int(2)),
        (headers::CRASHES, HeaderValue::Int(0)),
        (headers::FIRST_FAILURE, HeaderValue::Int(1_700_000_000_000)),
        (headers::LAST_FAILURE, HeaderValue::Int(1_700_000_003_000)),
        (headers::LAST_ERROR, HeaderValue::from("timeout")),
    ]
    .into_iter()
    .collect();
    let now = Timestamp::from_millis(1_700_000_010_000);
    let cycle = |engine: &mut Engine| {
        let facts = DeliveryFacts::decode(&headers, BrokerSignals::default(), 7);
        let id = engine.handle_delivery(now, Lane::Work, facts);
        let Some(Action::RunHandler { attempt: 3, .. }) = engine.poll_action(now) else {
            panic!("expected a handler run");
        };
        engine.handle_outcome(now, id, Outcome::Success).unwrap();
        let Some(Action::Settle {
            settlement: Settlement::Ack,
            ..
        }) = engine.poll_action(now)
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
