//! Seeded fault injection over every fault class crash attribution has to survive, on the
//! real consumer driver and the broker model, for thousands of seeds.
//!
//! Each seed draws a mix: one or two processes, each running one or two consumers that
//! share its connection and its fate; a prefetch; fetches that take time to answer; and
//! faults at random rates and at random times: watches and subscribes that fail, fetches
//! that give up with their message on the way, graceful restarts (a deploy) that can land
//! while a fetch is under way, and messages that share a message id or a body. A
//! single-process mix adds the faults whose excuse only the process that saw them holds
//! (see the guide's known limitations, `docs/limitations.md`): publishes lost, refused,
//! returned as unroutable and returns reported against the wrong publish, connections
//! dropped mid-run, and fetches lost in flight (at a random rate and in counted bursts: the
//! message goes back to the head of the isolation queue redelivered, and the fetch fails
//! with `FetchLost`). Poison messages kill their process on every run. For every seed:
//!
//! * nothing is lost, and every message ends as its script says;
//! * no message whose handler would succeed is ever charged a crash or parked
//!   `crash-loop`;
//! * each poison message is parked `crash-loop` after exactly crash limit + 1 crashes,
//!   none counted before the run alone that took its process down. A fetch of it lost in
//!   flight after such a crash makes the crash's redelivery look like the lost fetch's,
//!   whose excuse it takes: it may run alone once more per fetch of it lost, and no more.
//!
//! `FAULT_SEEDS` sets how many seeds run (default 10,000); `FAULT_SEED` runs one, with its
//! trace printed when it fails.

use std::fmt::Write as _;
use std::thread;
use std::time::{Duration, Instant};

use retry_core::{RetryPolicy, Terminal, splitmix64};
use transport_memory::{
    Fate, FaultRates, MessageEvent, Outgoing, Report, Script, SimEvent, Simulation, Step, Stop,
};

const QUEUE: &str = "orders";
const CRASH_LIMIT: u32 = 2;

/// A small, seeded random stream.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        splitmix64(self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn rate(&mut self, max_percent: u64) -> f64 {
        self.below(max_percent + 1) as f64 / 100.0
    }
}

/// What each message is meant to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Succeeds,
    FailsOnce,
    AlwaysFails,
    Permanent,
    Poison,
}

impl Kind {
    fn script(self, takes: Duration) -> Script {
        let script = match self {
            Kind::Succeeds => Script::succeed(),
            Kind::FailsOnce => Script::fail_times(1),
            Kind::AlwaysFails => Script::always(Step::fail("downstream down")),
            Kind::Permanent => Script::always(Step::permanent("bad payload")),
            Kind::Poison => Script::always(Step::Crash),
        };
        script.taking(takes)
    }

    /// The fate its script leads to.
    fn expected(self) -> &'static str {
        match self {
            Kind::Succeeds | Kind::FailsOnce => "handled",
            Kind::AlwaysFails => "attempts-exhausted",
            Kind::Permanent => "permanent",
            Kind::Poison => "crash-loop",
        }
    }
}

