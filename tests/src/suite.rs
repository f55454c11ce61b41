//! The list of scenarios, the runners that run them on a harness, and the report they print.

use std::any::Any;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::harness::Harness;
use crate::scenarios::{self, Verdict};

/// A scenario function, boxed so a list can hold scenarios of different futures.
pub type ScenarioFn<H> = for<'a> fn(&'a H) -> BoxFuture<'a, Verdict>;

/// A named scenario.
pub struct Scenario<H> {
    /// The scenario's name in the report.
    pub name: &'static str,
    /// Runs it.
    pub run: ScenarioFn<H>,
}

impl<H> Clone for Scenario<H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H> Copy for Scenario<H> {}

impl<H> std::fmt::Debug for Scenario<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

macro_rules! scenario_list {
    ($($name:ident),* $(,)?) => {
        vec![$(Scenario {
            name: stringify!($name),
            run: |h| Box::pin(scenarios::$name(h)),
        }),*]
    };
}

/// Every scenario, in report order.
pub fn all<H: Harness>() -> Vec<Scenario<H>> {
    scenario_list![
        success,
        transient_then_success,
        attempts_exhausted_parked,
        permanent_parked,
        retry_after,
        immediate_then_delayed,
        redelivered_isolated,
        crash_limit_parked,
        crash_limit_run_handler,
        poison_with_bystanders,
        refused_publish_not_lost,
        no_head_of_line_blocking,
        transport_declares_topology,
        seeded_storm,
    ]
}

/// How one scenario ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Passed, with what it observed.
    Passed(Vec<String>),
    /// Skipped, with why.
    Skipped(String),
    /// Failed, with the panic message.
    Failed(String),
}

impl From<Verdict> for Status {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Passed { notes } => Status::Passed(notes),
            Verdict::Skipped { reason } => Status::Skipped(reason),
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// The scenario.
    pub scenario: &'static str,
    /// How it ended.
    pub status: Status,
    /// Wall time it took.
    pub took: Duration,
}

/// What a suite run did on one transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuiteReport {
    /// The transport's name.
    pub transport: String,
    /// One row per scenario, in list order.
    pub rows: Vec<Row>,
    /// Wall time of the whole run.
    pub took: Duration,
}

impl SuiteReport {
    /// (run, passed, skipped, failed).
    pub fn counts(&self) -> (usize, usize, usize, usize) {
        let count = |f: fn(&Status) -> bool| self.rows.iter().filter(|r| f(&r.status)).count();
        let passed = count(|s| matches!(s, Status::Passed(_)));
        let skipped = count(|s| matches!(s, Status::Skipped(_)));
        let failed = count(|s| matches!(s, Status::Failed(_)));
        (passed + failed, passed, skipped, failed)
    }

    /// The report as a table.
    pub fn render(&self) -> String {
        let (run, passed, skipped, failed) = self.counts();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\n== conformance suite on {}: {run} run, {passed} passed, {skipped} skipped, {failed} failed, {:.1} s wall",
            self.transport,
            self.took.as_secs_f64()
        );
        for row in &self.rows {
            let (status, detail) = match &row.status {
                Status::Passed(notes) => ("passed", notes.join("; ")),
                Status::Skipped(reason) => ("SKIPPED", reason.clone()),
                Status::Failed(message) => ("FAILED", message.clone()),
            };
            let took = match row.status {
                Status::Skipped(_) => String::new(),
                _ => format!("{:.2}s", row.took.as_secs_f64()),
            };
            // A failure's message can span lines (assert_eq's left and right): indent them
            // under the row.
            let detail = detail.lines().collect::<Vec<_>>().join("\n        ");
            let _ = writeln!(
                out,
                "   {:<31} {:<8} {:>7}  {detail}",
                row.scenario, status, took
            );
        }
        out
    }

    /// Prints the table on standard error, past the test harness's output capture, so it
    /// shows in every `cargo test` run.
    pub fn print(&self) {
        print_uncaptured(&self.render());
    }

    /// The scenarios that skipped, in list order.
    pub fn skipped(&self) -> Vec<&'static str> {
        self.rows
            .iter()
            .filter(|r| matches!(r.status, Status::Skipped(_)))
            .map(|r| r.scenario)
            .collect()
    }

    /// Panics unless exactly the scenarios in `expected` skipped: the set a test writes
    /// down for its transport, so a transport that loses a capability (or a harness that
    /// gains one) shows up as a failure rather than as one more quiet skip.
    pub fn assert_skipped_exactly(&self, expected: &[&str]) {
        let skipped: BTreeSet<&str> = self.skipped().into_iter().collect();
        let expected: BTreeSet<&str> = expected.iter().copied().collect();
        let reasons: Vec<String> = self
            .rows
            .iter()
            .filter_map(|r| match &r.status {
                Status::Skipped(why) if !expected.contains(r.scenario) => {
                    Some(format!("{}: {why}", r.scenario))
                }
                _ => None,
            })
            .collect();
        assert_eq!(
            skipped, expected,
            "skipped scenarios on {} (left) differ from the ones its test expects (right); unexpected skips: {reasons:?}",
            self.transport
        );
    }

    /// Panics naming every failed scenario.
    pub fn assert_passed(&self) {
        let failed: Vec<String> = self
            .rows
            .iter()
            .filter_map(|r| match &r.status {
                Status::Failed(m) => Some(format!("{}: {m}", r.scenario)),
                _ => None,
            })
            .collect();
        assert!(
            failed.is_empty(),
            "{} scenario(s) failed on {}:\n{}",
            failed.len(),
            self.transport,
            failed.join("\n")
        );
    }
}

