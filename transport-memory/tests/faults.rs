//! Simulated faults never lose a message: every one published ends handled or parked, and
//! duplicates are counted apart.

use std::time::Duration;

use retry_core::RetryPolicy;
use transport_memory::{
    ConsumerState, FaultRates, Report, Script, SimEvent, Simulation, SimulationBuilder, Step, Stop,
};

/// A simulation that gives up after six virtual hours (every schedule here ends well
/// before), so a crash loop the engine fails to stop fails the test quickly instead of
/// spinning to the default one-year horizon.
fn simulation(queue: &str, policy: RetryPolicy) -> SimulationBuilder {
    Simulation::builder(queue, policy).with_horizon(Duration::from_secs(6 * 3600))
}

fn mins(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

fn policy() -> RetryPolicy {
    RetryPolicy::delays([mins(1), mins(10), mins(60)])
        .build()
        .unwrap()
}

/// Every message ended handled or parked; none is pending or lost.
fn assert_accounted(report: &Report) {
    let t = report.totals();
    assert_eq!(report.stop, Stop::Quiet, "the run must settle");
    assert_eq!(t.lost, 0, "lost messages:\n{}", report.summary());
    assert_eq!(t.pending, 0, "pending messages:\n{}", report.summary());
    assert_eq!(
        t.published,
        t.handled + t.parked,
        "published = handled + parked\n{}",
        report.summary()
    );
}

fn publish_mix(sim: &mut Simulation, n: usize) {
    for i in 0..n {
        let script = match i % 4 {
            0 => Script::succeed(),
            1 => Script::fail_times(1),
            2 => Script::fail_times(2).taking(Duration::from_secs(2)),
            _ => Script::always(Step::fail("never works")),
        };
        sim.publish(format!("m{i:03}"), script).unwrap();
    }
}

#[test]
fn lost_publishes_requeue_the_original() {
    let mut sim = simulation("q", policy()).build().unwrap();
    publish_mix(&mut sim, 20);
    sim.schedule(Duration::ZERO, SimEvent::LosePublishes(8));
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    let lost_in_transit = report
        .trace
        .events()
        .iter()
        .filter(|e| e.kind.to_string().contains("lost in transit"))
        .count();
    assert_eq!(lost_in_transit, 8, "the fault was exercised");
}

fn count_terminals(report: &Report, f: impl Fn(&retry_core::Terminal) -> bool) -> usize {
    report
        .messages
        .values()
        .flat_map(|m| &m.terminals)
        .filter(|(_, t)| f(t))
        .count()
}

fn refusals(report: &Report) -> usize {
    report
        .trace
        .events()
        .iter()
        .filter(|e| e.kind.to_string().ends_with(": nacked"))
        .count()
}

#[test]
fn refused_publishes_are_published_again_without_requeueing() {
    let mut sim = simulation("q", policy()).build().unwrap();
    publish_mix(&mut sim, 20);
    sim.schedule(Duration::ZERO, SimEvent::RefusePublishes(8));
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    assert_eq!(refusals(&report), 8, "the fault was exercised");
    let requeued = count_terminals(&report, |t| {
        matches!(t, retry_core::Terminal::Requeued { .. })
    });
    assert_eq!(requeued, 0, "each refused clone was confirmed on a retry");
}

#[test]
fn refusals_past_the_publish_retries_requeue_the_original_and_blame_no_one() {
    let policy = RetryPolicy::delays([mins(1), mins(10), mins(60)])
        .with_publish_retries(1, Duration::from_millis(100))
        .build()
        .unwrap();
    let mut sim = simulation("q", policy).build().unwrap();
    publish_mix(&mut sim, 20);
    sim.schedule(Duration::ZERO, SimEvent::RefusePublishes(30));
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    let requeued = count_terminals(&report, |t| {
        matches!(t, retry_core::Terminal::Requeued { .. })
    });
    assert!(requeued > 0, "some clones were refused twice");
    // A requeued original comes back redelivered: a suspect, never a crash.
    let isolated = count_terminals(&report, |t| matches!(t, retry_core::Terminal::Isolated));
    assert!(isolated > 0);
    assert!(
        report.messages.values().all(|m| m.crashes == 0),
        "{}",
        report.summary()
    );
}

#[test]
fn lost_confirms_make_duplicates_not_losses() {
    let mut sim = simulation("q", policy()).build().unwrap();
    for i in 0..10 {
        sim.publish(format!("m{i}"), Script::fail_times(1)).unwrap();
    }
    sim.schedule(Duration::ZERO, SimEvent::LoseConfirms(4));
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    // The four clones reached their delay queue although their publishers saw a failure;
    // the originals were requeued and retried as well.
    assert_eq!(report.totals().handled, 10);
    assert_eq!(report.totals().duplicates, 4);
}

#[test]
fn duplicate_deliveries_are_counted_apart() {
    let mut sim = simulation("q", policy()).build().unwrap();
    for i in 0..10 {
        sim.publish(format!("m{i}"), Script::succeed()).unwrap();
    }
    sim.schedule(Duration::ZERO, SimEvent::DuplicateDeliveries(3));
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    assert_eq!(report.totals().duplicates, 3);
    assert_eq!(report.deliveries, 13);
}

#[test]
fn dropped_connections_redeliver_what_was_held() {
    let mut sim = simulation("q", policy())
        .with_prefetch(5)
        .with_consumers(2)
        .build()
        .unwrap();
    publish_mix(&mut sim, 40);
    for at in [0, 1, 3, 61, 62, 610] {
        sim.schedule(Duration::from_secs(at), SimEvent::CloseConnections);
    }
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    let closes = report
        .trace
        .events()
        .iter()
        .filter(|e| e.kind.to_string().contains("close conn"))
        .count();
    assert!(closes >= 6, "connections were dropped ({closes})");
    let recovered = report
        .trace
        .events()
        .iter()
        .filter(|e| e.kind.to_string().contains("recovered as conn"))
        .count();
    assert!(recovered >= 6, "the transports recovered ({recovered})");
}

#[test]
fn crashes_at_random_never_lose_messages() {
    let mut sim = simulation("q", policy())
        .with_prefetch(4)
        .with_seed(11)
        .with_crash_rate(0.15)
        .build()
        .unwrap();
    publish_mix(&mut sim, 40);
    let report = sim.run_until_quiet();
    assert_accounted(&report);
    let crashed = report
        .consumers
        .iter()
        .filter(|c| c.state == ConsumerState::Crashed)
        .count();
    assert!(crashed > 3, "the fault was exercised ({crashed} crashes)");
}

#[test]
fn a_storm_of_every_fault_loses_nothing_across_seeds() {
    for seed in 1..=8 {
        let mut sim = simulation("q", policy())
            .with_prefetch(8)
            .with_consumers(2)
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
            .with_trace(false)
            .build()
            .unwrap();
        publish_mix(&mut sim, 60);
        sim.schedule(mins(2), SimEvent::CrashConsumers);
        let report = sim.run_until_quiet();
        assert_accounted(&report);
        let t = report.totals();
        assert!(
            t.runs > 60,
            "seed {seed}: every message ran at least once ({} runs)",
            t.runs
        );
    }
}
