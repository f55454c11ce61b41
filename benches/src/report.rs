//! The throughput table: one line per measurement (`--tsv`), read back and shown as each
//! round, min, median and max, with the ratios of ours to each baseline *in the same
//! round*, per prefetch and body size; and the picture of msg/s against prefetch.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::Duration;

use bench_support::plot::{Panel, Series, log_x_panels};
use bench_support::proc::load1;
use bench_support::stats::min_median_max;

use crate::{BoxError, Measured, Peer, Side};

/// The prefetch and body size of lines that do not give theirs.
const PREFETCH: u16 = 100;
const BODY: usize = 256;

/// What one measurement runs: a path at a prefetch, with bodies of `body` bytes.
#[derive(Clone, Debug)]
pub struct Setting {
    /// The path.
    pub path: String,
    /// The prefetch.
    pub prefetch: u16,
    /// Bytes per body.
    pub body: usize,
}

/// One measurement: a round, a consumer and its setting, its rate, the load average when it
/// ended, the CPU time per message of the consumer's process and of the broker, and the
/// growth of the consumer process's resident memory (`NaN` if unknown or not measured).
#[derive(Clone, Debug)]
pub struct Sample {
    /// The round, from 1.
    pub round: usize,
    /// The path measured.
    pub path: String,
    /// Messages.
    pub n: u64,
    /// Messages per second, from the start of consuming to the last settlement.
    pub rate: f64,
    /// Messages per second from the first message in hand to the last settlement.
    pub steady: f64,
    /// The one-minute load average when it ended.
    pub load: f64,
    /// CPU µs per message of this process.
    pub client_us: f64,
    /// CPU µs per message of the server.
    pub broker_us: f64,
    /// The prefetch.
    pub prefetch: u16,
    /// Bytes per body.
    pub body: usize,
    /// Resident memory growth, KiB.
    pub rss_kib: f64,
}

impl Sample {
    /// `memory`: whether the growth of resident memory means anything, that is whether
    /// this measurement is the only one of its process (another's freed memory would be
    /// reused without showing).
    pub fn new(round: usize, setting: &Setting, n: u64, m: Measured, memory: bool) -> Self {
        let per_message = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
        let t = m.timing;
        Sample {
            round,
            path: setting.path.clone(),
            n,
            rate: n as f64 / t.wall.as_secs_f64(),
            steady: n as f64 / m.steady().as_secs_f64(),
            load: load1().unwrap_or(f64::NAN),
            client_us: per_message(t.cpu.client.unwrap_or_default()),
            broker_us: t.cpu.broker.map_or(f64::NAN, per_message),
            prefetch: setting.prefetch,
            body: setting.body,
            rss_kib: match m.rss_growth {
                Some(bytes) if memory => bytes as f64 / 1024.0,
                _ => f64::NAN,
            },
        }
    }

    /// `round path n seconds msg/s load1 client-µs/msg broker-µs/msg prefetch body
    /// rss-growth-KiB steady-msg/s`, tab-separated; unknown figures are `NaN`.
    pub fn tsv(&self) -> String {
        format!(
            "{}\t{}\t{}\t{:.4}\t{:.0}\t{:.2}\t{:.1}\t{:.1}\t{}\t{}\t{:.0}\t{:.0}",
            self.round,
            self.path,
            self.n,
            self.n as f64 / self.rate,
            self.rate,
            self.load,
            self.client_us,
            self.broker_us,
            self.prefetch,
            self.body,
            self.rss_kib,
            self.steady,
        )
    }
}

/// Reads `tsv` lines. Only the first six columns are needed: a missing or unparsable CPU,
/// memory or steady figure is unknown, and lines without a prefetch and body size (eight
/// columns) were measured at prefetch 100 with 256-byte bodies.
pub fn parse_tsv(text: &str) -> Result<Vec<Sample>, BoxError> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 6 {
            return Err(format!("not a result line: {line:?}").into());
        }
        let float = |i: usize| f.get(i).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
        out.push(Sample {
            round: f[0].parse()?,
            path: f[1].to_owned(),
            n: f[2].parse()?,
            rate: f[4].parse()?,
            steady: float(11),
            load: float(5),
            client_us: float(6),
            broker_us: float(7),
            prefetch: f.get(8).map_or(Ok(PREFETCH), |v| v.parse())?,
            body: f.get(9).map_or(Ok(BODY), |v| v.parse())?,
            rss_kib: float(10),
        });
    }
    Ok(out)
}

