//! TLS for `amqps://` nodes: the rustls client configuration built from a
//! [`TlsConfig`], the handshake, and its refusals as [`TlsFailure`]s.
//!
//! lapin's own TLS setup (`OwnedTLSConfig`) adds a CA to the platform's roots instead of
//! replacing them, checks the certificate against the URL's host only, and reports every
//! refusal as an `io::Error` with rustls's wording. The transport therefore builds the
//! rustls `ClientConfig` itself, once per transport, opens the TCP stream and runs the
//! handshake, and hands lapin the finished stream through its connect callback (see the
//! `nodes` module). A refused handshake is an `io::Error` holding a [`TlsRefused`], which
//! survives lapin's wrapping and is turned into
//! [`TransportError::Tls`](retry_core::TransportError::Tls) where the transport reports it.
//!
//! Nothing here retries on plain TCP: an `amqps://` node is reached with TLS or not at all.
//! Errors name files and checks, never a password or the bytes of a key.

use std::path::Path;
use std::sync::Arc;

use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::uri::AMQPUri;
use retry_core::{TlsConfig, TlsFailure, TransportError};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{CertificateError, ClientConfig, RootCertStore};

/// The TLS side of a transport: one rustls configuration for every node, and the name
/// their certificates are checked against when it is not each node's host.
#[derive(Clone)]
pub(crate) struct Tls {
    connector: RustlsConnector,
    server_name: Option<String>,
    client_certificate: bool,
}

/// How long [`Tls::verdict`] waits for the server's answer to a `close_notify`.
const VERDICT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// A refused TLS handshake, or TLS settings that cannot be used, for one endpoint: carried
/// inside an `io::Error` through lapin's connect callback.
#[derive(Clone, Debug, thiserror::Error)]
#[error("TLS with {endpoint} failed: {failure}")]
pub(crate) struct TlsRefused {
    pub(crate) endpoint: String,
    pub(crate) failure: TlsFailure,
}

impl From<TlsRefused> for TransportError {
    fn from(r: TlsRefused) -> Self {
        TransportError::Tls {
            endpoint: r.endpoint,
            failure: r.failure,
        }
    }
}

/// `host:port` of a node: how a TLS refusal names it (never a user or password).
pub(crate) fn endpoint(uri: &AMQPUri) -> String {
    let host = &uri.authority.host;
    if host.contains(':') {
        format!("[{host}]:{}", uri.authority.port)
    } else {
        format!("{host}:{}", uri.authority.port)
    }
}

impl Tls {
    /// Reads the files of `config` and builds the client configuration. A file that cannot
    /// be read or used is a [`TlsFailure::Configuration`] naming it.
    pub(crate) fn new(config: &TlsConfig) -> Result<Self, TlsFailure> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| configuration("the TLS protocol versions", e.to_string()))?;
        let roots = if config.ca_files().is_empty() {
            platform_roots()?
        } else {
            let mut roots = RootCertStore::empty();
            for file in config.ca_files() {
                for cert in certificates(file)? {
                    roots.add(cert).map_err(|e| {
                        configuration(
                            &file.display().to_string(),
                            format!("not a usable CA certificate ({e})"),
                        )
                    })?;
                }
            }
            roots
        };
        let builder = builder.with_root_certificates(roots);
        let client = match config.client_identity() {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => builder
                .with_client_auth_cert(certificates(cert)?, private_key(key)?)
                .map_err(|e| {
                    configuration(
                        &key.display().to_string(),
                        format!("the key does not go with {} ({e})", cert.display()),
                    )
                })?,
        };
        Ok(Tls {
            connector: RustlsConnector::from(client),
            server_name: config.server_name().map(str::to_owned),
            client_certificate: config.client_identity().is_some(),
        })
    }

    /// Whether a client certificate is presented.
    pub(crate) fn presents_a_certificate(&self) -> bool {
        self.client_certificate
    }

    /// Reads the server's answer to the `close_notify` just sent on `stream`: a server that
    /// refuses the client's certificate says so with an alert once the client's side of a
    /// TLS 1.3 handshake is done. Read here, before any AMQP byte is written, the alert is
    /// not lost to the reset a server's close sends when unread data reaches it. An end of
    /// stream, any other error or no answer within [`VERDICT_WAIT`] is no refusal.
    pub(crate) async fn verdict<S>(
        &self,
        uri: &AMQPUri,
        mut stream: AsyncTcpStream<S>,
    ) -> std::io::Result<()>
    where
        S: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
    {
        use futures::AsyncReadExt;
        let mut buf = [0u8; 256];
        let reading = async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => continue,
                    Err(e) => match alert_in(&e) {
                        Some(failure) => {
                            return Err(std::io::Error::new(
                                e.kind(),
                                TlsRefused {
                                    endpoint: endpoint(uri),
                                    failure,
                                },
                            ));
                        }
                        None => return Ok(()),
                    },
                }
            }
        };
        tokio::time::timeout(VERDICT_WAIT, reading)
            .await
            .unwrap_or(Ok(()))
    }

    /// Runs the handshake on `stream`, a TCP stream to `uri`'s node: the server's
    /// certificate is checked against the configured server name, or the URL's host, which
    /// is also sent as SNI (when it is a name, not an address).
    pub(crate) async fn handshake<S>(
        &self,
        uri: &AMQPUri,
        stream: AsyncTcpStream<S>,
    ) -> std::io::Result<AsyncTcpStream<S>>
    where
        S: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
    {
        let name = self
            .server_name
            .as_deref()
            .unwrap_or(uri.authority.host.as_str());
        stream
            .into_rustls(&self.connector, name)
            .await
            .map_err(|e| refused(uri, name, e))
    }
}

