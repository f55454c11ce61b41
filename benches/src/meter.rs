//! The clocks of one measurement: wall time, CPU time of this process and of the server,
//! the first message in hand, and the growth of resident memory.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bench_support::proc::{Clock, RssGrowth, Timing};

/// Started just before consuming starts (after connecting), stopped at the last
/// settlement; [`Meter::first`] marks the first message in hand. Shared between a
/// consumer's handler and its `on_terminal` behind an `Arc`: every method takes `&self`.
///
/// ```
/// let meter = benches::Meter::start("no-such-server");
/// meter.first();
/// let measured = meter.stop();
/// assert!(measured.steady() <= measured.timing.wall);
/// ```
#[derive(Debug)]
pub struct Meter {
    clock: Clock,
    rss: RssGrowth,
    start: Instant,
    first: OnceLock<Instant>,
}

/// What a [`Meter`] measured.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// Wall and CPU time from start to the last settlement.
    pub timing: Timing,
    /// From start to the first message in hand (the whole span if none was marked).
    pub to_first: Duration,
    /// Peak resident memory above that at the start, bytes; `None` if unknown.
    pub rss_growth: Option<u64>,
}

impl Measured {
    /// From the first message in hand to the last settlement: the rate at which messages
    /// flow once they do.
    pub fn steady(&self) -> Duration {
        self.timing.wall.saturating_sub(self.to_first)
    }
}

impl Meter {
    /// Starts the clocks; `server` is the server's command name in `/proc` (see
    /// [`crate::Subject::SERVER`]). The memory first: resetting the peak is a write to
    /// `/proc`, kept off the clocks.
    pub fn start(server: &str) -> Self {
        let rss = RssGrowth::start();
        let clock = Clock::of(server);
        Meter {
            clock,
            rss,
            start: Instant::now(),
            first: OnceLock::new(),
        }
    }

    /// Marks the first message in hand; later calls change nothing.
    pub fn first(&self) {
        self.first.get_or_init(Instant::now);
    }

    /// Stops the clocks.
    pub fn stop(&self) -> Measured {
        let timing = self.clock.clone().stop();
        let to_first = self
            .first
            .get()
            .map_or(timing.wall, |first| *first - self.start);
        Measured {
            timing,
            to_first,
            rss_growth: self.rss.peak(),
        }
    }
}