/// A part of the table: one side of the retry decision, ours and the baselines it is
/// compared with.
#[derive(Clone, Debug)]
pub struct Section {
    /// Its title (`success path (consume + settle)`).
    pub title: String,
    /// Its short name in the overview (`success`).
    pub short: &'static str,
    /// Our path (`ours-success`).
    pub ours: &'static str,
    /// The baselines: path and label.
    pub baselines: Vec<(String, String)>,
}

/// The two sections of a table, from the peers measured beside ours (`baselines` among
/// them; the others are shown without ratios), and the legend of their labels.
pub fn sections(peers: &[Peer]) -> (Vec<Section>, String) {
    let width = peers
        .iter()
        .map(|p| p.label.len())
        .max()
        .unwrap_or(0)
        .max(4)
        + 2;
    let sections = [
        (
            Side::Success,
            "success path (consume + settle)",
            "success",
            "ours-success",
        ),
        (
            Side::Retry,
            "retry path (clone, confirm, then settle)",
            "retry",
            "ours-retry",
        ),
    ]
    .into_iter()
    .map(|(side, title, short, ours)| Section {
        title: title.to_owned(),
        short,
        ours,
        baselines: peers
            .iter()
            .filter(|p| p.side == side)
            .map(|p| (p.path.to_owned(), p.label.to_owned()))
            .collect(),
    })
    .collect();
    let mut legend = String::new();
    for p in peers {
        let _ = writeln!(legend, "{:<width$}{}", format!("{}:", p.label), p.legend);
    }
    let _ = writeln!(legend, "{:<width$}the retry consumer", "ours:");
    (sections, legend)
}

const LABEL: usize = 46;

/// A figure of a ratio row, for the summary: its label, and min, median and max over the
/// rounds.
type Ratio = (String, (f64, f64, f64));

/// The table: an overview, then per body size and prefetch one block (a rate per consumer
/// and round, the ratios of ours to each baseline round by round, CPU time per message and
/// memory growth), then, if there are several, the ratios' medians side by side.
pub fn table(samples: &[Sample], sections: &[Section], legend: &str) -> String {
    let mut out = String::new();
    let mut groups: BTreeMap<(usize, u16), Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        groups.entry((s.body, s.prefetch)).or_default().push(s);
    }
    let rounds: BTreeSet<usize> = samples.iter().map(|s| s.round).collect();
    let n = samples.first().map_or(0, |s| s.n);
    let prefetches: BTreeSet<u16> = samples.iter().map(|s| s.prefetch).collect();
    let _ = writeln!(
        out,
        "{n} persistent messages, durable queues, prefetch {}, {} interleaved round(s)",
        prefetches
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        rounds.len()
    );
    let loads: Vec<f64> = samples
        .iter()
        .map(|s| s.load)
        .filter(|l| !l.is_nan())
        .collect();
    if !loads.is_empty() {
        let (lo, _, hi) = min_median_max(loads);
        let _ = writeln!(
            out,
            "load average (1 min) during the run: {lo:.2} to {hi:.2}"
        );
    }
    out.push('\n');
    out.push_str(legend);
    let mut summary: Vec<((usize, u16), Vec<Ratio>)> = Vec::new();
    for (&(body, prefetch), group) in &groups {
        let _ = writeln!(out, "\n=== prefetch {prefetch}, {body}-byte bodies ===");
        let (text, ratios) = block(group, sections);
        out.push_str(&text);
        summary.push(((body, prefetch), ratios));
    }
    if summary.len() > 1 {
        out.push_str(&overview(&summary));
    }
    out
}

