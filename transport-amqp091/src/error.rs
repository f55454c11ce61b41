//! lapin errors as `TransportError`s.

use lapin::protocol::AMQPErrorKind;
use lapin::types::ShortString;
use retry_core::TransportError;

/// The AMQP reply code of a broker error, if it is one.
pub(crate) fn amqp_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

/// Whether `err` is the broker closing one channel, not the connection: a channel is closed
/// with a soft error (`NOT_FOUND`, `PRECONDITION_FAILED`, ...), a connection with a hard one.
pub(crate) fn closes_only_a_channel(err: &lapin::Error) -> bool {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => matches!(e.kind(), AMQPErrorKind::Soft(_)),
        _ => false,
    }
}

/// A lapin error as a connection error, kept as its source. lapin's messages carry no
/// credentials.
pub(crate) fn connection_error(err: lapin::Error) -> TransportError {
    TransportError::connection_failed("the AMQP 0-9-1 channel or connection failed", err)
}

/// A name as an AMQP short string, refusing (not panicking on) names over 255 bytes.
pub(crate) fn short(name: &str) -> Result<ShortString, TransportError> {
    ShortString::try_new(name).map_err(|_| {
        TransportError::Other(
            format!(
                "name {:?}… is {} bytes, longer than AMQP allows (255)",
                &name[..name.floor_char_boundary(32)],
                name.len()
            )
            .into(),
        )
    })
}

/// A lapin error on a request about `queue`: NOT_FOUND names the queue.
pub(crate) fn queue_error(queue: &str, e: lapin::Error) -> TransportError {
    match amqp_code(&e) {
        Some(404) => TransportError::MissingAddress {
            address: format!("queue {queue:?}"),
            hint: "provision the topology first (Transport::provision)".into(),
        },
        _ => connection_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::closes_only_a_channel;
    use lapin::ErrorKind;
    use lapin::protocol::{AMQPError, AMQPHardError, AMQPSoftError};

    #[test]
    fn soft_errors_close_a_channel_and_hard_ones_the_connection() {
        let soft = AMQPError::new(
            AMQPSoftError::NOTFOUND.into(),
            "NOT_FOUND - no queue".into(),
        );
        let hard = AMQPError::new(
            AMQPHardError::CONNECTIONFORCED.into(),
            "CONNECTION_FORCED - closed".into(),
        );
        assert!(closes_only_a_channel(
            &ErrorKind::ProtocolError(soft).into()
        ));
        assert!(!closes_only_a_channel(
            &ErrorKind::ProtocolError(hard).into()
        ));
        assert!(!closes_only_a_channel(
            &ErrorKind::MissingHeartbeatError.into()
        ));
    }
}
