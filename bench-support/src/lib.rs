//! What the workspace's measurements share (the `benches` crate, the measuring examples
//! that stay with their crates, `retryctl`'s console benchmark), so that each one's file
//! holds only what it measures:
//!
//! * [`args`]: command-line arguments (`--flag value` pairs, positional numbers) and
//!   numbers from the environment, with the example's usage in every error;
//! * [`url`]: the broker's URLs from `AMQP_URL` and `AMQP10_URL`;
//! * [`publish`]: confirm channels, prefilling a queue with N messages, and publishing at a
//!   steady rate;
//! * [`queue`]: how many messages a queue holds, and the plain lapin walk of one;
//! * [`proc`]: readings from `/proc`: CPU time of this process and of a local server, the
//!   load average, peak resident memory and its growth over a measurement;
//! * [`stats`]: min, median, max and percentiles of a run's figures;
//! * `plot` (feature `plot`): SVG pictures of them, rates against a setting.
//!
//! The URLs, confirm channels and queue counts are the tests' own, re-exported from the
//! `test-brokers` crate. It is not published.

pub mod args;
#[cfg(feature = "plot")]
pub mod plot;
pub mod proc;
pub mod publish;
pub mod queue;
pub mod stats;
pub mod url;

/// The error type of the benchmarks: anything, sendable between threads.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
