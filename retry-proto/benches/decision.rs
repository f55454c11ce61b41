//! The decision path: header decoding, a success, a retry, and the pure decision function.
//!
//! Run with `cargo bench -p retry-proto --bench decision`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use retry_proto::*;

fn engine_headers() -> Headers {
    [
        (headers::ATTEMPTS, HeaderValue::Int(2)),
        (headers::CRASHES, HeaderValue::Int(1)),
        (headers::FIRST_FAILURE, HeaderValue::Int(1_700_000_000_000)),
        (headers::LAST_FAILURE, HeaderValue::Int(1_700_000_003_000)),
        (headers::LAST_ERROR, HeaderValue::from("timeout")),
        (headers::ORIGIN_QUEUE, HeaderValue::from("comments")),
        (
            "x-death",
            HeaderValue::Array(vec![HeaderValue::Table(
                [
                    ("count", HeaderValue::Int(2)),
                    ("reason", HeaderValue::from("expired")),
                    ("queue", HeaderValue::from("comments.retry.3s")),
                ]
                .into_iter()
                .collect(),
            )]),
        ),
    ]
    .into_iter()
    .collect()
}

fn bench(c: &mut Criterion) {
    let now = Timestamp::from_millis(1_700_000_010_000);
    let policy = RetryPolicy::exponential(Duration::from_secs(1), 3.0, Duration::from_secs(10))
        .with_max_attempts(5)
        .build()
        .unwrap();
    let plan = TopologyPlan::new("comments", &policy).unwrap();
    let headers = engine_headers();
    let empty = Headers::new();

    c.bench_function("decode/no headers", |b| {
        b.iter(|| DeliveryFacts::decode(black_box(&empty), BrokerSignals::default(), 1))
    });
    c.bench_function("decode/engine headers + x-death", |b| {
        b.iter(|| DeliveryFacts::decode(black_box(&headers), BrokerSignals::default(), 1))
    });

    let facts = DeliveryFacts::decode(&headers, BrokerSignals::default(), 1);
    let state = AttemptState {
        attempt: 3,
        crashes: 1,
        first_failure: facts.first_failure,
        identity: 1,
    };
    let transient = Outcome::Transient("timeout".into());
    c.bench_function("decide/success", |b| {
        b.iter(|| decide(&policy, black_box(&state), &Outcome::Success, now))
    });
    c.bench_function("decide/transient", |b| {
        b.iter(|| decide(&policy, black_box(&state), &transient, now))
    });

    let mut engine = Engine::new(policy.clone(), &plan).unwrap();
    c.bench_function("engine/success (delivery, run, ack)", |b| {
        b.iter(|| {
            let id = engine.handle_delivery(now, Lane::Work, black_box(facts), ());
            let run = engine.poll_action();
            engine.handle_outcome(now, id, Outcome::Success).unwrap();
            (run, engine.poll_action())
        })
    });
    c.bench_function("engine/retry (delivery, run, publish, confirm, ack)", |b| {
        b.iter(|| {
            let id = engine.handle_delivery(now, Lane::Work, black_box(facts), ());
            let run = engine.poll_action();
            engine
                .handle_outcome(now, id, Outcome::Transient("timeout".into()))
                .unwrap();
            let publish = engine.poll_action();
            engine.handle_confirm(now, id, Confirm::Ack).unwrap();
            (run, publish, engine.poll_action())
        })
    });
    c.bench_function("engine/success incl. decode", |b| {
        b.iter(|| {
            let facts = DeliveryFacts::decode(black_box(&headers), BrokerSignals::default(), 1);
            let id = engine.handle_delivery(now, Lane::Work, facts, ());
            let run = engine.poll_action();
            engine.handle_outcome(now, id, Outcome::Success).unwrap();
            (run, engine.poll_action())
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
