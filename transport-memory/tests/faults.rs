//! Simulated faults never lose a message: every one published ends handled or parked, and
//! duplicates are counted apart.

use std::time::Duration;

use retry_core::RetryPolicy;
use transport_memory::{
    ConsumerState, Fate, FaultRates, Outgoing, Report, Script, SimEvent, Simulation,
    SimulationBuilder, Step, Stop,
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

/// A fetch lost in flight (a `get-ok` lost with its channel) sends its message back to the
/// head of the isolation queue redelivered, through no crash of its own: the consumer that
/// saw the fetch fail must not charge it one when it fetches it again.
#[test]
fn an_innocent_suspect_whose_fetch_is_lost_is_not_charged_a_crash() {
    for latency in [Duration::ZERO, Duration::from_millis(40)] {
        let mut sim = simulation("q", policy())
            .with_fetch_latency(latency)
            .build()
            .unwrap();
        // A suspect already isolated, as a bystander of a crash is: healthy, and fresh in
        // the isolation queue.
        let isolation = sim.plan().isolation_queue().to_owned();
        let suspect =
            Outgoing::to_queue(&isolation, b"innocent".to_vec()).with_message_id("innocent");
        sim.publish_labelled("innocent", suspect, Script::succeed())
            .unwrap();
        sim.schedule(Duration::ZERO, SimEvent::LoseFetches(1));
        let report = sim.run_until_quiet();
        assert_accounted(&report);
        let trace = report.trace.to_string();
        assert!(
            trace.contains("lost in flight") && trace.contains("(redelivered)"),
            "latency {latency:?}: the fetch was lost and the suspect came back redelivered\n{trace}"
        );
        let m = report.message("innocent").unwrap();
        assert!(
            matches!(m.fate, Fate::Handled { .. }) && m.crashes == 0,
            "latency {latency:?}: charged {} crash(es), ended {:?}\n{}",
            m.crashes,
            m.fate,
            m.timeline(report.started_at)
        );
        assert_eq!(m.runs.len(), 1, "run once, alone");
        assert!(m.runs[0].solo && m.runs[0].step == Step::Succeed && m.runs[0].ended);
    }
}

/// Suspects made by a poison message's crashes, some of whose fetches are lost: the healthy
/// ones are never charged, and the poison is parked after exactly crash limit + 1 runs alone
/// that crashed, a lost fetch of it costing no extra crash count.
#[test]
fn lost_fetches_of_suspects_charge_no_healthy_message_and_no_extra_crash() {
    let limit = 2;
    for lost in [1, 2, 4, 8] {
        let policy = RetryPolicy::delays([mins(1)])
            .with_crash_limit(limit)
            .with_crash_delay(Duration::from_secs(1))
            .build()
            .unwrap();
        let mut sim = simulation("q", policy)
            .with_prefetch(4)
            .with_fetch_latency(Duration::from_millis(5))
            .build()
            .unwrap();
        sim.publish(
            "poison",
            Script::always(Step::Crash).taking(Duration::from_millis(100)),
        )
        .unwrap();
        for i in 0..5 {
            sim.publish(
                format!("healthy-{i}"),
                Script::succeed().taking(Duration::from_millis(200)),
            )
            .unwrap();
        }
        sim.schedule(Duration::from_millis(50), SimEvent::LoseFetches(lost));
        let report = sim.run_until_quiet();
        assert_accounted(&report);
        let trace = report.trace.to_string();
        assert_eq!(
            trace.matches("lost in flight").count(),
            lost as usize,
            "the fault was exercised"
        );
        for i in 0..5 {
            let m = report.message(&format!("healthy-{i}")).unwrap();
            assert!(
                matches!(m.fate, Fate::Handled { .. }) && m.crashes == 0,
                "{lost} lost: healthy-{i} charged {} crash(es)\n{}",
                m.crashes,
                m.timeline(report.started_at)
            );
        }
        let poison = report.message("poison").unwrap();
        assert_eq!(
            poison.fate,
            Fate::Parked {
                reason: "crash-loop".into()
            }
        );
        assert_eq!(
            poison.crashes,
            limit + 1,
            "{}",
            poison.timeline(report.started_at)
        );
        let solo_crashes = poison
            .runs
            .iter()
            .filter(|r| r.solo && r.step == Step::Crash)
            .count();
        assert_eq!(
            solo_crashes,
            limit as usize + 1,
            "{}",
            poison.timeline(report.started_at)
        );
    }
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