pub use transport_amqp091::testing::print_uncaptured;

/// The message of a caught panic.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panicked".to_owned()
    }
}

/// Runs the scenarios one after another with `run_one`, which returns the verdict or the
/// panic message.
pub fn run_sequentially<H>(
    transport: &str,
    scenarios: &[Scenario<H>],
    mut run_one: impl FnMut(&Scenario<H>) -> Result<Verdict, String>,
) -> SuiteReport {
    let started = Instant::now();
    let rows = scenarios
        .iter()
        .map(|s| {
            let t = Instant::now();
            let status = match run_one(s) {
                Ok(v) => v.into(),
                Err(m) => Status::Failed(m),
            };
            Row {
                scenario: s.name,
                status,
                took: t.elapsed(),
            }
        })
        .collect();
    SuiteReport {
        transport: transport.to_owned(),
        rows,
        took: started.elapsed(),
    }
}

/// Runs every scenario at once on the current tokio runtime, each on a harness of its own
/// from `make`, each within `limit`. A harness is cleaned up when its scenario ends, passed,
/// failed or timed out.
pub async fn run_concurrently<H, F, Fut>(
    transport: &str,
    scenarios: &[Scenario<H>],
    make: F,
    limit: Duration,
) -> SuiteReport
where
    H: Harness,
    F: Fn() -> Fut,
    Fut: Future<Output = H> + Send + 'static,
{
    let started = Instant::now();
    let tasks: Vec<_> = scenarios
        .iter()
        .map(|s| {
            let scenario = *s;
            let harness = make();
            tokio::spawn(async move {
                // A harness that cannot be built (no connection, a transport declaring
                // other capabilities than its test expects) fails its scenario by name.
                let h = match AssertUnwindSafe(harness).catch_unwind().await {
                    Ok(h) => h,
                    Err(payload) => {
                        let why = panic_message(payload.as_ref());
                        return (Status::Failed(format!("no harness: {why}")), Duration::ZERO);
                    }
                };
                let t = Instant::now();
                let run = AssertUnwindSafe((scenario.run)(&h)).catch_unwind();
                let status = match tokio::time::timeout(limit, run).await {
                    Ok(Ok(verdict)) => verdict.into(),
                    Ok(Err(payload)) => Status::Failed(panic_message(payload.as_ref())),
                    Err(_) => Status::Failed(format!("did not finish within {limit:?}")),
                };
                let took = t.elapsed();
                h.cleanup().await;
                (status, took)
            })
        })
        .collect();
    let mut rows = Vec::with_capacity(tasks.len());
    for (s, task) in scenarios.iter().zip(tasks) {
        let (status, took) = match task.await {
            Ok(done) => done,
            Err(e) => (
                Status::Failed(format!("the scenario's task failed: {e}")),
                Duration::ZERO,
            ),
        };
        rows.push(Row {
            scenario: s.name,
            status,
            took,
        });
    }
    SuiteReport {
        transport: transport.to_owned(),
        rows,
        took: started.elapsed(),
    }
}
