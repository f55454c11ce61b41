//! Crash attribution at scale: poison messages that kill their consumer on every run, among
//! many healthy messages sharing their prefetch windows. Only the poison is ever blamed.

use std::time::Duration;

use retry_core::{RetryPolicy, Terminal};
use transport_memory::{Fate, Report, Script, Simulation, Step, Stop};

const MESSAGES: usize = 2_000;
const PREFETCH: u16 = 20;

fn is_poison(i: usize) -> bool {
    // 1 %: twenty poison messages, spread through the queue.
    i % 100 == 37
}

fn id(i: usize) -> String {
    if is_poison(i) {
        format!("poison-{i:04}")
    } else {
        format!("m-{i:04}")
    }
}

/// Healthy messages take 20 to 460 ms, so many are in flight when a poison message strikes;
/// every seventh fails once, so the retry path runs among the suspects too.
fn script(i: usize) -> Script {
    if is_poison(i) {
        return Script::always(Step::Crash).taking(Duration::from_millis(100));
    }
    let takes = Duration::from_millis(20 + (i as u64 * 37) % 441);
    let script = if i.is_multiple_of(7) {
        Script::fail_times(1)
    } else {
        Script::succeed()
    };
    script.taking(takes)
}

fn simulate(consumers: u32, seed: u64) -> Report {
    let policy = RetryPolicy::delays([10, 60, 600].map(Duration::from_secs))
        .with_crash_delay(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut sim = Simulation::builder("orders", policy)
        .with_prefetch(PREFETCH)
        .with_consumers(consumers)
        .with_seed(seed)
        .with_trace(false)
        .with_horizon(Duration::from_secs(24 * 3600))
        .build()
        .unwrap();
    for i in 0..MESSAGES {
        sim.publish(id(i), script(i)).unwrap();
    }
    sim.run_until_quiet()
}

fn check(consumers: u32, report: &Report) {
    let limit = RetryPolicy::default().crash_limit();
    assert_eq!(report.stop, Stop::Quiet);
    let totals = report.totals();
    assert_eq!(
        (totals.lost, totals.pending),
        (0, 0),
        "{}",
        report.summary()
    );
    assert_eq!(totals.published as usize, MESSAGES);

    let mut poison = 0;
    let mut attributed = 0;
    let mut innocents_blamed = Vec::new();
    let mut healthy_runs = Vec::new();
    let mut suspects = 0;
    for (i, m) in (0..MESSAGES).map(|i| (i, report.message(&id(i)).unwrap())) {
        if is_poison(i) {
            poison += 1;
            assert_eq!(
                m.fate,
                Fate::Parked {
                    reason: "crash-loop".into()
                },
                "{}",
                m.timeline(report.started_at)
            );
            let solo_crashes = m
                .runs
                .iter()
                .filter(|r| r.solo && r.step == Step::Crash)
                .count() as u32;
            assert_eq!(solo_crashes, limit + 1, "{}", m.timeline(report.started_at));
            assert_eq!(m.crashes, limit + 1);
            attributed += m.crashes;
            continue;
        }
        if m.crashes > 0 || !matches!(m.fate, Fate::Handled { .. }) {
            innocents_blamed.push(m.id.clone());
        }
        suspects += m
            .terminals
            .iter()
            .filter(|(_, t)| *t == Terminal::Isolated)
            .count();
        healthy_runs.push(m.runs.len());
    }
    assert!(
        innocents_blamed.is_empty(),
        "healthy messages blamed: {innocents_blamed:?}"
    );
    let healthy = healthy_runs.len();
    let runs: usize = healthy_runs.iter().sum();
    let max = healthy_runs.iter().max().copied().unwrap_or(0);
    // Every seventh healthy message fails once by its script, so it runs at least twice.
    let scripted: usize = (0..MESSAGES)
        .filter(|&i| !is_poison(i))
        .map(|i| if i.is_multiple_of(7) { 2 } else { 1 })
        .sum();
    println!(
        "{consumers} consumer(s), prefetch {PREFETCH}: {MESSAGES} messages, {poison} poison, \
         {attributed} crashes attributed (all to poison), 0 innocents parked crash-loop, \
         0 lost; healthy: {healthy} messages, {runs} runs ({scripted} by their scripts; \
         {:.3} per message, at most {max}), {suspects} isolations; {} deliveries, {} of \
         virtual time",
        runs as f64 / healthy as f64,
        totals.deliveries,
        retry_core::format_delay(report.elapsed()),
    );
}

#[test]
fn two_thousand_messages_with_one_percent_poison_blame_only_the_poison() {
    let report = simulate(1, 7);
    check(1, &report);
}

#[test]
fn with_two_consumers_sharing_the_queue_only_the_poison_is_blamed() {
    let report = simulate(2, 11);
    check(2, &report);
}
