//! The same seed and script give the same run, byte for byte.

use std::time::Duration;

use retry_core::{Jitter, RetryPolicy};
use transport_memory::{FaultRates, Report, Script, SimEvent, Simulation, SimulationBuilder, Step};

/// A simulation that gives up after six virtual hours (every schedule here ends well
/// before), so a crash loop the engine fails to stop fails the test quickly instead of
/// spinning to the default one-year horizon.
fn simulation(queue: &str, policy: RetryPolicy) -> SimulationBuilder {
    Simulation::builder(queue, policy).with_horizon(Duration::from_secs(6 * 3600))
}

fn storm(seed: u64) -> Report {
    let policy = RetryPolicy::exponential(Duration::from_secs(10), 3.0, Duration::from_secs(3600))
        .with_max_attempts(6)
        .with_jitter(Jitter::Full)
        .build()
        .unwrap();
    let mut sim = simulation("jobs", policy)
        .with_prefetch(6)
        .with_consumers(3)
        .with_seed(seed)
        .with_crash_rate(0.05)
        .with_connection_drop_rate(0.05)
        .with_faults(
            FaultRates::new()
                .lose_publishes(0.05)
                .refuse_publishes(0.05)
                .lose_confirms(0.05)
                .duplicate_deliveries(0.05),
        )
        .build()
        .unwrap();
    for i in 0..40 {
        let script = match i % 5 {
            0 => Script::always(Step::Crash),
            1 => Script::fail_times(3).taking(Duration::from_millis(250)),
            2 => Script::always(Step::panic("boom")),
            3 => Script::steps([Step::Hang, Step::Succeed]),
            _ => Script::succeed(),
        };
        sim.publish(format!("job-{i:02}"), script).unwrap();
    }
    sim.schedule(Duration::from_secs(30), SimEvent::CloseConnections);
    sim.schedule(Duration::from_secs(90), SimEvent::CrashConsumers);
    sim.run_until_quiet();
    sim.shutdown()
}

#[test]
fn the_same_seed_and_script_give_the_same_trace() {
    let (a, b) = (storm(42), storm(42));
    let text = a.trace.render();
    assert!(text.lines().count() > 500, "a substantial trace");
    assert_eq!(text, b.trace.render());
    assert_eq!(a.summary(), b.summary());
    assert_eq!(a, b);
}

#[test]
fn another_seed_gives_another_run() {
    assert_ne!(storm(1).trace.render(), storm(2).trace.render());
}
