//! A poison message that kills its consumer every time, beside a message that recovers
//! after two failures and three healthy ones sharing its prefetch window, on the in-memory
//! broker in virtual time. Only the poison is ever blamed: the others go down with it once,
//! come back as suspects, run alone and are handled.
//!
//! ```text
//! cargo run -p examples --example 01_crash_loop             # timeline and summary
//! cargo run -p examples --example 01_crash_loop -- --trace  # plus the broker's trace
//! ```

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use retry_core::{ParkedRecord, RetryPolicy, Terminal, Timestamp, format_delay};
use transport_memory::{MessageEvent, MessageReport, Report, Script, Simulation, Step};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    print!("{}", run(std::env::args().any(|a| a == "--trace"))?);
    Ok(())
}

/// Runs the simulation and writes what the example prints: the timeline, the summary, the
/// parking queue and the totals, and the broker's trace if `trace` is set.
fn run(trace: bool) -> Result<String, Box<dyn std::error::Error>> {
    let mut out = String::new();
    let policy = RetryPolicy::delays([60, 600, 3600].map(Duration::from_secs)).build()?;
    writeln!(
        out,
        "queue \"comments\": delays 1m, 10m, 1h; crash limit {}, crash delay {}; prefetch 10; a crashed consumer restarts after 5s",
        policy.crash_limit(),
        format_delay(policy.crash_delay()),
    )?;
    let mut sim = Simulation::builder("comments", policy)
        .with_prefetch(10)
        .with_restart_delay(Duration::from_secs(5))
        .build()?;
    // Each run takes a moment, so the healthy ones are running when the poison strikes.
    let second = Duration::from_secs(1);
    sim.publish("poison", Script::always(Step::Crash).taking(second))?;
    sim.publish("flaky", Script::fail_times(2).taking(2 * second))?;
    for i in 1..=3 {
        sim.publish(format!("healthy-{i}"), Script::succeed().taking(2 * second))?;
    }
    let report = sim.run_until_quiet();

    print_timeline(&mut out, &report, ["poison", "flaky", "healthy-1"]);
    writeln!(out)?;
    write!(out, "{}", report.summary())?;
    writeln!(out)?;
    if let Some(parked) = sim.broker().messages(sim.plan().parking_queue())?.first() {
        let record = ParkedRecord::decode(&parked.headers);
        writeln!(
            out,
            "in {}: {} (reason {}, crashes {}, failed attempts {}, from queue {})",
            sim.plan().parking_queue(),
            parked.label,
            record.reason.map_or("?", |r| r.as_str()),
            record.crashes,
            record.attempts,
            record.origin_queue.unwrap_or("?"),
        )?;
    }
    let t = report.totals();
    writeln!(
        out,
        "published {} = handled {} + parked {}; {} deliveries, {} handler runs, {} of virtual time",
        t.published,
        t.handled,
        t.parked,
        t.deliveries,
        t.runs,
        format_delay(report.elapsed())
    )?;
    if trace {
        writeln!(out, "\nbroker trace:\n{}", report.trace)?;
    }
    Ok(out)
}

/// One column per message, one row per instant something happened to either.
fn print_timeline<const N: usize>(out: &mut String, report: &Report, ids: [&str; N]) {
    const WIDTH: usize = 42;
    let mut rows: BTreeMap<Timestamp, [Vec<String>; N]> = BTreeMap::new();
    for (column, id) in ids.iter().enumerate() {
        let Some(m) = report.message(id) else {
            continue;
        };
        for (at, text) in story(m) {
            rows.entry(at)
                .or_insert_with(|| std::array::from_fn(|_| Vec::new()))[column]
                .push(text);
        }
    }
    let mut header = format!("{:<14}", "time");
    for id in ids {
        header.push_str(&format!("{id:<WIDTH$}"));
    }
    let _ = writeln!(out, "\n{}", header.trim_end());
    for (at, columns) in rows {
        let lines = columns.iter().map(Vec::len).max().unwrap_or(0);
        for line in 0..lines {
            let time = if line == 0 {
                elapsed(at.saturating_duration_since(report.started_at))
            } else {
                String::new()
            };
            let mut row = format!("{time:<14}");
            for column in &columns {
                let text = column.get(line).map_or("", String::as_str);
                row.push_str(&format!("{text:<WIDTH$}"));
            }
            let _ = writeln!(out, "{}", row.trim_end());
        }
    }
}

/// What happened to a message, in order: its runs and how each delivery ended.
fn story(m: &MessageReport) -> Vec<(Timestamp, String)> {
    let mut runs = 0;
    m.events()
        .map(|e| {
            let text = match e {
                MessageEvent::Run(run) => {
                    runs += 1;
                    let what = match &run.step {
                        Step::Crash => "CRASH, consumer dies".to_owned(),
                        _ if !run.ended => "cut short, its consumer died".to_owned(),
                        other => other.to_string(),
                    };
                    let alone = if run.solo { " alone" } else { "" };
                    format!("run {runs}{alone} on #{}: {what}", run.consumer)
                }
                MessageEvent::Ended(_, t) => match *t {
                    Terminal::Handled { attempt } => format!("handled on attempt {attempt}"),
                    Terminal::Retried { delay, .. } => {
                        format!("-> retry in {}", format_delay(delay))
                    }
                    Terminal::Isolated => "redelivered: suspect, isolated".to_owned(),
                    Terminal::Diverted { crashes, delay } => {
                        format!("crash {crashes}, waits {}", format_delay(delay))
                    }
                    Terminal::DeadLettered { reason } => format!("PARKED ({reason})"),
                    Terminal::Dropped { reason } => format!("dropped ({reason})"),
                    Terminal::Requeued { cause } => format!("requeued ({cause:?})"),
                },
            };
            (e.at(), text)
        })
        .collect()
}

fn elapsed(d: Duration) -> String {
    let s = d.as_secs();
    format!("+{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

#[cfg(test)]
mod tests {
    /// The text block that follows `intro` in a Markdown file.
    fn block_after<'a>(readme: &'a str, intro: &str) -> &'a str {
        let after = &readme[readme.find(intro).expect("the introduction") + intro.len()..];
        let start = after.find("```text\n").expect("a text block") + "```text\n".len();
        let len = after[start..].find("```").expect("the block's end");
        &after[start..start + len]
    }

    /// The example prints what the guide's concepts chapter and this crate's README say it
    /// prints.
    #[test]
    fn prints_what_the_readmes_show() {
        let out = super::run(false).unwrap();
        let guide = include_str!("../docs/concepts.md");
        let here = include_str!("../transport-memory/README.md");
        assert_eq!(out, block_after(guide, "The crash-loop example prints"));
        assert_eq!(out, block_after(here, "## Crash loop"));
    }
}