/// The ratios of every block side by side: median (min-max) per body size and prefetch.
fn overview(summary: &[((usize, u16), Vec<Ratio>)]) -> String {
    const CELL: usize = 18;
    const LABEL: usize = 54;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n=== ratios by prefetch, median (min-max) over the rounds ==="
    );
    let _ = write!(out, "{:<LABEL$}", "");
    for ((body, prefetch), _) in summary {
        let _ = write!(out, "{:>CELL$}", format!("p{prefetch} {body}B"));
    }
    out.push('\n');
    let mut labels: Vec<&str> = Vec::new();
    for (_, ratios) in summary {
        for (label, _) in ratios {
            if !labels.contains(&label.as_str()) {
                labels.push(label);
            }
        }
    }
    for label in labels {
        let _ = write!(out, "{label:<LABEL$}");
        for (_, ratios) in summary {
            let cell = ratios.iter().find(|(l, _)| l == label).map_or_else(
                || "-".to_owned(),
                |(_, (lo, mid, hi))| format!("{mid:.2} ({lo:.2}-{hi:.2})"),
            );
            let _ = write!(out, "{cell:>CELL$}");
        }
        out.push('\n');
    }
    out
}

/// One body size and prefetch: per section a rate per consumer and round, then ratios of
/// ours to each baseline round by round, then CPU time per message and its ratios, then
/// the growth of resident memory and its ratios where measured. Returns the text and the
/// ratio rows' min, median and max.
fn block(samples: &[&Sample], sections: &[Section]) -> (String, Vec<Ratio>) {
    let mut by: BTreeMap<(&str, usize), &Sample> = BTreeMap::new();
    let rounds: Vec<usize> = samples
        .iter()
        .map(|s| s.round)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    for s in samples {
        by.insert((s.path.as_str(), s.round), s);
    }
    let series = |path: &str, f: fn(&Sample) -> f64| -> Vec<Option<f64>> {
        rounds
            .iter()
            .map(|r| by.get(&(path, *r)).map(|s| f(s)).filter(|v| !v.is_nan()))
            .collect()
    };
    let known = |path: &str, f: fn(&Sample) -> f64| series(path, f).iter().any(Option::is_some);
    let present = |path: &str| rounds.iter().any(|r| by.contains_key(&(path, *r)));

    let mut out = String::new();
    let mut ratios: Vec<Ratio> = Vec::new();
    let mut header = format!("{:<LABEL$}", "");
    for r in &rounds {
        let _ = write!(header, "{:>9}", format!("round {r}"));
    }
    let _ = write!(header, "{:>9}{:>9}{:>9}", "min", "median", "max");
    let row = |out: &mut String, label: &str, values: &[Option<f64>], unit: &str| {
        let _ = write!(out, "{label:<LABEL$}");
        let fmt = |v: f64| match unit {
            "x" => format!("{v:.2}x"),
            "us" => format!("{v:.1}"),
            _ => format!("{v:.0}"),
        };
        for v in values {
            let _ = write!(out, "{:>9}", v.map_or("-".into(), fmt));
        }
        let known: Vec<f64> = values.iter().flatten().copied().collect();
        let summary = (!known.is_empty()).then(|| min_median_max(known));
        if let Some((lo, mid, hi)) = summary {
            let _ = write!(out, "{:>9}{:>9}{:>9}", fmt(lo), fmt(mid), fmt(hi));
        }
        out.push('\n');
        summary
    };
    // Ours over a baseline, round by round, as a row; kept for the overview under the
    // section's name. A ratio to 0 (CPU time under a clock tick) is unknown.
    let mut ratio_row = |out: &mut String,
                         (section, ours, base): (&str, &str, &str),
                         label: String,
                         f: fn(&Sample) -> f64| {
        let values: Vec<Option<f64>> = series(ours, f)
            .into_iter()
            .zip(series(base, f))
            .map(|(a, b)| Some(a? / b?).filter(|r| r.is_finite()))
            .collect();
        if let Some(summary) = row(out, &label, &values, "x") {
            ratios.push((format!("{section}: {}", label.trim()), summary));
        }
    };

    for Section {
        title,
        short: section,
        ours,
        baselines,
    } in sections
    {
        let (section, ours) = (*section, *ours);
        let shown: Vec<(&str, &str)> = baselines
            .iter()
            .map(|(p, l)| (p.as_str(), l.as_str()))
            .chain([(ours, "ours")])
            .filter(|(p, _)| present(p))
            .collect();
        if shown.is_empty() {
            continue;
        }
        let _ = writeln!(out, "\n{title}, msg/s");
        let _ = writeln!(out, "{header}");
        for (path, label) in &shown {
            row(
                &mut out,
                &format!("  {label}"),
                &series(path, |s| s.rate),
                "",
            );
        }
        let compared: Vec<(&str, &str)> = baselines
            .iter()
            .map(|(p, l)| (p.as_str(), l.as_str()))
            .filter(|(p, _)| present(ours) && present(p))
            .collect();
        for (path, label) in &compared {
            let label = format!("  ours / {label}, msg/s");
            ratio_row(&mut out, (section, ours, path), label, |s| s.rate);
        }
        if shown.iter().any(|(p, _)| known(p, |s| s.client_us)) {
            let _ = writeln!(
                out,
                "  CPU time per message, µs (consumer process / broker)"
            );
            for (path, label) in shown.iter().filter(|(p, _)| known(p, |s| s.client_us)) {
                row(
                    &mut out,
                    &format!("    {label}"),
                    &series(path, |s| s.client_us),
                    "us",
                );
                row(
                    &mut out,
                    "      broker",
                    &series(path, |s| s.broker_us),
                    "us",
                );
            }
            for (path, label) in &compared {
                for (what, f) in [
                    ("client", (|s| s.client_us) as fn(&Sample) -> f64),
                    ("broker", |s| s.broker_us),
                ] {
                    if known(ours, f) && known(path, f) {
                        let label = format!("  ours / {label}, {what} CPU");
                        ratio_row(&mut out, (section, ours, path), label, f);
                    }
                }
            }
        }
        if shown.iter().any(|(p, _)| known(p, |s| s.rss_kib)) {
            let _ = writeln!(
                out,
                "  resident memory growth while consuming, KiB (peak - start)"
            );
            for (path, label) in shown.iter().filter(|(p, _)| known(p, |s| s.rss_kib)) {
                row(
                    &mut out,
                    &format!("    {label}"),
                    &series(path, |s| s.rss_kib),
                    "",
                );
            }
            for (path, label) in &compared {
                if known(ours, |s| s.rss_kib) && known(path, |s| s.rss_kib) {
                    let label = format!("  ours / {label}, memory");
                    ratio_row(&mut out, (section, ours, path), label, |s| s.rss_kib);
                }
            }
        }
    }
    (out, ratios)
}