/// The mix one seed draws.
#[derive(Debug)]
struct Mix {
    processes: u32,
    per_process: u32,
    prefetch: u16,
    fetch_latency: Duration,
    rates: FaultRates,
    connection_drops: f64,
    events: Vec<(Duration, SimEvent)>,
    messages: Vec<(String, Kind, Option<&'static str>, Duration)>,
}

fn mix(seed: u64) -> Mix {
    let mut d = Draw(seed);
    let processes = 1 + d.below(2) as u32;
    let per_process = 1 + d.below(2) as u32;
    let prefetch = 1 + d.below(4) as u16;
    let fetch_latency = Duration::from_millis([0, 0, 5, 40][d.below(4) as usize]);
    let one_process = processes == 1;
    let mut rates = FaultRates::new()
        .fail_watches(d.rate(30))
        .fail_subscribes(d.rate(30))
        .late_fetches(d.rate(30));
    let mut connection_drops = 0.0;
    if one_process {
        rates = rates
            .lose_publishes(d.rate(5))
            .refuse_publishes(d.rate(5))
            .lose_confirms(d.rate(5))
            .return_publishes(d.rate(20))
            .misattribute_returns(if d.chance(50) { 1.0 } else { 0.0 })
            .lost_fetches(d.rate(30));
        connection_drops = d.rate(10);
    }
    let mut events = Vec::new();
    for _ in 0..d.below(3) {
        events.push((
            Duration::from_millis(d.below(20_000)),
            SimEvent::RestartConsumers,
        ));
    }
    for _ in 0..d.below(3) {
        let at = Duration::from_millis(d.below(20_000));
        let event = match d.below(3) {
            0 => SimEvent::FailWatches(1 + d.below(3) as u32),
            1 => SimEvent::FailSubscribes(1 + d.below(3) as u32),
            _ => SimEvent::LateFetches(1 + d.below(3) as u32),
        };
        events.push((at, event));
    }
    if one_process && d.chance(50) {
        events.push((
            Duration::from_millis(d.below(20_000)),
            SimEvent::CloseConnections,
        ));
    }
    if one_process && d.chance(50) {
        events.push((
            Duration::from_millis(d.below(20_000)),
            SimEvent::LoseFetches(1 + d.below(3) as u32),
        ));
    }
    let count = 6 + d.below(6) as usize;
    let poison = 1 + d.below(2) as usize;
    let mut messages = Vec::new();
    for i in 0..count + poison {
        let kind = if i >= count {
            Kind::Poison
        } else {
            [
                Kind::Succeeds,
                Kind::Succeeds,
                Kind::FailsOnce,
                Kind::AlwaysFails,
                Kind::Permanent,
            ][d.below(5) as usize]
        };
        // A third of them share one message id and body with each other.
        let shared = d.chance(33).then_some("shared");
        let takes = Duration::from_millis(10 + d.below(300));
        messages.push((format!("{kind:?}-{i}"), kind, shared, takes));
    }
    // Shuffled, so poison messages land anywhere in the queue.
    messages.sort_by_key(|(name, ..)| splitmix64(seed ^ name.len() as u64 ^ hash(name)));
    Mix {
        processes,
        per_process,
        prefetch,
        fetch_latency,
        rates,
        connection_drops,
        events,
        messages,
    }
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn simulate(seed: u64, trace: bool) -> (Mix, Report) {
    let mix = mix(seed);
    let policy = RetryPolicy::delays([1, 2].map(Duration::from_secs))
        .with_crash_limit(CRASH_LIMIT)
        .with_crash_delay(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut sim = Simulation::builder(QUEUE, policy)
        .with_consumers(mix.processes)
        .with_consumers_per_process(mix.per_process)
        .with_prefetch(mix.prefetch)
        .with_fetch_latency(mix.fetch_latency)
        .with_faults(mix.rates)
        .with_connection_drop_rate(mix.connection_drops)
        .with_seed(seed)
        .with_trace(trace)
        .with_horizon(Duration::from_secs(24 * 3600))
        .build()
        .unwrap();
    for (name, kind, shared, takes) in &mix.messages {
        let body = shared.unwrap_or(name).as_bytes().to_vec();
        let id = shared.unwrap_or(name);
        let message = Outgoing::to_queue(QUEUE, body).with_message_id(id);
        sim.publish_labelled(name, message, kind.script(*takes))
            .unwrap();
    }
    for (at, event) in &mix.events {
        sim.schedule(*at, event.clone());
    }
    let report = sim.run_until_quiet();
    (mix, report)
}

/// What is wrong with one seed's run, if anything.
fn violations(mix: &Mix, report: &Report) -> Vec<String> {
    let mut wrong = Vec::new();
    if report.stop != Stop::Quiet {
        wrong.push(format!("stopped at the horizon: {:?}", report.stop));
    }
    for (name, kind, _, _) in &mix.messages {
        let Some(m) = report.message(name) else {
            wrong.push(format!("{name}: never seen"));
            continue;
        };
        let fate = match &m.fate {
            Fate::Handled { .. } => "handled".to_owned(),
            Fate::Parked { reason } => reason.clone(),
            other => format!("{other:?}"),
        };
        if fate != kind.expected() {
            wrong.push(format!(
                "{name}: ended {fate}, its script says {}",
                kind.expected()
            ));
        }
        let charged = m
            .terminals
            .iter()
            .any(|(_, t)| matches!(t, Terminal::Diverted { .. }));
        if *kind != Kind::Poison && (m.crashes > 0 || charged) {
            wrong.push(format!(
                "{name}: its handler never crashes, yet it was charged {} crash(es)",
                m.crashes
            ));
        }
        if *kind == Kind::Poison {
            // Parked after exactly limit + 1 crashes, each a run alone that took its process
            // down: never a crash counted before the run that caused it. A lost confirm can
            // leave two copies sharing the first crashes; with one copy the count is exact.
            let mut solo_crashes = 0;
            let mut early = None;
            for event in m.events() {
                match event {
                    MessageEvent::Run(r) if r.solo && r.step == Step::Crash => solo_crashes += 1,
                    MessageEvent::Ended(_, Terminal::Diverted { crashes, .. })
                        if *crashes > solo_crashes =>
                    {
                        early.get_or_insert(*crashes);
                    }
                    _ => {}
                }
            }
            let copies = m
                .terminals
                .iter()
                .filter(|(_, t)| matches!(t, Terminal::DeadLettered { .. }))
                .count()
                .max(1);
            // A fetch of it lost in flight after a crash sends it back redelivered twice
            // over, and the excuse of the lost fetch takes the crash's place: it costs one
            // more run alone, never a crash counted without its run (see the guide's known
            // limitations).
            let runs = CRASH_LIMIT + 1..=CRASH_LIMIT + 1 + m.lost_fetches;
            let exact = copies > 1 || runs.contains(&solo_crashes);
            if m.crashes != CRASH_LIMIT + 1 || !exact || early.is_some() {
                wrong.push(format!(
                    "{name}: parked with {} crashes counted after {solo_crashes} runs alone crashed ({copies} copies{}, {} fetches lost in flight), not {}",
                    m.crashes,
                    early.map_or(String::new(), |c| format!(", crash {c} counted before its run")),
                    m.lost_fetches,
                    CRASH_LIMIT + 1
                ));
            }
        }
    }
    wrong
}

fn explain(seed: u64) -> String {
    let (mix, report) = simulate(seed, true);
    let mut out = format!("seed {seed}: {mix:#?}\n{}\n", report.summary());
    for v in violations(&mix, &report) {
        let name = v.split(':').next().unwrap_or_default();
        if let Some(m) = report.message(name) {
            let _ = writeln!(out, "{v}\n{}", m.timeline(report.started_at));
        }
    }
    if std::env::var_os("FAULT_TRACE").is_some() {
        let _ = writeln!(out, "{}", report.trace);
    }
    out
}

#[test]
fn no_loss_and_no_blame_under_every_fault_class_over_thousands_of_seeds() {
    if let Some(seed) = std::env::var("FAULT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        let (mix, report) = simulate(seed, false);
        assert!(violations(&mix, &report).is_empty(), "{}", explain(seed));
        return;
    }
    let seeds: u64 = std::env::var("FAULT_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let started = Instant::now();
    let workers = thread::available_parallelism().map_or(2, |n| n.get() as u64);
    let failed: Vec<(u64, Vec<String>)> = thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                scope.spawn(move || {
                    (w..seeds)
                        .step_by(workers as usize)
                        .filter_map(|seed| {
                            let (mix, report) = simulate(seed, false);
                            let wrong = violations(&mix, &report);
                            (!wrong.is_empty()).then_some((seed, wrong))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a worker panicked"))
            .collect()
    });
    eprintln!(
        "{seeds} seeds in {:.1?}, {} failed",
        started.elapsed(),
        failed.len()
    );
    let mut failed = failed;
    failed.sort_by_key(|(seed, _)| *seed);
    if let Some((seed, _)) = failed.first() {
        let listed: Vec<String> = failed
            .iter()
            .take(10)
            .map(|(s, w)| format!("seed {s}: {}", w.join("; ")))
            .collect();
        panic!(
            "{} of {seeds} seeds failed:\n{}\n\nthe first, replayed (FAULT_SEED={seed}):\n{}",
            failed.len(),
            listed.join("\n"),
            explain(*seed)
        );
    }
}

/// The seeds do exercise every fault class: counted over the first 400 seeds, traced.
#[test]
fn the_seeds_exercise_every_fault_class() {
    let mut counts = std::collections::BTreeMap::<&str, u64>::new();
    for seed in 0..400 {
        let (mix, report) = simulate(seed, true);
        let trace = report.trace.to_string();
        let mut count = |name, n: usize| *counts.entry(name).or_default() += n as u64;
        count("watches failed", trace.matches("a watch of").count());
        count("subscribes failed", trace.matches("a subscribe to").count());
        count(
            "fetches given up with their message on the way",
            trace
                .matches("gives up with its message on the way")
                .count(),
        );
        count(
            "fetches lost in flight, their message requeued redelivered",
            trace.matches("is lost in flight").count(),
        );
        count(
            "publishes returned",
            trace.matches("returned unroutable").count(),
        );
        count(
            "confirm batches with returns handed to the wrong publish",
            trace.matches("handed to another publish's confirm").count(),
        );
        count(
            "graceful restarts",
            trace.matches("graceful restart").count(),
        );
        count("connections dropped", trace.matches("close conn").count());
        let declined: u64 = report
            .consumers
            .iter()
            .filter_map(|c| match &c.state {
                transport_memory::ConsumerState::Finished(r) => Some(r.declined),
                _ => None,
            })
            .sum();
        count(
            "suspects fetched after shutdown began, put back unrun",
            declined as usize,
        );
        let crashes = trace.matches("CRASH").count();
        count("processes crashed by poison", crashes);
        if mix.per_process == 2 {
            count("processes of two consumers crashed together", crashes);
        }
        count(
            "messages sharing one id and body",
            mix.messages.iter().filter(|m| m.2.is_some()).count(),
        );
        assert!(violations(&mix, &report).is_empty(), "{}", explain(seed));
    }
    let listed: Vec<String> = counts.iter().map(|(k, v)| format!("{v:>6}  {k}")).collect();
    eprintln!("over 400 seeds:\n{}", listed.join("\n"));
    for (name, n) in &counts {
        assert!(*n > 0, "no seed exercised: {name}");
    }
}

/// A sweep over the moments a connection can drop while suspects run alone, in a process
/// of two consumers, with a graceful restart soon after or none: the process that saw the
/// drop knows the suspect it held comes back through no crash, whichever of its consumers
/// fetches it next, and puts it back fresh before a restart.
#[test]
fn a_suspect_whose_connection_drops_while_it_runs_alone_is_never_charged() {
    let mut runs = 0;
    for drop_at in (0..48).map(|i| Duration::from_millis(1_000 + i * 125)) {
        for restart in [None, Some(Duration::from_millis(150))] {
            let policy = RetryPolicy::delays([Duration::from_secs(1)])
                .with_crash_limit(CRASH_LIMIT)
                .with_crash_delay(Duration::from_secs(1))
                .build()
                .unwrap();
            let mut sim = Simulation::builder(QUEUE, policy)
                .with_consumers_per_process(2)
                .with_prefetch(2)
                .with_trace(false)
                .build()
                .unwrap();
            // The poison takes its process down with everything it held, so every other
            // message runs alone, as a suspect, soon after.
            sim.publish(
                "poison",
                Script::always(Step::Crash).taking(Duration::from_millis(300)),
            )
            .unwrap();
            for i in 0..6 {
                let script = Script::succeed().taking(Duration::from_millis(400 + i * 50));
                sim.publish(format!("healthy-{i}"), script).unwrap();
            }
            sim.schedule(drop_at, SimEvent::CloseConnections);
            if let Some(after) = restart {
                sim.schedule(drop_at + after, SimEvent::RestartConsumers);
            }
            let report = sim.run_until_quiet();
            for i in 0..6 {
                let m = report.message(&format!("healthy-{i}")).unwrap();
                assert!(
                    matches!(m.fate, Fate::Handled { .. }) && m.crashes == 0,
                    "drop at {drop_at:?}, restart {restart:?}: healthy-{i} charged {} crashes\n{}",
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
            runs += 1;
        }
    }
    assert_eq!(runs, 96);
}
