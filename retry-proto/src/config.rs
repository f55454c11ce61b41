//! Policies from configuration files (the `serde` feature).
//!
//! ```toml
//! max_attempts = 5
//! jitter = "equal"                 # none | full | equal | decorrelated
//! max_elapsed = "1h"
//! immediate_retries = 2
//! immediate_wait = "100ms"
//! crash_limit = 3
//! on_crash = "divert"              # divert | run-handler
//! crash_delay = "30s"
//! on_exhausted = "dead-letter"     # dead-letter | drop
//! publish_retries = 3
//! publish_retry_wait = "100ms"     # doubled before each next retry
//!
//! [backoff]
//! kind = "exponential"             # fixed | linear | exponential | list
//! initial = "1s"
//! multiplier = 3.0
//! max = "10s"
//! ```
//!
//! Every key but `backoff` is optional and defaults as [`RetryPolicy`] documents. Durations
//! are human strings ("30s", "10m", "1h 30m", "250ms"). Unknown keys are refused, and the
//! policy is validated as [`RetryPolicyBuilder::build`] does.

use std::time::Duration;

use serde::Deserialize;

use crate::backoff::Backoff;
use crate::jitter::Jitter;
use crate::policy::{CrashAction, Exhausted, PolicyError, RetryPolicy, RetryPolicyBuilder};

/// The `backoff` table.
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) enum BackoffConfig {
    Fixed {
        #[serde(with = "humantime_serde")]
        delay: Duration,
    },
    Linear {
        #[serde(with = "humantime_serde")]
        initial: Duration,
        #[serde(with = "humantime_serde")]
        step: Duration,
        #[serde(with = "humantime_serde")]
        max: Duration,
    },
    Exponential {
        #[serde(with = "humantime_serde")]
        initial: Duration,
        multiplier: f64,
        #[serde(with = "humantime_serde")]
        max: Duration,
    },
    List {
        delays: Vec<humantime_serde::Serde<Duration>>,
    },
}

/// The whole policy as written in a file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PolicyConfig {
    backoff: BackoffConfig,
    max_attempts: Option<u32>,
    #[serde(default)]
    jitter: Jitter,
    #[serde(default, with = "humantime_serde")]
    max_elapsed: Option<Duration>,
    #[serde(default)]
    immediate_retries: u32,
    #[serde(default, with = "humantime_serde")]
    immediate_wait: Option<Duration>,
    crash_limit: Option<u32>,
    #[serde(default)]
    on_crash: CrashAction,
    #[serde(default, with = "humantime_serde")]
    crash_delay: Option<Duration>,
    #[serde(default)]
    on_exhausted: Exhausted,
    publish_retries: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    publish_retry_wait: Option<Duration>,
}

impl TryFrom<PolicyConfig> for RetryPolicy {
    type Error = PolicyError;

    fn try_from(c: PolicyConfig) -> Result<Self, PolicyError> {
        let backoff = match c.backoff {
            BackoffConfig::Fixed { delay } => Backoff::Fixed(delay),
            BackoffConfig::Linear { initial, step, max } => Backoff::Linear { initial, step, max },
            BackoffConfig::Exponential {
                initial,
                multiplier,
                max,
            } => Backoff::Exponential {
                initial,
                multiplier,
                max,
            },
            BackoffConfig::List { delays } => {
                Backoff::List(delays.into_iter().map(|d| *d).collect())
            }
        };
        let mut b: RetryPolicyBuilder = RetryPolicy::builder()
            .with_backoff(backoff)
            .with_jitter(c.jitter)
            .with_immediate_retries(c.immediate_retries, c.immediate_wait.unwrap_or_default())
            .with_on_crash(c.on_crash)
            .with_on_exhausted(c.on_exhausted);
        if let Some(n) = c.max_attempts {
            b = b.with_max_attempts(n);
        }
        if let Some(d) = c.max_elapsed {
            b = b.with_max_elapsed(d);
        }
        if let Some(n) = c.crash_limit {
            b = b.with_crash_limit(n);
        }
        if let Some(d) = c.crash_delay {
            b = b.with_crash_delay(d);
        }
        if c.publish_retries.is_some() || c.publish_retry_wait.is_some() {
            let defaults = RetryPolicy::default();
            b = b.with_publish_retries(
                c.publish_retries.unwrap_or(defaults.publish_retries()),
                c.publish_retry_wait
                    .unwrap_or(defaults.publish_retry_wait(1)),
            );
        }
        b.build()
    }
}