/// The platform's roots, as lapin would load them.
fn platform_roots() -> Result<RootCertStore, TlsFailure> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_owned(), ToString::to_string);
        return Err(configuration(
            "the platform's CA certificates",
            format!("no usable CA certificate ({why}); give a CA file"),
        ));
    }
    Ok(roots)
}

fn configuration(file: &str, reason: String) -> TlsFailure {
    TlsFailure::Configuration {
        file: file.to_owned(),
        reason,
    }
}

fn read(file: &Path) -> Result<Vec<u8>, TlsFailure> {
    std::fs::read(file)
        .map_err(|e| configuration(&file.display().to_string(), format!("cannot be read: {e}")))
}

/// Why a PEM file could not be parsed, in words of our own: the parser's errors can quote
/// a line of the file, and a key file's lines are the key.
fn pem_reason(e: &pem::Error, wanted: &str) -> String {
    match e {
        pem::Error::NoItemsFound => format!("no {wanted} in it"),
        pem::Error::MissingSectionEnd { .. } => format!("a PEM section is not closed ({wanted})"),
        pem::Error::IllegalSectionStart { .. } => "a PEM section starts with a bad line".into(),
        pem::Error::Base64Decode(_) => "a PEM section is not valid base64".into(),
        pem::Error::SectionTooLarge => "a PEM section is too large".into(),
        _ => format!("not a PEM file with a {wanted}"),
    }
}

/// The certificates of a PEM file, leaf first; at least one.
fn certificates(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsFailure> {
    let bytes = read(file)?;
    let name = || file.display().to_string();
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| configuration(&name(), pem_reason(&e, "PEM certificate")))?;
    if certs.is_empty() {
        return Err(configuration(&name(), "no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(file: &Path) -> Result<PrivateKeyDer<'static>, TlsFailure> {
    let bytes = read(file)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        configuration(
            &file.display().to_string(),
            pem_reason(&e, "PEM private key"),
        )
    })
}

/// A failed handshake with `uri`'s node, its certificate checked against `name`: a
/// [`TlsRefused`] when rustls refused it, the error as it was otherwise (a reset, a
/// timeout).
fn refused(uri: &AMQPUri, name: &str, e: std::io::Error) -> std::io::Error {
    let Some(failure) = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .map(|r| failure(r, name))
    else {
        return e;
    };
    std::io::Error::new(
        e.kind(),
        TlsRefused {
            endpoint: endpoint(uri),
            failure,
        },
    )
}

/// The check a rustls error says failed.
pub(crate) fn failure(e: &rustls::Error, name: &str) -> TlsFailure {
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
            other => TlsFailure::Other(format!("invalid server certificate: {other:?}")),
        },
        // The first bytes of a plain AMQP (or any non-TLS) server are no TLS record: an
        // AMQP protocol header starts with 'A', no record content type.
        R::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType
            | rustls::InvalidMessage::UnknownProtocolVersion,
        ) => TlsFailure::NotTls,
        R::AlertReceived(alert) => TlsFailure::RefusedByServer {
            alert: format!("{alert:?}"),
        },
        other => TlsFailure::Other(other.to_string()),
    }
}

/// The TLS refusal in `err` or its chain of sources, if there is one.
pub(crate) fn refusal_in(err: &(dyn std::error::Error + 'static)) -> Option<TlsRefused> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(r) = e.downcast_ref::<TlsRefused>() {
            return Some(r.clone());
        }
        // An `io::Error`'s `source` skips the error it wraps.
        if let Some(r) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<TlsRefused>())
        {
            return Some(r.clone());
        }
        next = e.source();
    }
    None
}

/// The TLS failure of a rustls error in `err` or its chain of sources, when rustls refused
/// the connection after the handshake (a server's alert on the first read).
pub(crate) fn alert_in(err: &(dyn std::error::Error + 'static)) -> Option<TlsFailure> {
    let mut next = Some(err);
    while let Some(e) = next {
        let rustls = e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(r @ rustls::Error::AlertReceived(_)) = rustls {
            return Some(failure(r, ""));
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::AlertDescription;

    #[test]
    fn each_refusal_names_the_check_that_failed() {
        let cert = |c| rustls::Error::InvalidCertificate(c);
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
    fn a_refusal_is_found_through_io_errors_and_lapin_errors() {
        let refused = TlsRefused {
            endpoint: "localhost:5671".into(),
            failure: TlsFailure::NotTls,
        };
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, refused);
        let lapin = lapin::Error::from(io);
        let found = refusal_in(&lapin).expect("found through lapin's error");
        assert_eq!(found.failure, TlsFailure::NotTls);
        assert_eq!(found.endpoint, "localhost:5671");
        let other = lapin::Error::from(std::io::Error::other("reset"));
        assert!(refusal_in(&other).is_none());
    }

    #[test]
    fn unusable_files_are_configuration_failures_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("amqp091-tls-unit-{}", std::process::id()));
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
        for (config, file) in [
            (TlsConfig::new().with_ca_file(&missing), &missing),
            (TlsConfig::new().with_ca_file(&empty), &empty),
            (TlsConfig::new().with_ca_file(&garbage), &garbage),
        ] {
            match Tls::new(&config).unwrap_err() {
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
}
