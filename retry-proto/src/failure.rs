//! What a handler reports when it fails: [`HandlerError`] and its [`FailureKind`].

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::Outcome;

type Cause = Box<dyn StdError + Send + Sync + 'static>;

/// How a failure should be treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// May succeed later: retry by the policy.
    Transient,
    /// Will fail again: park at once.
    Permanent,
    /// Retry after this delay, clamped to the policy's bounds.
    RetryAfter(Duration),
}

/// A handler's failure: its kind and its cause.
///
/// ```
/// use retry_proto::{FailureKind, HandlerError, Outcome};
/// use std::time::Duration;
///
/// let e = HandlerError::retry_after(Duration::from_secs(30), "429 Too Many Requests");
/// assert_eq!(e.to_string(), "429 Too Many Requests");
/// assert_eq!(e.kind(), FailureKind::RetryAfter(Duration::from_secs(30)));
///
/// let e = HandlerError::permanent(std::io::Error::other("schema mismatch"));
/// assert_eq!(e.to_outcome(), Outcome::Permanent("schema mismatch".into()));
/// ```
#[derive(Debug)]
pub struct HandlerError {
    kind: FailureKind,
    cause: Cause,
}

impl HandlerError {
    /// A failure that may succeed later.
    pub fn transient(cause: impl Into<Cause>) -> Self {
        HandlerError {
            kind: FailureKind::Transient,
            cause: cause.into(),
        }
    }

    /// A failure that will not succeed: the message is parked at once.
    pub fn permanent(cause: impl Into<Cause>) -> Self {
        HandlerError {
            kind: FailureKind::Permanent,
            cause: cause.into(),
        }
    }

    /// Retry after `delay`, clamped to the policy's delay bounds.
    pub fn retry_after(delay: Duration, cause: impl Into<Cause>) -> Self {
        HandlerError {
            kind: FailureKind::RetryAfter(delay),
            cause: cause.into(),
        }
    }

    /// How the failure is treated.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }

    /// The cause.
    pub fn cause(&self) -> &(dyn StdError + Send + Sync + 'static) {
        &*self.cause
    }

    /// The engine input for this failure.
    pub fn to_outcome(&self) -> Outcome {
        let text = self.cause.to_string();
        match self.kind {
            FailureKind::Transient => Outcome::Transient(text),
            FailureKind::Permanent => Outcome::Permanent(text),
            FailureKind::RetryAfter(d) => Outcome::RetryAfter(d, text),
        }
    }
}

/// A handler's result as the engine's input, for a driver of your own: `Ok` is
/// [`Outcome::Success`], an error is [`HandlerError::to_outcome`].
///
/// ```
/// use retry_proto::{HandlerError, Outcome};
///
/// assert_eq!(Outcome::from(Ok(())), Outcome::Success);
/// let failed: Result<(), _> = Err(HandlerError::transient("db timeout"));
/// assert_eq!(Outcome::from(failed), Outcome::Transient("db timeout".into()));
/// ```
impl From<Result<(), HandlerError>> for Outcome {
    fn from(result: Result<(), HandlerError>) -> Self {
        match result {
            Ok(()) => Outcome::Success,
            Err(e) => e.to_outcome(),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.cause, f)
    }
}

/// Transparent over its cause: `Display` is the cause's and `source` is the cause's
/// source, so an error chain names the cause once.
impl StdError for HandlerError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause.source()
    }
}
