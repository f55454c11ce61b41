//! What every rustls-based transport does with a [`TlsConfig`] and with rustls' refusals
//! (feature `rustls`): the client configuration, and the [`TlsFailure`] a rustls error
//! names. Errors name files and checks, never what a file holds: a key's bytes, or a line
//! of it, must not reach an error, a `Debug` output or a log line.

use std::error::Error as StdError;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{CertificateError, ClientConfig, RootCertStore};

use super::{TlsConfig, TlsFailure};

/// The rustls client configuration of `settings`, with rustls' `ring` provider chosen
/// explicitly (no process-wide default provider is needed). Without CA files, the roots
/// come from `default_roots` (the platform's, or a bundled set: the transport's choice).
/// The files are read now; one that cannot be read or used is a
/// [`TlsFailure::Configuration`] naming it.
///
/// ```
/// use retry_core::{TlsConfig, TlsFailure};
///
/// let missing = TlsConfig::new().with_ca_file("/nonexistent/ca.pem");
/// let err = retry_core::tls::client_config(&missing, || Ok(rustls::RootCertStore::empty()))
///     .unwrap_err();
/// assert!(matches!(err, TlsFailure::Configuration { file, .. } if file == "/nonexistent/ca.pem"));
/// ```
pub fn client_config(
    settings: &TlsConfig,
    default_roots: impl FnOnce() -> Result<RootCertStore, TlsFailure>,
) -> Result<ClientConfig, TlsFailure> {
    let roots = if settings.ca_files().is_empty() {
        default_roots()?
    } else {
        let mut roots = RootCertStore::empty();
        for file in settings.ca_files() {
            for cert in certificates(file)? {
                roots.add(cert).map_err(|e| {
                    configuration(file, format!("not a usable CA certificate ({e})"))
                })?;
            }
        }
        roots
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsFailure::Configuration {
            file: "the TLS protocol versions".into(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots);
    match settings.client_identity() {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => builder
            .with_client_auth_cert(certificates(cert)?, private_key(key)?)
            .map_err(|e| {
                // rustls words this from the key's type, never from its bytes.
                configuration(
                    key,
                    format!("the key does not go with {} ({e})", cert.display()),
                )
            }),
    }
}

/// `host:port` of an endpoint, as a TLS refusal names it (never a user or password); an
/// IPv6 host in brackets.
///
/// ```
/// assert_eq!(retry_core::tls::endpoint("::1", 5671), "[::1]:5671");
/// assert_eq!(retry_core::tls::endpoint("localhost", 5671), "localhost:5671");
/// ```
pub fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The check a rustls error says failed; `name` is the name the server's certificate was
/// checked against.
///
/// ```
/// use retry_core::TlsFailure;
/// use rustls::{CertificateError, Error};
///
/// let e = Error::InvalidCertificate(CertificateError::Expired);
/// assert_eq!(retry_core::tls::failure(&e, "localhost"), TlsFailure::Expired);
/// ```
pub fn failure(e: &rustls::Error, name: &str) -> TlsFailure {
    use rustls::Error as R;
    match e {
        R::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => TlsFailure::UnknownIssuer,
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                TlsFailure::WrongHostName {
                    name: name.to_owned(),
                }
            }
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. } => TlsFailure::Expired,
            other => TlsFailure::Other(format!("the server's certificate is invalid: {other:?}")),
        },
        // What came back is no TLS record: a plain AMQP port answers a ClientHello with its
        // protocol header, which starts with 'A', no record content type.
        R::InvalidMessage(_) => TlsFailure::NotTls,
        R::AlertReceived(alert) => TlsFailure::RefusedByServer {
            alert: format!("{alert:?}"),
        },
        other => TlsFailure::Other(other.to_string()),
    }
}

