//! The soak: chaos for a set time, with one consumer process's resources sampled once a
//! second, ending with a report and a picture.
//!
//! Two chaos runs ([`driver::run_on`]) share one broker, each publishing at a steady rate
//! for the whole soak:
//!
//! - **steady**: one consumer process, sampled. It is never killed and gets no poison, so
//!   its curves are one process's life. Its messages fail once, always or permanently as in
//!   every chaos run. On a private node its connections are closed by the broker every 30
//!   s and the node's application is stopped for 5 s and started again every 5 minutes;
//!   on the cluster a node is stopped or killed (by turns, the next node each time) every
//!   minute and started again 20 s later.
//! - **crash**: two consumer processes on a queue of their own, SIGKILLed every 20 s and
//!   restarted, a poison message every 2 minutes (which aborts the process running it until
//!   it is parked), on a private node their connections closed every minute, and the same
//!   broker faults.
//!
//! Each run is reconciled from its journal as every chaos run is: nothing lost, no healthy
//! message parked, no wrong blame. The sampled curves are judged after the warm-up: the
//! median of the last window (a tenth of the samples, at least a minute) against the
//! median of the first. Flat means within 5 %. A connection recovery that lapin stalled on
//! (the transport rebuilds it, logging `by=rebuilt`) leaves one blocked IO thread behind
//! for the life of the process, which cannot be ended from outside lapin (see the guide's
//! known limitations): each such stall after the warm-up allows one thread, one descriptor
//! and [`STALL_RSS_KIB`] more, and the report says so.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use plotters::prelude::*;

use super::consumer::Protocol;
use super::driver::{self, Broker, ChaosConfig, ChaosOutcome, Sample};
use super::journal::unix_ms;
use super::script::Mix;

/// What one stalled recovery may leave behind in resident memory: the IO thread's stack
/// and its two 4 MiB frame buffers (8.4 to 8.6 MiB measured).
pub const STALL_RSS_KIB: u64 = 9 * 1024;

/// A soak's settings.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// The `chaos_consumer` binary.
    pub consumer_exe: PathBuf,
    /// How long messages are published and faults injected.
    pub duration: Duration,
    /// The samples before this are left out of the verdict.
    pub warm_up: Duration,
    /// Messages a second, both runs together (seven tenths to the steady run).
    pub rate: u32,
    /// Seeds both runs' messages and faults.
    pub seed: u64,
    /// A private node or the cluster.
    pub broker: Broker,
}

impl SoakConfig {
    /// The steady run: see the module docs.
    pub fn steady(&self) -> ChaosConfig {
        let secs = self.duration.as_secs().max(1);
        let rate = (self.rate * 7 / 10).max(1);
        let (closes, broker_faults, down) = match self.broker {
            Broker::Node(_) => (secs / 30, (secs / 300).max(1), Duration::from_secs(5)),
            Broker::Cluster(_) => (0, (secs / 60).max(1), Duration::from_secs(20)),
        };
        ChaosConfig {
            messages: (u64::from(rate) * secs) as usize,
            mix: Mix::issue(0),
            consumers: 1,
            chaos: self.duration,
            kills: 0,
            closes: closes as usize,
            app_restarts: broker_faults as usize,
            app_down: down,
            rate: Some(rate),
            sample: true,
            ..ChaosConfig::full(Protocol::Amqp091, self.consumer_exe.clone(), self.seed)
        }
    }

    /// The crash run: see the module docs.
    pub fn crash(&self) -> ChaosConfig {
        let secs = self.duration.as_secs().max(1);
        let rate = (self.rate - self.rate * 7 / 10).max(1);
        ChaosConfig {
            messages: (u64::from(rate) * secs) as usize,
            mix: Mix::issue((secs / 120).max(1) as usize),
            consumers: 2,
            chaos: self.duration,
            kills: (secs / 20) as usize,
            closes: match self.broker {
                Broker::Node(_) => (secs / 60) as usize,
                Broker::Cluster(_) => 0,
            },
            app_restarts: 0,
            rate: Some(rate),
            sample: false,
            ..ChaosConfig::full(
                Protocol::Amqp091,
                self.consumer_exe.clone(),
                self.seed ^ 0x5EED,
            )
        }
    }
}

