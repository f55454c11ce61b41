//! The pure decision function: given a policy, what is known about a delivery and what its
//! handler did, what happens next.

use std::time::Duration;

use crate::facts::DeliveryFacts;
use crate::headers::{DeadLetterReason, MAX_ERROR_LEN, truncate_error};
use crate::policy::{Exhausted, Retry, RetryPolicy};
use crate::time::Timestamp;

/// What a handler run came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Handled: acknowledge.
    Success,
    /// Failed, and may succeed later: retry by the policy.
    Transient(String),
    /// Failed, and will fail again: park at once.
    Permanent(String),
    /// Failed; retry after this delay (for instance an HTTP 429's `Retry-After`), clamped to
    /// the policy's delay bounds.
    RetryAfter(Duration, String),
}

impl Outcome {
    /// The failure's cause, if it is a failure.
    pub fn cause(&self) -> Option<&str> {
        match self {
            Outcome::Success => None,
            Outcome::Transient(c) | Outcome::Permanent(c) | Outcome::RetryAfter(_, c) => Some(c),
        }
    }
}

/// Where a delivery was taken from: the two intakes of a consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Lane {
    /// The work queue, by subscription, with up to `prefetch` handlers running at once.
    #[default]
    Work,
    /// The isolation queue, fetched one message at a time and run with nothing else
    /// running.
    Isolation,
}

/// The state of a message between runs: which run it is on and what it has been through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptState {
    /// The run number (1-based) that is about to happen or just happened.
    pub attempt: u32,
    /// Crashes so far, this delivery's included.
    pub crashes: u32,
    /// First failure, if any.
    pub first_failure: Option<Timestamp>,
    /// The message's jitter seed.
    pub identity: u64,
}

/// What to do with a delivery before any handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Run the handler.
    Run(AttemptState),
    /// Do not run it: the decision is already made (a suspect to isolate, a crashed suspect
    /// to divert, or a crash loop to park).
    Decided(AttemptState, Decision),
}

/// What happens to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Acknowledge: it was handled.
    Ack,
    /// Run the handler again in-process after `wait`.
    RetryInProcess {
        /// Wait before the next run.
        wait: Duration,
    },
    /// Republish a clone through `delay`, then acknowledge the original.
    Retry {
        /// The delay the clone goes through.
        delay: Duration,
    },
    /// A suspect: it came back redelivered from the work queue, so a consumer went away
    /// holding it, but with other deliveries beside it. Republish a clone, unchanged, into
    /// the isolation queue without running the handler, then acknowledge the original. No
    /// crash is counted.
    Isolate,
    /// A crash: a suspect that ran alone came back redelivered. Republish a clone, with the
    /// crash counted, through `delay` back into the isolation queue (straight there when
    /// `delay` is zero), without running the handler.
    Divert {
        /// The crash delay the clone goes through.
        delay: Duration,
    },
    /// Publish a clone to the parking queue, then acknowledge the original.
    DeadLetter {
        /// Why it was parked.
        reason: DeadLetterReason,
    },
    /// Acknowledge without keeping anything (only when the policy says so).
    Drop {
        /// Why it was dropped.
        reason: DeadLetterReason,
    },
}

impl Decision {
    /// Whether carrying out this decision publishes a clone (and so must wait for its confirm
    /// before settling the original).
    pub fn publishes(self) -> bool {
        matches!(
            self,
            Decision::Retry { .. }
                | Decision::Isolate
                | Decision::Divert { .. }
                | Decision::DeadLetter { .. }
        )
    }
}

