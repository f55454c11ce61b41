//! `RetryPolicy`: how many attempts, which delays, and what happens at the limits.

use std::time::Duration;

use crate::backoff::Backoff;
use crate::jitter::Jitter;
use crate::time::duration_millis;

/// The longest delay a broker TTL can hold: `x-message-ttl` is an unsigned 32-bit count of
/// milliseconds (about 49.7 days).
pub const MAX_TTL: Duration = Duration::from_millis(u32::MAX as u64);

/// The most distinct delays a policy may ask for. Each is a TTL queue of the plan, declared
/// on the broker for every work queue, so a backoff whose small step would declare thousands
/// of queues is refused with [`PolicyError::TooManyDelayLevels`]. (The crash delay's queue
/// comes on top.)
pub const MAX_DELAY_LEVELS: usize = 64;

/// How many previous delays [`Jitter::Decorrelated`] replays to compute a delay: the chain
/// forgets its start within a few steps, and a retry far down a long schedule stays cheap.
const DECORRELATED_WINDOW: u32 = 32;

/// What a suspect that crashed its consumer does next.
///
/// Only a suspect that ran alone and came back redelivered from the isolation queue counts a
/// crash (see the guide, `docs/concepts.md`, "Suspects and crashes: crash attribution").
/// Either way the crash is counted on the message, and past the crash limit it is parked
/// with reason `crash-loop`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum CrashAction {
    /// Wait the crash delay (a TTL queue that expires back into the isolation queue) before
    /// the next solo run, so a message that kills its consumer cannot do so in a tight loop
    /// (the default).
    #[default]
    Divert,
    /// Go straight back into the isolation queue and run alone again as soon as a consumer
    /// takes it.
    RunHandler,
}

/// What happens to a message whose attempts or elapsed time are used up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Exhausted {
    /// Park it in the dead-letter queue with diagnostic headers (the default).
    #[default]
    DeadLetter,
    /// Acknowledge it and keep nothing. Permanent failures and crash loops are still parked.
    Drop,
}

/// One retry in a message's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Run the handler again in-process after `wait`, keeping the delivery.
    Immediate {
        /// How long to wait before the next run.
        wait: Duration,
    },
    /// Republish through the broker to come back after `delay`.
    Delayed {
        /// The jittered delay.
        delay: Duration,
        /// 0-based index among the delayed retries.
        index: u32,
    },
}

/// A validated retry policy. Build one with [`RetryPolicy::builder`] or the shortcuts
/// [`RetryPolicy::delays`] and [`RetryPolicy::exponential`].
///
/// Attempts count handler runs: `max_attempts(5)` runs the handler at most five times. The
/// first [`immediate_retries`](RetryPolicyBuilder::with_immediate_retries) retries run
/// in-process; the rest go through the broker with the backoff's delays.
///
/// Defaults:
///
/// | setting | default |
/// |---|---|
/// | `max_attempts` | 5 (with a delay list: 1 + immediate retries + the list's length); `u32::MAX` retries practically forever |
/// | `backoff` | exponential, 1 s × 2, at most 5 min |
/// | `jitter` | none |
/// | `max_elapsed` | none |
/// | `immediate_retries` | 0, no wait between them |
/// | `crash_limit` | 3 crashes; the 4th parks the message with reason `crash-loop` |
/// | `on_crash` | [`CrashAction::Divert`] |
/// | `crash_delay` | the first delayed retry's base delay, or 1 s if there is none |
/// | `on_exhausted` | [`Exhausted::DeadLetter`] |
/// | `publish_retries` | 3, waiting 100 ms, 200 ms, 400 ms: a clone the broker refused is published again that often before its original is requeued |
///
/// The two classic configurations, one expression each:
///
/// ```
/// use retry_proto::RetryPolicy;
/// use std::time::Duration;
///
/// // Delay levels 30s, 10m, 1h, then dead-letter.
/// let levels = RetryPolicy::delays([30, 600, 3600].map(Duration::from_secs)).build()?;
/// assert_eq!(levels.max_attempts(), 4);
///
/// // Spring AMQP: maxAttempts=5, initial=1s, multiplier=3, max=10s.
/// let spring = RetryPolicy::exponential(Duration::from_secs(1), 3.0, Duration::from_secs(10))
///     .with_max_attempts(5)
///     .build()?;
/// let delays: Vec<u64> = spring.base_delays().map(|d| d.as_secs()).collect();
/// assert_eq!(delays, [1, 3, 9, 10]);
/// # Ok::<(), retry_proto::PolicyError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(try_from = "crate::config::PolicyConfig"))]
pub struct RetryPolicy {
    max_attempts: u32,
    backoff: Backoff,
    jitter: Jitter,
    max_elapsed: Option<Duration>,
    immediate_retries: u32,
    immediate_wait: Duration,
    crash_limit: u32,
    on_crash: CrashAction,
    crash_delay: Duration,
    on_exhausted: Exhausted,
    publish_retries: u32,
    publish_retry_wait: Duration,
    /// The distinct base delays, ascending, computed once by `build`.
    levels: Vec<Duration>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicyBuilder::default()
            .build()
            .expect("the default policy is valid")
    }
}