/// A resource sampled: its name with its unit, its value in a sample, and what one stalled
/// recovery may add to it.
struct Metric {
    name: &'static str,
    value: fn(&Sample) -> f64,
    per_stall: f64,
}

const METRICS: [Metric; 3] = [
    Metric {
        name: "RSS (MiB)",
        value: |s| s.rss_kib as f64 / 1024.0,
        per_stall: STALL_RSS_KIB as f64 / 1024.0,
    },
    Metric {
        name: "open file descriptors",
        value: |s| s.fds as f64,
        per_stall: 1.0,
    },
    Metric {
        name: "threads",
        value: |s| s.threads as f64,
        per_stall: 1.0,
    },
];

/// One resource curve, judged.
#[derive(Clone, Debug, PartialEq)]
pub struct Curve {
    /// What it measures, with its unit.
    pub name: &'static str,
    /// The median of the first window after the warm-up.
    pub first: f64,
    /// The median of the last window.
    pub last: f64,
    /// The highest sample after the warm-up.
    pub peak: f64,
    /// The most the last window may be: 5 % over the first, plus the stalls' allowance.
    pub limit: f64,
}

impl Curve {
    /// Whether the last window is within 5 % of the first.
    pub fn flat(&self) -> bool {
        (self.last - self.first).abs() <= self.first * 0.05
    }

    /// Whether the last window is under the limit.
    pub fn passes(&self) -> bool {
        self.last <= self.limit
    }

    fn line(&self) -> String {
        let change = if self.first > 0.0 {
            (self.last / self.first - 1.0) * 100.0
        } else {
            0.0
        };
        format!(
            "{:<21} first {:>8.1}  last {:>8.1}  ({change:+.1} %)  peak {:>8.1}  limit {:>8.1}  {}",
            self.name,
            self.first,
            self.last,
            self.peak,
            self.limit,
            match (self.flat(), self.passes()) {
                (true, _) => "flat",
                (false, true) => "within the stalls' allowance",
                (false, false) => "GREW",
            }
        )
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Judges the three curves of `samples` after `warm_up`, allowing for `stalls` stalled
/// recoveries after it. `None` when fewer than 20 samples follow the warm-up.
pub fn judge(samples: &[Sample], warm_up: Duration, stalls: usize) -> Option<[Curve; 3]> {
    let after: Vec<&Sample> = samples.iter().filter(|s| s.at >= warm_up).collect();
    if after.len() < 20 {
        return None;
    }
    let window = (after.len() / 10).max(60).min(after.len() / 3);
    Some(METRICS.map(|m| {
        let mut first: Vec<f64> = after[..window].iter().map(|s| (m.value)(s)).collect();
        let mut last: Vec<f64> = after[after.len() - window..]
            .iter()
            .map(|s| (m.value)(s))
            .collect();
        let first = median(&mut first);
        Curve {
            name: m.name,
            first,
            last: median(&mut last),
            peak: after.iter().map(|s| (m.value)(s)).fold(0.0, f64::max),
            limit: first * 1.05 + stalls as f64 * m.per_stall,
        }
    }))
}

/// The moments (since the consumers' start) at which the process of `stderr` logged a
/// rebuilt (stalled) recovery, from the lines [`super::consumer`] writes there.
pub fn stalls(stderr: &Path, started_ms: u64) -> Vec<Duration> {
    let text = std::fs::read_to_string(stderr).unwrap_or_default();
    text.lines()
        .filter(|l| l.contains(" by=rebuilt"))
        .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
        .map(|ms| Duration::from_millis(ms.saturating_sub(started_ms)))
        .collect()
}

/// What a soak found.
#[derive(Debug)]
pub struct SoakOutcome {
    /// The sampled run.
    pub steady: ChaosOutcome,
    /// The run with kills and poison.
    pub crash: ChaosOutcome,
    /// The sampled process's stalled recoveries, since the consumers' start.
    pub stalls: Vec<Duration>,
    /// The warm-up.
    pub warm_up: Duration,
    /// The curves, or `None` when the soak was too short to judge.
    pub curves: Option<[Curve; 3]>,
}

impl SoakOutcome {
    /// Everything that fails the soak; empty when it passes.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, run) in [("steady", &self.steady), ("crash", &self.crash)] {
            out.extend(run.problems().into_iter().map(|p| format!("{name}: {p}")));
        }
        let pids: std::collections::BTreeSet<u32> =
            self.steady.samples.iter().map(|s| s.pid).collect();
        if pids.len() != 1 {
            out.push(format!(
                "the sampled consumer did not live through the soak: processes {pids:?}"
            ));
        }
        match &self.curves {
            None => out.push(format!(
                "{} samples, too few after the warm-up to judge",
                self.steady.samples.len()
            )),
            Some(curves) => out.extend(
                curves
                    .iter()
                    .filter(|c| !c.passes())
                    .map(|c| format!("{} grew: {}", c.name, c.line().trim())),
            ),
        }
        out
    }

