//! TLS for `amqps://`: the rustls client configuration built from a [`TlsConfig`], and the
//! typed refusal ([`TransportError::Tls`]) a failed handshake becomes.
//!
//! Errors name files and checks, never what a file holds: a key's bytes, or a line of it,
//! must not reach an error, a `Debug` output or a log line.

use std::error::Error as StdError;
use std::path::Path;
use std::sync::Arc;

use retry_core::{TlsConfig, TlsFailure, TransportError};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{CertificateError, ClientConfig, RootCertStore};

use crate::config::{Endpoint, TlsSetup};

/// The `host:port` a TLS refusal names: never the user or password of the URL.
pub(crate) fn endpoint_name(endpoint: &Endpoint) -> String {
    if endpoint.host.contains(':') {
        format!("[{}]:{}", endpoint.host, endpoint.port)
    } else {
        format!("{}:{}", endpoint.host, endpoint.port)
    }
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

/// The rustls configuration of `settings`, with rustls' `ring` provider chosen explicitly
/// so that no process-wide default provider is needed.
fn build(settings: &TlsConfig) -> Result<ClientConfig, TlsFailure> {
    let mut roots = RootCertStore::empty();
    if settings.ca_files().is_empty() {
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    }
    for file in settings.ca_files() {
        for cert in certificates(file)? {
            roots.add(cert).map_err(|e| TlsFailure::Configuration {
                file: file.display().to_string(),
                reason: format!("a certificate in it cannot be a trust anchor: {e}"),
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsFailure::Other(e.to_string()))?
        .with_root_certificates(roots);
    match settings.client_identity() {
        None => Ok(builder.with_no_client_auth()),
        Some((cert_file, key_file)) => {
            let chain = certificates(cert_file)?;
            let key = private_key(key_file)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| TlsFailure::Configuration {
                    file: key_file.display().to_string(),
                    // rustls words this from the key's type, never from its bytes.
                    reason: format!(
                        "cannot be used with the certificate of {}: {e}",
                        cert_file.display()
                    ),
                })
        }
    }
}

/// Every certificate of a PEM file; none is an error.
fn certificates(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFailure> {
    let unusable = |e: pem::Error| TlsFailure::Configuration {
        file: file.display().to_string(),
        reason: pem_reason(&e, "certificates"),
    };
    let certs = CertificateDer::pem_file_iter(file)
        .map_err(unusable)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(unusable)?;
    if certs.is_empty() {
        return Err(unusable(pem::Error::NoItemsFound));
    }
    Ok(certs)
}

/// The first private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(file: &Path) -> Result<PrivateKeyDer<'static>, TlsFailure> {
    PrivateKeyDer::from_pem_file(file).map_err(|e| TlsFailure::Configuration {
        file: file.display().to_string(),
        reason: pem_reason(&e, "private key (PKCS#8, PKCS#1 or SEC1)"),
    })
}

/// Why a PEM file could not be used, in words of our own: the parser's own errors quote
/// lines of the file, which for a key file would be key material.
fn pem_reason(e: &pem::Error, wanted: &str) -> String {
    match e {
        pem::Error::Io(io) => format!("cannot be read: {io}"),
        pem::Error::NoItemsFound => format!("holds no PEM {wanted}"),
        pem::Error::MissingSectionEnd { .. } => "a PEM section has no END line".into(),
        pem::Error::IllegalSectionStart { .. } => "a PEM BEGIN line is malformed".into(),
        pem::Error::Base64Decode(_) => "a PEM section is not valid base64".into(),
        pem::Error::SectionTooLarge => "a PEM section is too large".into(),
        _ => format!("is not valid PEM {wanted}"),
    }
}

/// The TLS failure somewhere in the causes of `e`, if there is one: rustls' own error, as
/// tokio-rustls hands it over inside an `io::Error`. `name` is the name the server's
/// certificate was checked against.
pub(crate) fn failure_in(e: &(dyn StdError + 'static), name: &str) -> Option<TlsFailure> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(classify(tls, name));
        }
        if let Some(tls) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(classify(tls, name));
        }
        next = e.source();
    }
    None
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

fn classify(e: &rustls::Error, name: &str) -> TlsFailure {
    match e {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => TlsFailure::UnknownIssuer,
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                TlsFailure::WrongHostName { name: name.into() }
            }
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => TlsFailure::Expired,
            other => TlsFailure::Other(format!("the server's certificate is invalid: {other:?}")),
        },
        // What came back is not a TLS record: RabbitMQ's plain port answers a ClientHello
        // with AMQP's protocol header.
        rustls::Error::InvalidMessage(_) => TlsFailure::NotTls,
        rustls::Error::AlertReceived(alert) => TlsFailure::RefusedByServer {
            alert: format!("{alert:?}"),
        },
        other => TlsFailure::Other(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::AlertDescription;
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

    /// The first bytes of a certificate, as PEM: only the key file is under test, and a
    /// certificate is not parsed before it is used.
    const CERTIFICATE: &str = "-----BEGIN CERTIFICATE-----
MIIBYjCCAQigAwIBAgIUQ2z0I8vJ3CJ2Jt0Gkq4Rz0Q9hQwwCgYIKoZIzj0EAwIw
ETEPMA0GA1UEAwwGdW51c2VkMB4XDTI0MDEwMTAwMDAwMFoXDTM0MDEwMTAwMDAw
MFowETEPMA0GA1UEAwwGdW51c2VkMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE
-----END CERTIFICATE-----
";

    #[test]
    fn unreadable_files_are_named_without_their_contents() {
        let dir = std::env::temp_dir().join(format!("retry-tls10-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        // Any certificate will do: the key is read after it.
        let cert = dir.join("client.pem");
        std::fs::write(&cert, CERTIFICATE).expect("write");
        let missing = dir.join("missing-ca.pem");
        let settings = TlsConfig::new()
            .with_ca_file(&missing)
            .with_client_identity(&cert, &cert);
        match build(&settings) {
            Err(TlsFailure::Configuration { file, reason }) => {
                assert_eq!(file, missing.display().to_string());
                assert!(reason.contains("cannot be read"), "{reason}");
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        // A body that is not base64, and a BEGIN line the parser would quote.
        for (i, pem) in [
            "-----BEGIN PRIVATE KEY-----\nS3CR3T-KEY-BYTES!!\n-----END PRIVATE KEY-----\n",
            "-----BEGIN PRIVATE KEY-----S3CR3T-KEY-BYTES\nMIIE\n-----END PRIVATE KEY-----\n",
            "-----BEGIN PRIVATE KEY-----\nS3CR3TS3CR3T\n",
        ]
        .into_iter()
        .enumerate()
        {
            let key = dir.join(format!("broken-{i}.key"));
            std::fs::write(&key, pem).expect("write");
            let settings = TlsConfig::new().with_client_identity(&cert, &key);
            let err = build(&settings).map(|_| ()).expect_err("a broken PEM file");
            let shown = format!("{err} {err:?}");
            assert!(shown.contains(&format!("broken-{i}.key")), "{shown}");
            assert!(!shown.contains("S3CR3T"), "{shown}");
            // Nor as the list of bytes the parser's errors print.
            assert!(!shown.contains("83, 51, 67, 82, 51, 84"), "{shown}");
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