impl RetryPolicy {
    /// A builder with the documented defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder::default()
    }

    /// A builder whose delayed retries use these delays in order, then dead-letter.
    pub fn delays(delays: impl IntoIterator<Item = Duration>) -> RetryPolicyBuilder {
        Self::builder().with_backoff(Backoff::List(delays.into_iter().collect()))
    }

    /// A builder with exponential backoff: `initial × multiplier^n`, capped at `max`.
    pub fn exponential(initial: Duration, multiplier: f64, max: Duration) -> RetryPolicyBuilder {
        Self::builder().with_backoff(Backoff::Exponential {
            initial,
            multiplier,
            max,
        })
    }

    /// A builder with the same delay for every delayed retry.
    pub fn fixed(delay: Duration) -> RetryPolicyBuilder {
        Self::builder().with_backoff(Backoff::Fixed(delay))
    }

    /// The most handler runs a message gets.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff of the delayed retries.
    pub fn backoff(&self) -> &Backoff {
        &self.backoff
    }

    /// The jitter applied to delayed retries.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The cap on time since the first failure, if any.
    pub fn max_elapsed(&self) -> Option<Duration> {
        self.max_elapsed
    }

    /// How many retries run in-process before the delayed ones.
    pub fn immediate_retries(&self) -> u32 {
        self.immediate_retries.min(self.max_attempts - 1)
    }

    /// The wait before each immediate retry.
    pub fn immediate_wait(&self) -> Duration {
        self.immediate_wait
    }

    /// How many retries go through the broker.
    pub fn delayed_retries(&self) -> u32 {
        self.max_attempts - 1 - self.immediate_retries()
    }

    /// How many crashes a message survives; one more parks it with reason `crash-loop`.
    pub fn crash_limit(&self) -> u32 {
        self.crash_limit
    }

    /// What a redelivered delivery does.
    pub fn on_crash(&self) -> CrashAction {
        self.on_crash
    }

    /// The delay a crashed suspect waits before its next solo run, with
    /// [`CrashAction::Divert`].
    pub fn crash_delay(&self) -> Duration {
        self.crash_delay
    }

    /// What happens when attempts or elapsed time run out.
    pub fn on_exhausted(&self) -> Exhausted {
        self.on_exhausted
    }

    /// How many times a clone the broker did not confirm (refused, returned, failed or
    /// timed out) is published again before the original is requeued.
    pub fn publish_retries(&self) -> u32 {
        self.publish_retries
    }

    /// The wait before publish retry `n` (1-based): the first wait, doubled per retry.
    ///
    /// ```
    /// use retry_proto::RetryPolicy;
    /// use std::time::Duration;
    ///
    /// let p = RetryPolicy::default();
    /// let waits: Vec<_> = (1..=p.publish_retries()).map(|n| p.publish_retry_wait(n)).collect();
    /// assert_eq!(waits, [100, 200, 400].map(Duration::from_millis));
    /// ```
    pub fn publish_retry_wait(&self, n: u32) -> Duration {
        let doublings = n.saturating_sub(1).min(31);
        self.publish_retry_wait
            .checked_mul(1 << doublings)
            .unwrap_or(MAX_TTL)
            .min(MAX_TTL)
    }

    /// The longest a delivery can wait in-process for its clone's publish retries, confirm
    /// times aside: the sum of every retry's wait.
    pub fn publish_retry_budget(&self) -> Duration {
        (1..=self.publish_retries)
            .map(|n| self.publish_retry_wait(n))
            .fold(Duration::ZERO, Duration::saturating_add)
    }

    /// The base (unjittered) delays of the delayed retries, in order.
    pub fn base_delays(&self) -> impl Iterator<Item = Duration> + '_ {
        (0..self.delayed_retries()).map(|i| self.backoff.delay(i))
    }

    /// The smallest and largest delay a delayed retry can get, jitter included (full jitter
    /// can go down to zero). `None` when the policy has no delayed retries.
    pub fn delay_bounds(&self) -> Option<(Duration, Duration)> {
        let (min, max) = self.backoff.bounds(self.delayed_retries())?;
        let min = match self.jitter {
            Jitter::None | Jitter::Decorrelated => min,
            Jitter::Full => Duration::ZERO,
            Jitter::Equal => Duration::from_millis(duration_millis(min) / 2),
        };
        Some((min, max))
    }

    /// The distinct delays of the delayed retries, ascending: the delays a broker must be
    /// able to hold on the way back to the work queue. One TTL queue per entry is the
    /// per-delay topology. (The crash delay leads back to the isolation queue instead, and
    /// has a queue of its own: see [`TopologyPlan`](crate::TopologyPlan).)
    ///
    /// At most [`MAX_DELAY_LEVELS`], and computed without visiting each retry, so a policy
    /// that retries forever has as few levels as its backoff has distinct delays:
    ///
    /// ```
    /// use retry_proto::RetryPolicy;
    /// use std::time::Duration;
    ///
    /// let forever = RetryPolicy::exponential(Duration::from_secs(1), 2.0, Duration::from_secs(60))
    ///     .with_max_attempts(u32::MAX)
    ///     .build()?;
    /// assert_eq!(forever.delay_levels().len(), 7); // 1, 2, 4, 8, 16, 32, 60 s
    /// # Ok::<(), retry_proto::PolicyError>(())
    /// ```
    pub fn delay_levels(&self) -> &[Duration] {
        &self.levels
    }

    /// The delay a crashed suspect goes through, or `None` when it goes straight back to the
    /// isolation queue ([`CrashAction::RunHandler`], or a zero crash delay).
    pub fn crash_delay_level(&self) -> Option<Duration> {
        (self.on_crash == CrashAction::Divert && !self.crash_delay.is_zero())
            .then_some(self.crash_delay)
    }

    /// The longest delay a clone of this policy can ask a broker to hold: its longest delay
    /// level or its crash delay; `None` when it has neither.
    pub(crate) fn longest_broker_delay(&self) -> Option<Duration> {
        self.delay_levels()
            .iter()
            .copied()
            .chain(self.crash_delay_level())
            .max()
    }

    /// The retry that follows a failed run number `attempt` (1-based), for the message whose
    /// jitter seed is `seed`; `None` when `attempt` was the last one allowed.
    ///
    /// ```
    /// use retry_proto::{Retry, RetryPolicy};
    /// use std::time::Duration;
    ///
    /// let p = RetryPolicy::delays([Duration::from_secs(30)])
    ///     .with_immediate_retries(1, Duration::from_millis(100))
    ///     .build()?;
    /// assert_eq!(p.retry_after_attempt(1, 0), Some(Retry::Immediate { wait: Duration::from_millis(100) }));
    /// assert_eq!(p.retry_after_attempt(2, 0), Some(Retry::Delayed { delay: Duration::from_secs(30), index: 0 }));
    /// assert_eq!(p.retry_after_attempt(3, 0), None);
    /// # Ok::<(), retry_proto::PolicyError>(())
    /// ```
    pub fn retry_after_attempt(&self, attempt: u32, seed: u64) -> Option<Retry> {
        if attempt >= self.max_attempts {
            return None;
        }
        let attempt = attempt.max(1);
        if attempt <= self.immediate_retries() {
            return Some(Retry::Immediate {
                wait: self.immediate_wait,
            });
        }
        let index = attempt - 1 - self.immediate_retries();
        Some(Retry::Delayed {
            delay: self.delay(index, seed),
            index,
        })
    }

    /// The jittered delay of delayed retry `index` (0-based) for the message seeded `seed`.
    pub fn delay(&self, index: u32, seed: u64) -> Duration {
        let base = self.backoff.delay(index);
        if self.jitter != Jitter::Decorrelated {
            return self.jitter.apply(base, seed, index, None, base, base);
        }
        // Decorrelated jitter grows from the previous delay: replay the chain, from the start
        // or, far down a long schedule, from the base delay a window back.
        let (first, cap) = self
            .backoff
            .bounds(self.delayed_retries().max(index + 1))
            .unwrap_or((base, base));
        let start = index.saturating_sub(DECORRELATED_WINDOW);
        let mut previous = (start > 0).then(|| self.backoff.delay(start - 1));
        for i in start..=index {
            let d = self
                .jitter
                .apply(self.backoff.delay(i), seed, i, previous, first, cap);
            previous = Some(d);
        }
        previous.unwrap_or(base)
    }

    /// Every retry the policy allows for the message seeded `seed`, in order.
    ///
    /// ```
    /// use retry_proto::{Jitter, RetryPolicy};
    /// use std::time::Duration;
    ///
    /// let p = RetryPolicy::exponential(Duration::from_secs(1), 2.0, Duration::from_secs(60))
    ///     .with_jitter(Jitter::Full)
    ///     .build()?;
    /// let a: Vec<_> = p.schedule(7).collect();
    /// assert_eq!(a.len(), 4);
    /// assert_eq!(a, p.schedule(7).collect::<Vec<_>>()); // same seed, same schedule
    /// # Ok::<(), retry_proto::PolicyError>(())
    /// ```
    pub fn schedule(&self, seed: u64) -> impl Iterator<Item = Retry> + '_ {
        (1..self.max_attempts).filter_map(move |a| self.retry_after_attempt(a, seed))
    }

    /// `requested` clamped into [`delay_bounds`](Self::delay_bounds); used for a handler's
    /// retry-after. `None` when the policy has no delayed retries.
    pub fn clamp_delay(&self, requested: Duration) -> Option<Duration> {
        let (min, max) = self.delay_bounds()?;
        Some(requested.clamp(min, max))
    }
}