/// The rustls error in `e` or its chain of sources, looking inside `io::Error`s too (whose
/// `source` skips the error they wrap), as TLS streams hand rustls' errors over.
///
/// ```
/// let io = std::io::Error::new(std::io::ErrorKind::InvalidData, rustls::Error::DecryptError);
/// assert!(retry_core::tls::rustls_error_in(&io).is_some());
/// assert!(retry_core::tls::rustls_error_in(&std::io::Error::other("reset")).is_none());
/// ```
pub fn rustls_error_in<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(e);
    while let Some(e) = next {
        let found = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if found.is_some() {
            return found;
        }
        next = e.source();
    }
    None
}

fn configuration(file: &Path, reason: String) -> TlsFailure {
    TlsFailure::Configuration {
        file: file.display().to_string(),
        reason,
    }
}

/// Why a PEM file could not be used, in words of our own: the parser's errors can quote a
/// line of the file, and a key file's lines are the key.
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

/// Every certificate of a PEM file, leaf first; none is an error.
fn certificates(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFailure> {
    let unusable = |e: pem::Error| configuration(file, pem_reason(&e, "certificate"));
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
    PrivateKeyDer::from_pem_file(file)
        .map_err(|e| configuration(file, pem_reason(&e, "private key (PKCS#8, PKCS#1 or SEC1)")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::AlertDescription;

    #[test]
    fn each_refusal_names_the_check_that_failed() {
        let cert = rustls::Error::InvalidCertificate;
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
            (cert(CertificateError::Expired), TlsFailure::Expired),
            (cert(CertificateError::NotValidYet), TlsFailure::Expired),
            (
                rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType),
                TlsFailure::NotTls,
            ),
            (
                rustls::Error::AlertReceived(AlertDescription::CertificateRequired),
                TlsFailure::RefusedByServer {
                    alert: "CertificateRequired".into(),
                },
            ),
        ];
        for (error, want) in cases {
            assert_eq!(failure(&error, "127.0.0.1"), want, "{error:?}");
        }
    }

    #[test]
    fn unusable_files_are_configuration_failures_naming_the_file_not_its_lines() {
        let dir = std::env::temp_dir().join(format!("retry-core-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let garbage = dir.join("garbage.pem");
        std::fs::write(
            &garbage,
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LWtleS1ieXRlcw==\n",
        )
        .unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "nothing here\n").unwrap();
        let missing = dir.join("missing.pem");
        let none = || Ok(RootCertStore::empty());
        for (settings, file) in [
            (TlsConfig::new().with_ca_file(&missing), &missing),
            (TlsConfig::new().with_ca_file(&empty), &empty),
            (TlsConfig::new().with_ca_file(&garbage), &garbage),
            (
                TlsConfig::new().with_client_identity(&empty, &garbage),
                &empty,
            ),
        ] {
            match client_config(&settings, none).unwrap_err() {
                TlsFailure::Configuration {
                    file: named,
                    reason,
                } => {
                    assert_eq!(named, file.display().to_string());
                    assert!(!reason.contains("c2VjcmV0"), "{reason}");
                }
                other => panic!("{file:?}: {other:?}"),
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
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
        let dir = std::env::temp_dir().join(format!("retry-core-tls-keys-{}", std::process::id()));
        let none = || Ok(RootCertStore::empty());
        std::fs::create_dir_all(&dir).expect("temp dir");
        // Any certificate will do: the key is read after it.
        let cert = dir.join("client.pem");
        std::fs::write(&cert, CERTIFICATE).expect("write");
        let missing = dir.join("missing-ca.pem");
        let settings = TlsConfig::new()
            .with_ca_file(&missing)
            .with_client_identity(&cert, &cert);
        match client_config(&settings, none) {
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
            let err = client_config(&settings, none)
                .map(|_| ())
                .expect_err("a broken PEM file");
            let shown = format!("{err} {err:?}");
            assert!(shown.contains(&format!("broken-{i}.key")), "{shown}");
            assert!(!shown.contains("S3CR3T"), "{shown}");
            // Nor as the list of bytes the parser's errors print.
            assert!(!shown.contains("83, 51, 67, 82, 51, 84"), "{shown}");
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
