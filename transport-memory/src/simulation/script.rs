//! Scripts: what a simulated handler does on each run of a message.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retry_core::format_delay;

/// What one handler run does.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// Succeeds.
    Succeed,
    /// Fails transiently with this cause: retried by the policy.
    Fail(Arc<str>),
    /// Fails permanently with this cause: parked at once.
    Permanent(Arc<str>),
    /// Fails and asks to be retried after this delay (clamped by the policy).
    RetryAfter(Duration, Arc<str>),
    /// Panics with this message; the driver counts it as a transient failure.
    Panic(Arc<str>),
    /// Kills the consumer process: its connection dies holding every unacknowledged
    /// delivery, which the broker returns flagged redelivered. A new consumer process starts
    /// after the simulation's restart delay.
    Crash,
    /// Never finishes; the driver's handler timeout cancels it.
    Hang,
}

impl Step {
    /// A transient failure.
    pub fn fail(cause: impl Into<Arc<str>>) -> Self {
        Step::Fail(cause.into())
    }

    /// A permanent failure.
    pub fn permanent(cause: impl Into<Arc<str>>) -> Self {
        Step::Permanent(cause.into())
    }

    /// A failure asking for a retry after `delay`.
    pub fn retry_after(delay: Duration, cause: impl Into<Arc<str>>) -> Self {
        Step::RetryAfter(delay, cause.into())
    }

    /// A panic.
    pub fn panic(message: impl Into<Arc<str>>) -> Self {
        Step::Panic(message.into())
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Succeed => f.write_str("succeeded"),
            Step::Fail(c) => write!(f, "failed: {c}"),
            Step::Permanent(c) => write!(f, "failed permanently: {c}"),
            Step::RetryAfter(d, c) => write!(f, "failed, retry after {}: {c}", format_delay(*d)),
            Step::Panic(m) => write!(f, "panicked: {m}"),
            Step::Crash => f.write_str("crashed its consumer"),
            Step::Hang => f.write_str("hung"),
        }
    }
}

/// What a simulated handler does on each run of one message: the listed steps in order, the
/// last one repeating. Runs are counted per message across consumers, crashes included.
///
/// ```
/// use transport_memory::{Script, Step};
/// use std::time::Duration;
///
/// let flaky = Script::fail_times(3);                        // fail 3 times, then succeed
/// assert_eq!(flaky.step(2), &Step::fail("transient failure"));
/// assert_eq!(flaky.step(3), &Step::Succeed);
///
/// let crash_on_2 = Script::steps([Step::fail("db down"), Step::Crash, Step::Succeed]);
/// let poison = Script::always(Step::Crash);
/// let broken = Script::always(Step::permanent("schema mismatch"));
/// let slow = Script::succeed().taking(Duration::from_secs(2));
/// # let _ = (crash_on_2, poison, broken, slow);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Script {
    steps: Vec<Step>,
    takes: Duration,
}

impl Default for Script {
    fn default() -> Self {
        Script::succeed()
    }
}

impl Script {
    /// Succeeds every time.
    pub fn succeed() -> Self {
        Script::always(Step::Succeed)
    }

    /// Does `step` every time.
    pub fn always(step: Step) -> Self {
        Script {
            steps: vec![step],
            takes: Duration::ZERO,
        }
    }

    /// Fails transiently `n` times, then succeeds.
    pub fn fail_times(n: usize) -> Self {
        let mut steps = vec![Step::fail("transient failure"); n];
        steps.push(Step::Succeed);
        Script {
            steps,
            takes: Duration::ZERO,
        }
    }

    /// These steps in order; the last repeats. An empty list succeeds every time.
    pub fn steps(steps: impl IntoIterator<Item = Step>) -> Self {
        let mut steps: Vec<Step> = steps.into_iter().collect();
        if steps.is_empty() {
            steps.push(Step::Succeed);
        }
        Script {
            steps,
            takes: Duration::ZERO,
        }
    }

    /// Each run takes `d` of virtual time before it ends as its step says.
    pub fn taking(mut self, d: Duration) -> Self {
        self.takes = d;
        self
    }

    /// The step of run number `run` (0-based).
    pub fn step(&self, run: usize) -> &Step {
        // `steps` is never empty: every constructor puts one in.
        let last = self.steps.len().saturating_sub(1);
        &self.steps[run.min(last)]
    }

    /// How long each run takes.
    pub fn takes(&self) -> Duration {
        self.takes
    }

    /// How many steps it lists: the runs a message following it makes when it goes as
    /// written (the last step repeats, and a crash or a timeout adds runs).
    pub(crate) fn listed(&self) -> usize {
        self.steps.len()
    }
}