    /// Stalls after the warm-up.
    pub fn stalls_after_warm_up(&self) -> usize {
        self.stalls.iter().filter(|at| **at >= self.warm_up).count()
    }

    /// The report: messages, faults, the curves and the verdict.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let (a, b) = (&self.steady.reconciled, &self.crash.reconciled);
        let _ = writeln!(
            s,
            "messages: {} in, {} handled, {} parked, {} lost, {} innocents parked",
            a.messages + b.messages,
            a.handled + b.handled,
            a.parked + b.parked,
            a.lost.len() + b.lost.len(),
            a.healthy_parked.len() + b.healthy_parked.len()
        );
        let (fa, fb) = (&self.steady.faults, &self.crash.faults);
        let _ = writeln!(
            s,
            "faults: {} SIGKILLs, {} poison aborts, {} forced closes ({} connections), {} broker faults (a stop_app/start_app, or a cluster node stopped or killed and started), {} consumer processes",
            fb.kills,
            fb.aborts,
            fa.closes.0 + fb.closes.0,
            fa.closes.1 + fb.closes.1,
            fa.app_restarts,
            fa.spawns + fb.spawns
        );
        let _ = writeln!(
            s,
            "stalled recoveries of the sampled consumer: {} ({} after the warm-up) at {:?}",
            self.stalls.len(),
            self.stalls_after_warm_up(),
            self.stalls
                .iter()
                .map(|d| format!("{:.1} min", d.as_secs_f64() / 60.0))
                .collect::<Vec<_>>()
        );
        let _ = writeln!(
            s,
            "sampled consumer: {} samples, warm-up {:.0} s",
            self.steady.samples.len(),
            self.warm_up.as_secs_f64()
        );
        for c in self.curves.iter().flatten() {
            let _ = writeln!(s, "  {}", c.line());
        }
        let _ = writeln!(s, "steady run: {}", self.steady.summary());
        let _ = writeln!(s, "crash run: {}", self.crash.summary());
        let problems = self.problems();
        if problems.is_empty() {
            let _ = writeln!(s, "verdict: PASS");
        } else {
            let _ = writeln!(s, "verdict: FAIL");
            for p in problems {
                let _ = writeln!(s, "  {p}");
            }
        }
        s
    }
}

/// Runs a soak.
pub async fn run(config: &SoakConfig) -> SoakOutcome {
    let (steady, crash) = (config.steady(), config.crash());
    let started_ms = unix_ms();
    let (steady, crash) = tokio::join!(
        driver::run_on(&steady, &config.broker),
        driver::run_on(&crash, &config.broker)
    );
    let stalls = stalls(&steady.journal.with_extension("stderr"), started_ms);
    let after = stalls.iter().filter(|at| **at >= config.warm_up).count();
    let curves = judge(&steady.samples, config.warm_up, after);
    SoakOutcome {
        steady,
        crash,
        stalls,
        warm_up: config.warm_up,
        curves,
    }
}

/// The samples as CSV: seconds, pid, RSS in KiB, descriptors, threads.
pub fn csv(samples: &[Sample]) -> String {
    let mut s = String::from("seconds,pid,rss_kib,fds,threads\n");
    for x in samples {
        let _ = writeln!(
            s,
            "{:.1},{},{},{},{}",
            x.at.as_secs_f64(),
            x.pid,
            x.rss_kib,
            x.fds,
            x.threads
        );
    }
    s
}

