//! Wall-clock instants as plain data.
//!
//! The engine never reads a clock: every entry point takes `now` as a [`Timestamp`]. A
//! transport converts the real clock with [`Timestamp::from_system_time`]; a simulation passes
//! virtual time. Millisecond resolution matches what brokers store (TTLs and `x-death` times).

use std::fmt;
use std::ops::Add;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
///
/// ```
/// use retry_proto::Timestamp;
/// use std::time::Duration;
///
/// let t = Timestamp::from_millis(1_000);
/// assert_eq!((t + Duration::from_millis(500)).as_millis(), 1_500);
/// assert_eq!((t + Duration::from_secs(2)).saturating_duration_since(t), Duration::from_secs(2));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// A timestamp `ms` milliseconds after the Unix epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Converts a `SystemTime`; times before the epoch become the epoch.
    pub fn from_system_time(t: SystemTime) -> Self {
        let ms = t
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Timestamp(ms)
    }

    /// This instant plus `d`, saturating at the far future.
    pub fn saturating_add(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(duration_millis(d)))
    }

    /// Time elapsed from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, rhs: Duration) -> Timestamp {
        self.saturating_add(rhs)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Whole milliseconds of `d`, saturating at `u64::MAX`.
pub(crate) fn duration_millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A compact human form of a duration, used in queue names: `1500ms`, `30s`, `10m`, `1h30m`,
/// `2d`. Deterministic and free of characters that need quoting in a queue name.
///
/// ```
/// use retry_proto::format_delay;
/// use std::time::Duration;
///
/// assert_eq!(format_delay(Duration::from_secs(30)), "30s");
/// assert_eq!(format_delay(Duration::from_secs(90)), "1m30s");
/// assert_eq!(format_delay(Duration::from_millis(1500)), "1s500ms");
/// assert_eq!(format_delay(Duration::ZERO), "0ms");
/// ```
pub fn format_delay(d: Duration) -> String {
    let mut ms = duration_millis(d);
    if ms == 0 {
        return "0ms".to_owned();
    }
    let mut out = String::new();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ] {
        let n = ms / size;
        if n > 0 {
            out.push_str(&n.to_string());
            out.push_str(unit);
            ms %= size;
        }
    }
    out
}
