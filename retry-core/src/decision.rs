//! The pure decision function: given a policy, what is known about a delivery and what its
//! handler did, what happens next.

use std::fmt;
use std::time::Duration;

use crate::facts::DeliveryFacts;
use crate::headers::truncate_error;
use crate::policy::{CrashAction, Exhausted, Retry, RetryPolicy};
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

/// Why a message was parked (or dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DeadLetterReason {
    /// Every attempt failed: `attempts-exhausted`.
    AttemptsExhausted,
    /// The cap on time since the first failure was reached: `max-elapsed`.
    MaxElapsed,
    /// The handler reported a permanent failure: `permanent`.
    Permanent,
    /// The message was redelivered more often than the crash limit allows: `crash-loop`.
    CrashLoop,
}

impl DeadLetterReason {
    /// The header spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::AttemptsExhausted => "attempts-exhausted",
            DeadLetterReason::MaxElapsed => "max-elapsed",
            DeadLetterReason::Permanent => "permanent",
            DeadLetterReason::CrashLoop => "crash-loop",
        }
    }

    /// Parses the header spelling.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "attempts-exhausted" => DeadLetterReason::AttemptsExhausted,
            "max-elapsed" => DeadLetterReason::MaxElapsed,
            "permanent" => DeadLetterReason::Permanent,
            "crash-loop" => DeadLetterReason::CrashLoop,
            _ => return None,
        })
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The state of a message between runs: which run it is on and what it has been through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttemptState {
    /// The run number (1-based) that is about to happen or just happened.
    pub attempt: u32,
    /// Crashes so far, this delivery's included.
    pub crashes: u32,
    /// First failure or crash, if any.
    pub first_failure: Option<Timestamp>,
    /// The message's jitter seed.
    pub identity: u64,
}

/// What to do with a delivery before any handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Run the handler.
    Run(AttemptState),
    /// Do not run it: the decision is already made (a crash diversion or a crash loop).
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
    /// A crash: republish a clone through `delay` without having run the handler.
    Divert {
        /// The delay the clone goes through.
        delay: Duration,
    },
    /// Publish a clone to the parking queue, then acknowledge the original.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
    },
    /// Acknowledge without keeping anything (only when the policy says so).
    Drop {
        /// Why.
        reason: DeadLetterReason,
    },
}

impl Decision {
    /// Whether carrying out this decision publishes a clone (and so must wait for its confirm
    /// before settling the original).
    pub fn publishes(self) -> bool {
        matches!(
            self,
            Decision::Retry { .. } | Decision::Divert { .. } | Decision::DeadLetter { .. }
        )
    }
}

/// Decides whether a delivery's handler runs. A delivery with crash evidence (the
/// redelivered flag or a broker delivery count) counts crashes; past the policy's crash limit
/// it is parked with reason `crash-loop`, otherwise it is diverted or run as the policy says.
///
/// ```
/// use retry_core::{admit, Admission, BrokerSignals, Decision, DeliveryFacts, Headers, RetryPolicy};
///
/// let policy = RetryPolicy::default();
/// let fresh = DeliveryFacts::default();
/// assert!(matches!(admit(&policy, &fresh), Admission::Run(s) if s.attempt == 1));
///
/// let crashed = DeliveryFacts { redelivered: true, ..DeliveryFacts::default() };
/// assert!(matches!(admit(&policy, &crashed), Admission::Decided(_, Decision::Divert { .. })));
/// ```
pub fn admit(policy: &RetryPolicy, facts: &DeliveryFacts) -> Admission {
    let evidence = facts.crash_evidence();
    let state = AttemptState {
        attempt: facts.attempts.saturating_add(1),
        crashes: facts.crashes.saturating_add(evidence),
        first_failure: facts.first_failure,
        identity: facts.identity,
    };
    if evidence == 0 {
        return Admission::Run(state);
    }
    if state.crashes > policy.crash_limit() {
        return Admission::Decided(
            state,
            Decision::DeadLetter {
                reason: DeadLetterReason::CrashLoop,
            },
        );
    }
    match policy.on_crash() {
        CrashAction::Divert => Admission::Decided(
            state,
            Decision::Divert {
                delay: policy.crash_delay(),
            },
        ),
        CrashAction::RunHandler => Admission::Run(state),
    }
}

/// Decides what follows a handler run. `state.attempt` is the run that just ended.
///
/// ```
/// use retry_core::{decide, AttemptState, Decision, Outcome, RetryPolicy, Timestamp};
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
/// # Ok::<(), retry_core::PolicyError>(())
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
pub(crate) const CRASH_CAUSE: &str = "crashed: redelivered before it was settled";

/// The cause text of a failure, cut for the last-error header.
pub(crate) fn recorded_cause(outcome: &Outcome) -> Option<String> {
    outcome.cause().map(truncate_error)
}