/// Why a policy was refused. Each variant names the offending field; see [`PolicyError::field`].
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// `max_attempts` was 0.
    #[error("max_attempts must be at least 1, got 0")]
    ZeroAttempts,
    /// The exponential multiplier was below 1, or not a finite number.
    #[error("backoff.multiplier must be a finite number of at least 1, got {multiplier}")]
    InvalidMultiplier {
        /// The value given.
        multiplier: f64,
    },
    /// The backoff's `max` is shorter than its `initial`.
    #[error("backoff.max ({max:?}) is shorter than backoff.initial ({initial:?})")]
    MaxBelowInitial {
        /// The first delay.
        initial: Duration,
        /// The cap.
        max: Duration,
    },
    /// An explicit delay list was empty.
    #[error("backoff.delays is empty: give at least one delay")]
    EmptyDelayList,
    /// A delay cannot be held by a broker TTL.
    #[error(
        "{field} is {delay:?}, longer than a broker TTL can hold (4294967295 ms, about 49.7 days)"
    )]
    DelayTooLong {
        /// The field, such as `backoff.delays[2]` or `crash_delay`.
        field: String,
        /// The value given.
        delay: Duration,
    },
    /// `max_elapsed` was zero.
    #[error("max_elapsed must be greater than zero")]
    ZeroMaxElapsed,
    /// The backoff asks for more distinct delays than a plan may declare queues for.
    #[error(
        "{field} gives {} distinct delays over {retries} delayed retries, more than the {max} delay queues a plan may declare: use fewer distinct delays (a larger step or multiplier, a lower max, or fewer attempts)",
        count_text(*count)
    )]
    TooManyDelayLevels {
        /// The backoff setting that spreads the delays: `backoff.step`, `backoff.multiplier`
        /// or `backoff.delays`.
        field: &'static str,
        /// How many distinct delays the policy asks for, counted up to 100,000.
        count: u64,
        /// The delayed retries the policy allows.
        retries: u32,
        /// The most a plan may declare: [`MAX_DELAY_LEVELS`].
        max: usize,
    },
    /// `publish_retry_wait` was zero while publish retries are on: a broker that refuses
    /// would be asked again in a hot loop.
    #[error("publish_retry_wait must be greater than zero when publish_retries is {retries}")]
    ZeroPublishRetryWait {
        /// The retries asked for.
        retries: u32,
    },
}

