//! Errors of broker operations, with RabbitMQ's reply codes in their text.

/// Why the broker refused an operation. The texts follow RabbitMQ's channel errors.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The exchange does not exist (`404 NOT_FOUND`).
    #[error("NOT_FOUND - no exchange '{0}'")]
    ExchangeNotFound(String),
    /// The queue does not exist (`404 NOT_FOUND`).
    #[error("NOT_FOUND - no queue '{0}'")]
    QueueNotFound(String),
    /// The object exists with another setting (`406 PRECONDITION_FAILED`).
    #[error(
        "PRECONDITION_FAILED - inequivalent arg '{argument}' for {object}: received {wanted} but current is {existing}"
    )]
    Inequivalent {
        /// The exchange or queue, as `queue 'name'` or `exchange 'name'`.
        object: String,
        /// The argument that differs.
        argument: String,
        /// What the broker has.
        existing: String,
        /// What was asked for.
        wanted: String,
    },
    /// An argument has an unusable value (`406 PRECONDITION_FAILED`).
    #[error("PRECONDITION_FAILED - invalid arg '{argument}': {reason}")]
    InvalidArgument {
        /// The argument.
        argument: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The name or operation is reserved (`403 ACCESS_REFUSED`), such as names starting with
    /// `amq.` or binding to the default exchange.
    #[error("ACCESS_REFUSED - {0}")]
    AccessRefused(String),
    /// The connection is closed.
    #[error("connection closed: {0}")]
    ConnectionClosed(String),
}
