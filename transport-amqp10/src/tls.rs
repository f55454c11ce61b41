//! TLS for `amqps://`: the rustls client configuration built from a [`TlsConfig`], and the
//! typed refusal ([`TransportError::Tls`]) a failed handshake becomes.
//!
//! Errors name files and checks, never what a file holds: a key's bytes, or a line of it,
//! must not reach an error, a `Debug` output or a log line.

use std::error::Error as StdError;
use std::sync::Arc;

use retry_core::{TlsConfig, TlsFailure, TransportError};
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};

use crate::config::{Endpoint, TlsSetup};

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

/// The client configuration and the server name of a connection to `endpoint`: the files
/// of the settings are read now.
pub(crate) fn client_for(
    setup: Option<&TlsSetup>,
    endpoint: &Endpoint,
) -> Result<(Arc<ClientConfig>, ServerName<'static>), TlsFailure> {
    let (client, name) = match setup {
        Some(TlsSetup::Client(client)) => (Arc::clone(client), None),
        Some(TlsSetup::Settings(settings)) => (Arc::new(build(settings)?), settings.server_name()),
        None => (Arc::new(build(&TlsConfig::new())?), None),
    };
    let name = name.unwrap_or(endpoint.host.as_str());
    let server_name =
        ServerName::try_from(name.to_owned()).map_err(|e| TlsFailure::Configuration {
            file: "the server name".into(),
            reason: format!("{name:?} is not a DNS name or an IP address: {e}"),
        })?;
    Ok((client, server_name))
}

/// The name the server's certificate is checked against.
pub(crate) fn checked_name<'a>(setup: Option<&'a TlsSetup>, endpoint: &'a Endpoint) -> &'a str {
    match setup {
        Some(TlsSetup::Settings(settings)) => {
            settings.server_name().unwrap_or(endpoint.host.as_str())
        }
        _ => endpoint.host.as_str(),
    }
}

/// Whether the handshake presents a client certificate (one given whole in a rustls
/// configuration may, too: it is counted as one).
pub(crate) fn presents_certificate(setup: Option<&TlsSetup>) -> bool {
    match setup {
        Some(TlsSetup::Settings(settings)) => settings.client_identity().is_some(),
        Some(TlsSetup::Client(client)) => client.client_auth_cert_resolver.has_certs(),
        None => false,
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

/// The rustls configuration of `settings`; without CA files, the bundled public roots.
fn build(settings: &TlsConfig) -> Result<ClientConfig, TlsFailure> {
    retry_core::tls::client_config(settings, || {
        Ok(RootCertStore::from_iter(
            webpki_roots::TLS_SERVER_ROOTS.iter().cloned(),
        ))
    })
}

/// The TLS failure somewhere in the causes of `e`, if there is one: rustls' own error, as
/// tokio-rustls hands it over inside an `io::Error`. `name` is the name the server's
/// certificate was checked against.
pub(crate) fn failure_in(e: &(dyn StdError + 'static), name: &str) -> Option<TlsFailure> {
    retry_core::tls::rustls_error_in(e).map(|tls| retry_core::tls::failure(tls, name))
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

    #[test]
    fn a_failure_is_found_below_other_errors() {
        #[derive(Debug, thiserror::Error)]
        #[error("opening failed")]
        struct Wrapper(#[source] std::io::Error);
        let e = Wrapper(io(rustls::Error::AlertReceived(
            AlertDescription::CertificateExpired,
        )));
        assert_eq!(
            failure_in(&e, "h"),
            Some(TlsFailure::RefusedByServer {
                alert: "CertificateExpired".into()
            })
        );
        assert_eq!(
            failure_in(&std::io::Error::other("plain"), "h"),
            None,
            "not every error is a TLS one"
        );
    }
}
