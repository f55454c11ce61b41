//! lapin errors as `TransportError`s.

use lapin::types::ShortString;
use retry_core::TransportError;

/// The AMQP reply code of a broker error, if it is one.
pub(crate) fn amqp_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
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