/// Decides whether a delivery's handler runs, from the lane it came from and its crash
/// evidence (the redelivered flag or a broker delivery count).
///
/// * From the work queue, a delivery with evidence is a *suspect*: it is isolated, and no
///   crash is counted. Whatever else its consumer held came back the same way, so the flag
///   cannot say which delivery killed it.
/// * From the isolation queue, a delivery with evidence ran alone when its consumer died:
///   that counts a crash. Past the policy's crash limit it is parked with reason
///   `crash-loop`; otherwise it is diverted through the crash delay.
/// * Anything else runs.
///
/// ```
/// use retry_proto::{admit, Admission, Decision, DeliveryFacts, Lane, RetryPolicy};
///
/// let policy = RetryPolicy::default();
/// let fresh = DeliveryFacts::default();
/// assert!(matches!(admit(&policy, Lane::Work, &fresh), Admission::Run(s) if s.attempt == 1));
///
/// let redelivered = DeliveryFacts { redelivered: true, ..DeliveryFacts::default() };
/// assert!(matches!(admit(&policy, Lane::Work, &redelivered), Admission::Decided(s, Decision::Isolate) if s.crashes == 0));
/// assert!(matches!(
///     admit(&policy, Lane::Isolation, &redelivered),
///     Admission::Decided(s, Decision::Divert { .. }) if s.crashes == 1
/// ));
/// ```
pub fn admit(policy: &RetryPolicy, lane: Lane, facts: &DeliveryFacts) -> Admission {
    let mut state = AttemptState {
        attempt: facts.attempts.saturating_add(1),
        crashes: facts.crashes,
        first_failure: facts.first_failure,
        identity: facts.identity,
    };
    if facts.crash_evidence() == 0 {
        return Admission::Run(state);
    }
    if lane == Lane::Work {
        return Admission::Decided(state, Decision::Isolate);
    }
    // One crash per redelivery from the isolation queue: each crash is followed by a new
    // clone, so a larger broker count only means the message was also returned without a
    // crash (a requeue, or a consumer that died after taking it but before running it).
    state.crashes = state.crashes.saturating_add(1);
    if state.crashes > policy.crash_limit() {
        return Admission::Decided(
            state,
            Decision::DeadLetter {
                reason: DeadLetterReason::CrashLoop,
            },
        );
    }
    let delay = policy.crash_delay_level().unwrap_or(Duration::ZERO);
    Admission::Decided(state, Decision::Divert { delay })
}

/// Decides what follows a handler run. `state.attempt` is the run that just ended.
///
/// ```
/// use retry_proto::{decide, AttemptState, Decision, Outcome, RetryPolicy, Timestamp};
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let state = AttemptState { attempt: 1, crashes: 0, first_failure: None, identity: 0 };
/// let now = Timestamp::from_millis(0);
/// assert_eq!(decide(&policy, &state, &Outcome::Success, now), Decision::Ack);
/// assert_eq!(
///     decide(&policy, &state, &Outcome::Transient("db down".into()), now),
///     Decision::Retry { delay: Duration::from_secs(30) },
/// );
/// # Ok::<(), retry_proto::PolicyError>(())
/// ```
pub fn decide(
    policy: &RetryPolicy,
    state: &AttemptState,
    outcome: &Outcome,
    now: Timestamp,
) -> Decision {
    let requested = match outcome {
        Outcome::Success => return Decision::Ack,
        Outcome::Permanent(_) => {
            return Decision::DeadLetter {
                reason: DeadLetterReason::Permanent,
            };
        }
        Outcome::Transient(_) => None,
        Outcome::RetryAfter(d, _) => Some(*d),
    };
    let Some(retry) = policy.retry_after_attempt(state.attempt, state.identity) else {
        return exhausted(policy, DeadLetterReason::AttemptsExhausted);
    };
    let decision = match (requested, retry) {
        (None, Retry::Immediate { wait }) => Decision::RetryInProcess { wait },
        (None, Retry::Delayed { delay, .. }) => Decision::Retry { delay },
        (Some(asked), _) => match policy.clamp_delay(asked) {
            Some(delay) => Decision::Retry { delay },
            None => Decision::RetryInProcess {
                wait: policy.immediate_wait(),
            },
        },
    };
    let wait = match decision {
        Decision::RetryInProcess { wait } | Decision::Retry { delay: wait } => wait,
        _ => Duration::ZERO,
    };
    if let Some(cap) = policy.max_elapsed() {
        let elapsed = now.saturating_duration_since(state.first_failure.unwrap_or(now));
        if elapsed.saturating_add(wait) > cap {
            return exhausted(policy, DeadLetterReason::MaxElapsed);
        }
    }
    decision
}

fn exhausted(policy: &RetryPolicy, reason: DeadLetterReason) -> Decision {
    match policy.on_exhausted() {
        Exhausted::DeadLetter => Decision::DeadLetter { reason },
        Exhausted::Drop => Decision::Drop { reason },
    }
}

/// The cause text recorded for a crash.
pub(crate) const CRASH_CAUSE: &str =
    "crashed: its consumer went away while it ran alone, before it was settled";

/// The cause text of a failure, cut for the last-error header. The outcome is spent: a
/// cause short enough is kept as it is, not copied.
pub(crate) fn recorded_cause(outcome: Outcome) -> Option<String> {
    match outcome {
        Outcome::Success => None,
        Outcome::Transient(c) | Outcome::Permanent(c) | Outcome::RetryAfter(_, c) => {
            Some(if c.len() <= MAX_ERROR_LEN {
                c
            } else {
                truncate_error(&c)
            })
        }
    }
}