impl PolicyError {
    /// The configuration field at fault, as it is spelled in TOML or JSON.
    ///
    /// ```
    /// use retry_proto::RetryPolicy;
    ///
    /// let err = RetryPolicy::delays([]).build().unwrap_err();
    /// assert_eq!(err.field(), "backoff.delays");
    /// ```
    pub fn field(&self) -> &str {
        match self {
            PolicyError::ZeroAttempts => "max_attempts",
            PolicyError::InvalidMultiplier { .. } => "backoff.multiplier",
            PolicyError::MaxBelowInitial { .. } => "backoff.max",
            PolicyError::EmptyDelayList => "backoff.delays",
            PolicyError::DelayTooLong { field, .. } => field,
            PolicyError::ZeroMaxElapsed => "max_elapsed",
            PolicyError::ZeroPublishRetryWait { .. } => "publish_retry_wait",
            PolicyError::TooManyDelayLevels { field, .. } => field,
        }
    }
}

fn count_text(count: u64) -> String {
    if count >= crate::backoff::COUNT_CEILING {
        format!("at least {count}")
    } else {
        count.to_string()
    }
}

/// Builds a [`RetryPolicy`]; every setting has the default documented there.
///
/// ```
/// use retry_proto::{CrashAction, Exhausted, Jitter, RetryPolicy};
/// use std::time::Duration;
///
/// let policy = RetryPolicy::exponential(Duration::from_secs(1), 2.0, Duration::from_secs(300))
///     .with_max_attempts(8)
///     .with_jitter(Jitter::Equal)
///     .with_immediate_retries(2, Duration::from_millis(50))
///     .with_max_elapsed(Duration::from_secs(3600))
///     .with_crash_limit(2)
///     .with_on_crash(CrashAction::Divert)
///     .with_on_exhausted(Exhausted::DeadLetter)
///     .build()?;
/// assert_eq!(policy.delayed_retries(), 5);
/// # Ok::<(), retry_proto::PolicyError>(())
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct RetryPolicyBuilder {
    max_attempts: Option<u32>,
    backoff: Backoff,
    jitter: Jitter,
    max_elapsed: Option<Duration>,
    immediate_retries: u32,
    immediate_wait: Duration,
    crash_limit: u32,
    on_crash: CrashAction,
    crash_delay: Option<Duration>,
    on_exhausted: Exhausted,
    publish_retries: u32,
    publish_retry_wait: Duration,
}