/// Draws the three curves, one above the other, as an SVG at `path`: the warm-up's end as an
/// orange line, each stalled recovery as a red one.
pub fn plot(
    samples: &[Sample],
    warm_up: Duration,
    stalls: &[Duration],
    title: &str,
    path: &Path,
) -> Result<(), String> {
    let root = SVGBackend::new(path, (960, 840)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| e.to_string())?;
    let minutes = |d: Duration| d.as_secs_f64() / 60.0;
    let end = samples.last().map_or(1.0, |s| minutes(s.at)).max(1.0);
    for (area, Metric { name, value, .. }) in root.split_evenly((3, 1)).iter().zip(METRICS) {
        let top = samples.iter().map(value).fold(1.0, f64::max) * 1.25;
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .caption(name, ("sans-serif", 17))
            .build_cartesian_2d(0.0..end, 0.0..top)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("minutes")
            .light_line_style(WHITE)
            .draw()
            .map_err(|e| e.to_string())?;
        let marks = std::iter::once((warm_up, RGBColor(230, 140, 0)))
            .chain(stalls.iter().map(|at| (*at, RGBColor(210, 40, 40))));
        for (at, color) in marks {
            let x = minutes(at);
            chart
                .draw_series(LineSeries::new([(x, 0.0), (x, top)], color.stroke_width(1)))
                .map_err(|e| e.to_string())?;
        }
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|s| (minutes(s.at), value(s))),
                BLUE.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(n: u64, rss: impl Fn(u64) -> u64, threads: impl Fn(u64) -> u64) -> Vec<Sample> {
        (0..n)
            .map(|i| Sample {
                at: Duration::from_secs(i),
                pid: 7,
                rss_kib: rss(i),
                fds: 19,
                threads: threads(i),
            })
            .collect()
    }

    #[test]
    fn a_flat_process_passes_and_a_growing_one_fails_unless_stalls_explain_it() {
        let warm = Duration::from_secs(60);
        let flat = judge(&samples(600, |i| 30_000 + i % 7, |_| 6), warm, 0).unwrap();
        assert!(flat.iter().all(|c| c.flat() && c.passes()), "{flat:?}");

        // 1 MiB a minute: 10 % over the soak.
        let leak = judge(&samples(600, |i| 30_000 + i * 17, |_| 6), warm, 0).unwrap();
        assert!(!leak[0].passes(), "{:?}", leak[0]);
        assert!(leak[1].passes() && leak[2].passes());

        // One thread and 8.5 MiB more half-way: a stall allows for it, no stall does not.
        let step = |i| if i > 300 { 38_700 } else { 30_000 };
        let threads = |i| if i > 300 { 7 } else { 6 };
        let unexplained = judge(&samples(600, step, threads), warm, 0).unwrap();
        assert!(!unexplained[0].passes() && !unexplained[2].passes());
        let stalled = judge(&samples(600, step, threads), warm, 1).unwrap();
        assert!(stalled.iter().all(Curve::passes), "{stalled:?}");
        assert!(!stalled[2].flat());

        // The warm-up is left out; too short a soak is not judged.
        let early = judge(
            &samples(600, |i| if i < 60 { 5_000 } else { 30_000 }, |_| 6),
            warm,
            0,
        );
        assert!(early.unwrap()[0].flat());
        assert!(judge(&samples(70, |_| 1, |_| 1), warm, 0).is_none());
    }

    #[test]
    fn stalls_are_read_from_the_consumer_s_warnings() {
        let path = std::env::temp_dir().join(format!("soak-stalls-{}.stderr", std::process::id()));
        std::fs::write(
            &path,
            "1000120000 9 WARN transport_amqp091::link connection recovered recoveries=3 node=amqp://guest:****@127.0.0.1:5694/%2f by=rebuilt\n\
             1000130000 9 WARN transport_amqp091::link connection recovered recoveries=4 node=amqp://guest:****@127.0.0.1:5694/%2f by=lapin\n\
             chaos_consumer: connecting: refused\n",
        )
        .unwrap();
        assert_eq!(stalls(&path, 1_000_000_000), vec![Duration::from_secs(120)]);
        let _ = std::fs::remove_file(&path);
    }
}
