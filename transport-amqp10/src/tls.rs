//! TLS for `amqps://`: the typed refusal ([`TransportError::Tls`]) a failed handshake
//! becomes. The client configuration built from a [`TlsConfig`](retry_core::TlsConfig), and
//! the name the server's certificate is checked against, are the shared connection
//! settings' ([`TlsClient`](transport_kit::settings::TlsClient)).
//!
//! Errors name files and checks, never what a file holds: a key's bytes, or a line of it,
//! must not reach an error, a `Debug` output or a log line.

use std::error::Error as StdError;

use retry_core::{TlsFailure, TransportError};
use transport_kit::settings::failure_in;

use crate::config::Endpoint;

/// The `host:port` a TLS refusal names: never the user or password of the URL.
pub(crate) fn endpoint_name(endpoint: &Endpoint) -> String {
    retry_core::tls::endpoint(&endpoint.host, endpoint.port)
}

/// A TLS refusal for `endpoint`.
pub(crate) fn refused(endpoint: &Endpoint, failure: TlsFailure) -> TransportError {
    TransportError::Tls {
        endpoint: endpoint_name(endpoint),
        failure,
    }
}

/// Whether `e` is the connection closed or reset by the peer.
pub(crate) fn closed(e: &(dyn StdError + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                BrokenPipe | ConnectionAborted | ConnectionReset | UnexpectedEof
            );
        }
        next = e.source();
    }
    false
}

/// A server that closed the connection after a TLS 1.3 handshake in which the client
/// presented a certificate, before answering anything: how a refused client certificate
/// shows there. Under TLS 1.3 the client's handshake ends before the server has checked
/// the certificate, so the client has already sent its first AMQP bytes when the server
/// sends its alert and closes; RabbitMQ closing a socket with those bytes unread resets the
/// connection, and the alert can be lost with it (seen against RabbitMQ 3.10: a reset, no
/// alert).
pub(crate) fn closed_after_handshake() -> TlsFailure {
    TlsFailure::RefusedByServer {
        alert: "none received: the server closed the connection right after the handshake, before answering, as it does when it refuses the client certificate".into(),
    }
}

/// The failure of a handshake that failed with `e`: every handshake error is a TLS refusal,
/// the ones rustls names by the check that failed, the others (the server hung up) as
/// [`TlsFailure::Other`].
pub(crate) fn handshake_failure(e: &std::io::Error, name: &str) -> TlsFailure {
    match failure_in(e, name) {
        Some(failure) => failure,
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            TlsFailure::Other("the server closed the connection during the handshake".into())
        }
        None => TlsFailure::Other(format!("the handshake failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::AlertDescription;
    use rustls::CertificateError;
    use rustls::pki_types::UnixTime;

    fn io(e: rustls::Error) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }

    #[test]
    fn rustls_errors_become_the_check_that_failed() {
        let cert = |c| io(rustls::Error::InvalidCertificate(c));
        let cases = [
            (
                cert(CertificateError::UnknownIssuer),
                TlsFailure::UnknownIssuer,
            ),
            (
                cert(CertificateError::NotValidForName),
                TlsFailure::WrongHostName {
                    name: "127.0.0.1".into(),
                },
            ),
            (
                cert(CertificateError::ExpiredContext {
                    time: UnixTime::since_unix_epoch(std::time::Duration::from_secs(2)),
                    not_after: UnixTime::since_unix_epoch(std::time::Duration::from_secs(1)),
                }),
                TlsFailure::Expired,
            ),
            (cert(CertificateError::NotValidYet), TlsFailure::Expired),
            (
                io(rustls::Error::InvalidMessage(
                    rustls::InvalidMessage::InvalidContentType,
                )),
                TlsFailure::NotTls,
            ),
            (
                io(rustls::Error::AlertReceived(AlertDescription::UnknownCA)),
                TlsFailure::RefusedByServer {
                    alert: "UnknownCA".into(),
                },
            ),
        ];
        for (e, want) in cases {
            assert_eq!(handshake_failure(&e, "127.0.0.1"), want);
        }
        let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        assert!(matches!(
            handshake_failure(&eof, "h"),
            TlsFailure::Other(why) if why.contains("closed")
        ));
    }
}