impl Default for RetryPolicyBuilder {
    fn default() -> Self {
        RetryPolicyBuilder {
            max_attempts: None,
            backoff: Backoff::Exponential {
                initial: Duration::from_secs(1),
                multiplier: 2.0,
                max: Duration::from_secs(300),
            },
            jitter: Jitter::None,
            max_elapsed: None,
            immediate_retries: 0,
            immediate_wait: Duration::ZERO,
            crash_limit: 3,
            on_crash: CrashAction::Divert,
            crash_delay: None,
            on_exhausted: Exhausted::DeadLetter,
            publish_retries: 3,
            publish_retry_wait: Duration::from_millis(100),
        }
    }
}

impl RetryPolicyBuilder {
    /// The most handler runs a message gets, immediate retries included. `u32::MAX` retries
    /// practically forever, as cheaply as any other count (pair it with
    /// [`with_max_elapsed`](Self::with_max_elapsed) to bound the time instead).
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }

    /// The backoff of the delayed retries.
    pub fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The jitter of the delayed retries.
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Park (or drop) a message once this much time has passed since its first failure, or
    /// would have passed by the end of its next delay.
    pub fn with_max_elapsed(mut self, cap: Duration) -> Self {
        self.max_elapsed = Some(cap);
        self
    }

    /// Retry `n` times in-process, waiting `wait` before each, before any delayed retry.
    pub fn with_immediate_retries(mut self, n: u32, wait: Duration) -> Self {
        self.immediate_retries = n;
        self.immediate_wait = wait;
        self
    }

    /// How many crashes a message survives.
    pub fn with_crash_limit(mut self, n: u32) -> Self {
        self.crash_limit = n;
        self
    }

    /// What a suspect that crashed its consumer does next.
    pub fn with_on_crash(mut self, action: CrashAction) -> Self {
        self.on_crash = action;
        self
    }

    /// Publish a clone the broker did not confirm again up to `n` times, waiting `first_wait`
    /// before the first retry and twice as long before each next one, before requeueing the
    /// original. `n = 0` requeues at once.
    pub fn with_publish_retries(mut self, n: u32, first_wait: Duration) -> Self {
        self.publish_retries = n;
        self.publish_retry_wait = first_wait;
        self
    }

    /// The delay a crashed suspect waits before its next solo run.
    pub fn with_crash_delay(mut self, delay: Duration) -> Self {
        self.crash_delay = Some(delay);
        self
    }

    /// What happens when attempts or elapsed time run out.
    pub fn with_on_exhausted(mut self, exhausted: Exhausted) -> Self {
        self.on_exhausted = exhausted;
        self
    }

    /// Validates the settings.
    pub fn build(self) -> Result<RetryPolicy, PolicyError> {
        check_backoff(&self.backoff)?;
        let max_attempts = match (self.max_attempts, &self.backoff) {
            (Some(n), _) => n,
            (None, Backoff::List(list)) => {
                let n = u32::try_from(list.len()).unwrap_or(u32::MAX);
                n.saturating_add(self.immediate_retries).saturating_add(1)
            }
            (None, _) => 5,
        };
        if max_attempts == 0 {
            return Err(PolicyError::ZeroAttempts);
        }
        if self.max_elapsed == Some(Duration::ZERO) {
            return Err(PolicyError::ZeroMaxElapsed);
        }
        check_ttl("immediate_wait", self.immediate_wait)?;
        check_ttl("publish_retry_wait", self.publish_retry_wait)?;
        if self.publish_retries > 0 && self.publish_retry_wait.is_zero() {
            return Err(PolicyError::ZeroPublishRetryWait {
                retries: self.publish_retries,
            });
        }
        let mut policy = RetryPolicy {
            max_attempts,
            backoff: self.backoff,
            jitter: self.jitter,
            max_elapsed: self.max_elapsed,
            immediate_retries: self.immediate_retries,
            immediate_wait: self.immediate_wait,
            crash_limit: self.crash_limit,
            on_crash: self.on_crash,
            crash_delay: Duration::ZERO,
            on_exhausted: self.on_exhausted,
            publish_retries: self.publish_retries,
            publish_retry_wait: self.publish_retry_wait,
            levels: Vec::new(),
        };
        let retries = policy.delayed_retries();
        policy.levels = policy
            .backoff
            .distinct_delays(retries, MAX_DELAY_LEVELS)
            .map_err(|count| PolicyError::TooManyDelayLevels {
                field: match policy.backoff {
                    Backoff::List(_) => "backoff.delays",
                    Backoff::Exponential { .. } => "backoff.multiplier",
                    Backoff::Fixed(_) | Backoff::Linear { .. } => "backoff.step",
                },
                count,
                retries,
                max: MAX_DELAY_LEVELS,
            })?;
        policy.crash_delay = match self.crash_delay {
            Some(d) => {
                check_ttl("crash_delay", d)?;
                Duration::from_millis(duration_millis(d))
            }
            None => policy
                .base_delays()
                .next()
                .unwrap_or(Duration::from_secs(1)),
        };
        Ok(policy)
    }
}