/// Draws msg/s against prefetch, a panel per section, as an SVG at `file`:
/// per consumer a line through the medians and a bar from min to max. Of several body sizes,
/// the one measured at the most prefetches is drawn (the others are memory runs).
pub fn plot(samples: &[Sample], sections: &[Section], file: &str) -> Result<(), BoxError> {
    let mut prefetches: BTreeMap<usize, BTreeSet<u16>> = BTreeMap::new();
    for s in samples {
        prefetches.entry(s.body).or_default().insert(s.prefetch);
    }
    let body = prefetches
        .iter()
        .max_by_key(|(body, p)| (p.len(), std::cmp::Reverse(**body)))
        .map(|(body, _)| *body)
        .ok_or("no results to plot")?;
    let rounds = samples
        .iter()
        .map(|s| s.round)
        .collect::<BTreeSet<_>>()
        .len();
    let n = samples.first().map_or(0, |s| s.n);
    let panels: Vec<Panel> = sections
        .iter()
        .map(|section| Panel {
            caption: section.title.clone(),
            series: section
                .baselines
                .iter()
                .map(|(p, l)| (p.as_str(), l.as_str()))
                .chain([(section.ours, "ours")])
                .map(|(path, label)| Series {
                    label: label.to_owned(),
                    points: prefetches[&body]
                        .iter()
                        .filter_map(|&p| {
                            let rates: Vec<f64> = samples
                                .iter()
                                .filter(|s| s.path == path && s.body == body && s.prefetch == p)
                                .map(|s| s.rate)
                                .collect();
                            (!rates.is_empty()).then(|| {
                                let (lo, mid, hi) = min_median_max(rates);
                                (f64::from(p), lo, mid, hi)
                            })
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect();
    let title = format!(
        "msg/s by prefetch: {n} persistent {body}-byte messages, {rounds} round(s); line: median, bars: min to max"
    );
    log_x_panels(file.as_ref(), &title, "prefetch (log)", "msg/s", &panels)?;
    Ok(())
}
