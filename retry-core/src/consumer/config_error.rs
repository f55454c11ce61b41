//! `ConsumerConfigError`: why a consumer could not be built, for the builder and the
//! settings it checks (storm control's among them).

use std::time::Duration;

use crate::PlanMismatch;
use crate::TopologyError;

/// A duration for people to read; `Duration::MAX` (no limit) reads as "forever".
fn human(d: &Duration) -> String {
    if *d == Duration::MAX {
        return "forever".to_owned();
    }
    humantime::format_duration(*d).to_string()
}

/// Why a consumer could not be built. Each variant names the setting at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerConfigError {
    /// `prefetch` was 0, which would never receive anything.
    #[error("prefetch must be at least 1, got 0")]
    ZeroPrefetch,
    /// `handler_timeout` was zero, which would cancel every handler run.
    #[error("handler_timeout must be above zero")]
    ZeroHandlerTimeout,
    /// `solo_limit` allowed no suspect per solo phase, so suspects would never run.
    #[error("solo_limit must allow at least 1 suspect per solo phase, got 0")]
    ZeroSoloRuns,
    /// `suspect_poll` was zero, which would look at the isolation queue in a hot loop.
    #[error("suspect_poll must be above zero")]
    ZeroSuspectPoll,
    /// The longest a delivery can be held unsettled reaches the broker's
    /// `consumer_timeout`: see
    /// [`ConsumerBuilder::with_consumer_timeout`](crate::ConsumerBuilder::with_consumer_timeout).
    #[error(
        "worst-case time a delivery is held reaches consumer_timeout ({}): 3 × in-process time ({}: handler_timeout {} × {runs} runs (immediate_retries {immediate_retries} + 1) + immediate_wait {} × {immediate_retries} + publish retry waits {}) + solo_time {} = {}; lower handler_timeout, immediate_retries, immediate_wait, publish_retries or the solo_limit time, or raise consumer_timeout",
        human(.consumer_timeout),
        human(.in_process),
        human(.handler_timeout),
        human(.immediate_wait),
        human(.publish_retry_waits),
        human(.solo_time),
        human(.worst_case)
    )]
    ExceedsConsumerTimeout {
        /// The handler timeout.
        handler_timeout: Duration,
        /// Handler runs a delivery can get in-process: the immediate retries plus one.
        runs: u32,
        /// The policy's immediate retries.
        immediate_retries: u32,
        /// The policy's wait before each immediate retry.
        immediate_wait: Duration,
        /// The sum of the policy's publish-retry waits.
        publish_retry_waits: Duration,
        /// `handler_timeout × runs + immediate_wait × immediate_retries + publish_retry_waits`:
        /// the longest one delivery is worked on.
        in_process: Duration,
        /// The time limit of one solo phase.
        solo_time: Duration,
        /// `3 × in_process + solo_time`: the longest a prefetched delivery can be held.
        worst_case: Duration,
        /// The broker's consumer timeout.
        consumer_timeout: Duration,
    },
    /// A storm-control setting is out of range.
    #[error("storm_control: {setting} must be {expected}, got {value}")]
    InvalidStormControl {
        /// The setting.
        setting: &'static str,
        /// What it must be.
        expected: &'static str,
        /// What it was.
        value: String,
    },
    /// While storm control holds the work lane back, a delivery already pushed by the
    /// broker could wait until the broker's `consumer_timeout`: see
    /// [`ConsumerBuilder::with_storm_control`](crate::ConsumerBuilder::with_storm_control).
    #[error(
        "storm control could hold a delivery until consumer_timeout ({}): (max_cool_down {} + in-process time {}) × prefetch {prefetch} + {} = {}; lower max_cool_down, prefetch or handler_timeout, or raise consumer_timeout",
        human(.consumer_timeout),
        human(.max_cool_down),
        human(.in_process),
        human(.in_process),
        human(.worst_case)
    )]
    StormExceedsConsumerTimeout {
        /// The prefetch: deliveries that can wait unstarted.
        prefetch: u16,
        /// The longest cool-down.
        max_cool_down: Duration,
        /// The longest one delivery is worked on.
        in_process: Duration,
        /// `(max_cool_down + in_process) × prefetch + in_process`.
        worst_case: Duration,
        /// The broker's consumer timeout.
        consumer_timeout: Duration,
    },
    /// The topology plan could not be made for the queue.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The engine refused the plan (a topology customisation dropped a delay level).
    #[error(transparent)]
    Plan(#[from] PlanMismatch),
}