fn check_ttl(field: &str, delay: Duration) -> Result<(), PolicyError> {
    if delay > MAX_TTL {
        return Err(PolicyError::DelayTooLong {
            field: field.to_owned(),
            delay,
        });
    }
    Ok(())
}

fn check_backoff(backoff: &Backoff) -> Result<(), PolicyError> {
    match backoff {
        Backoff::Fixed(d) => check_ttl("backoff.delay", *d),
        Backoff::Linear { initial, max, .. } => {
            check_ttl("backoff.initial", *initial)?;
            check_ttl("backoff.max", *max)?;
            if max < initial {
                return Err(PolicyError::MaxBelowInitial {
                    initial: *initial,
                    max: *max,
                });
            }
            Ok(())
        }
        Backoff::Exponential {
            initial,
            multiplier,
            max,
        } => {
            if !multiplier.is_finite() || *multiplier < 1.0 {
                return Err(PolicyError::InvalidMultiplier {
                    multiplier: *multiplier,
                });
            }
            check_ttl("backoff.initial", *initial)?;
            check_ttl("backoff.max", *max)?;
            if max < initial {
                return Err(PolicyError::MaxBelowInitial {
                    initial: *initial,
                    max: *max,
                });
            }
            Ok(())
        }
        Backoff::List(list) => {
            if list.is_empty() {
                return Err(PolicyError::EmptyDelayList);
            }
            for (i, d) in list.iter().enumerate() {
                check_ttl(&format!("backoff.delays[{i}]"), *d)?;
            }
            Ok(())
        }
    }
}
