//! What a lateness measurement shares between ours and a server's floor: the setting of one
//! measurement ([`Trial`]), the clock of first failures and second runs ([`Clock`]), and what
//! it measured ([`Lateness`]).
//!
//! A message's lateness is how late its second run starts after it was due:
//! `second run - first failure - its delay`, in milliseconds, from the monotonic clock of
//! this process. A second run that starts before it was due counts as negative lateness
//! (early).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bench_support::stats::percentiles;
use retry_core::{RetryPolicy, TopologyPlan};

use crate::BoxError;

/// One lateness measurement: `n` messages of `body` published at `rate` per second into
/// the work queue of `plan` (declared, empty) while a consumer with `prefetch` runs; every
/// message fails its first run and is retried once through the plan's one delay level.
#[derive(Clone, Debug)]
pub struct Trial<'a> {
    /// The plan, declared and empty; its first delay level is the delay.
    pub plan: &'a TopologyPlan,
    /// The policy the plan was made from (for ours, with `Jitter::Equal` when `jitter`).
    pub policy: &'a RetryPolicy,
    /// Messages published, message ids `0` to `n - 1`.
    pub n: u64,
    /// Messages published per second.
    pub rate: f64,
    /// Deliveries in hand at once.
    pub prefetch: u16,
    /// Every message's body.
    pub body: &'a [u8],
    /// Whether each message's delay is drawn from `[delay / 2, delay]`: ours by the
    /// policy's `Jitter::Equal`, a floor by [`floor_delay`].
    pub jitter: bool,
}

impl Trial<'_> {
    /// The work queue.
    pub fn queue(&self) -> &str {
        self.plan.work_queue()
    }

    /// The delay of the policy's first level, before any jitter.
    pub fn delay(&self) -> Result<Duration, BoxError> {
        self.policy
            .delay_levels()
            .first()
            .copied()
            .ok_or_else(|| "the policy has no delay level".into())
    }

    /// The message ids, in publishing order.
    pub fn ids(&self) -> Vec<u64> {
        (0..self.n).collect()
    }
}

/// The delay a floor gives message `id`: `delay`, or (`jitter`) uniform in
/// `[delay / 2, delay]` by an FNV-1a hash of the id, whole milliseconds, so that a floor
/// spreads its delays as ours does with `Jitter::Equal` (not the same draw per message: the
/// engine seeds its own).
///
/// ```
/// use std::time::Duration;
/// use benches::lateness::floor_delay;
///
/// let second = Duration::from_secs(1);
/// assert_eq!(floor_delay("7", second, false), second);
/// let jittered = floor_delay("7", second, true);
/// assert!(jittered >= second / 2 && jittered <= second);
/// ```
pub fn floor_delay(id: &str, delay: Duration, jitter: bool) -> Duration {
    if !jitter {
        return delay;
    }
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let half = u64::try_from(delay.as_millis() / 2).unwrap_or(u64::MAX);
    Duration::from_millis(half + hash % half.saturating_add(1))
}

/// First-failure times by message id, and the lateness of each second run. A consumer's
/// handler notes a first run with [`Clock::failed`] and a second with
/// [`Clock::returned`]; [`Clock::finish`] gives what was measured.
///
/// ```
/// use std::time::Duration;
/// use benches::lateness::Clock;
///
/// let mut clock = Clock::default();
/// clock.failed(Some("1"));
/// clock.returned(Some("1"), Duration::ZERO);
/// clock.returned(None, Duration::ZERO);
/// let lateness = clock.finish();
/// assert_eq!(lateness.len(), 1);
/// assert!(lateness.check(1, "ours").is_err()); // a second run without an id
/// ```
#[derive(Debug, Default)]
pub struct Clock {
    first: HashMap<String, Instant>,
    lateness: Lateness,
}

impl Clock {
    /// The first run of `id` has failed: now is its first failure. A message without an
    /// id cannot be timed, and is counted as a stray when it comes back.
    pub fn failed(&mut self, id: Option<&str>) {
        if let Some(id) = id {
            self.first.insert(id.to_owned(), Instant::now());
        }
    }

    /// The second run of `id` starts now, due `delay` after its first failure. One
    /// without an id, or without a first failure noted, is counted as a stray.
    pub fn returned(&mut self, id: Option<&str>, delay: Duration) {
        match id.and_then(|id| self.first.remove(id)) {
            Some(first) => {
                let late = first.elapsed().as_secs_f64() - delay.as_secs_f64();
                self.lateness.ms.push(late * 1e3);
            }
            None => self.lateness.strays += 1,
        }
    }

    /// What was measured.
    pub fn finish(self) -> Lateness {
        self.lateness
    }
}

/// The lateness of each second run timed, milliseconds (negative: early), and how many
/// second runs could not be timed.
#[derive(Clone, Debug, Default)]
pub struct Lateness {
    ms: Vec<f64>,
    strays: u64,
}

impl Lateness {
    /// Each second run's lateness, milliseconds, in the order they came.
    pub fn ms(&self) -> &[f64] {
        &self.ms
    }

    /// How many second runs were timed.
    pub fn len(&self) -> usize {
        self.ms.len()
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.ms.is_empty()
    }

    /// p50, p99 and max, milliseconds; `None` if nothing was timed.
    pub fn percentiles(&self) -> Option<(f64, f64, f64)> {
        (!self.ms.is_empty()).then(|| percentiles(self.ms.clone()))
    }

    /// How many second runs were early, and by how much at most (ms, positive).
    pub fn early(&self) -> (usize, f64) {
        let early = self.ms.iter().filter(|l| **l < 0.0);
        (early.clone().count(), -early.copied().fold(0.0, f64::min))
    }

    /// `other`'s second runs added to these (for the summary over all rounds).
    pub fn extend(&mut self, other: Lateness) {
        self.ms.extend(other.ms);
        self.strays += other.strays;
    }

    /// An error naming `what` unless exactly `n` second runs were timed and none was a
    /// stray.
    pub fn check(&self, n: u64, what: &str) -> Result<(), BoxError> {
        if self.ms.len() as u64 == n && self.strays == 0 {
            return Ok(());
        }
        Err(format!(
            "{what}: {} second run(s) timed of {n}, {} without an id or a first failure",
            self.ms.len(),
            self.strays
        )
        .into())
    }
}
