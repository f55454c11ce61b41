//! TLS settings and TLS refusals, shared by the transports that speak TLS.
//!
//! A transport takes a [`TlsConfig`] for its TLS URLs (`amqps://`) and, when a handshake is
//! refused, fails with [`TransportError::Tls`](crate::TransportError::Tls) naming the
//! endpoint and a [`TlsFailure`]: which check failed, never the password or a key.
//!
//! With the `rustls` feature, this module also holds what every rustls-based transport does
//! with them: [`client_config`] builds the client configuration, [`failure`] names the
//! check a rustls error failed.

use std::fmt;
use std::path::{Path, PathBuf};

/// What a transport trusts and presents on a TLS connection.
///
/// By default the server's certificate must chain to the platform's or the bundled public
/// roots and be valid for the host name of the URL, and no client certificate is sent.
/// Nothing is read from disk until a connection is opened; a file that cannot be read or
/// parsed then fails the connection with [`TlsFailure::Configuration`].
///
/// `Debug` shows the paths, never the contents of a file.
///
/// ```
/// use retry_core::TlsConfig;
///
/// let tls = TlsConfig::new()
///     .with_ca_file("/etc/rabbitmq/ca.pem")
///     .with_client_identity("/etc/app/client.pem", "/etc/app/client.key")
///     .with_server_name("rabbit.internal");
/// assert_eq!(tls.server_name(), Some("rabbit.internal"));
/// assert!(tls.client_identity().is_some());
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    ca_files: Vec<PathBuf>,
    client_identity: Option<(PathBuf, PathBuf)>,
    server_name: Option<String>,
}

impl TlsConfig {
    /// The defaults: public roots, the URL's host name, no client certificate.
    pub fn new() -> Self {
        TlsConfig::default()
    }

    /// Trusts the certificates of a PEM file (one or more) *instead of* the public roots.
    /// Called again, the files add up.
    pub fn with_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_files.push(path.into());
        self
    }

    /// Presents a client certificate: a PEM file holding the certificate (and any
    /// intermediates, leaf first) and a PEM file holding its private key (PKCS#8, PKCS#1
    /// or SEC1). With a broker that allows it, the certificate can also log in (SASL
    /// `EXTERNAL`; see the transport's configuration).
    pub fn with_client_identity(
        mut self,
        certificate: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Self {
        self.client_identity = Some((certificate.into(), key.into()));
        self
    }

    /// Checks the server's certificate against `name` (and sends it as SNI) in place of the
    /// URL's host: for a broker reached by an address its certificate does not name.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// The CA files, in the order given; empty means the public roots.
    pub fn ca_files(&self) -> &[PathBuf] {
        &self.ca_files
    }

    /// The client certificate and key files, if any.
    pub fn client_identity(&self) -> Option<(&Path, &Path)> {
        self.client_identity
            .as_ref()
            .map(|(cert, key)| (cert.as_path(), key.as_path()))
    }

    /// The name the server's certificate is checked against, when not the URL's host.
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("ca_files", &self.ca_files)
            .field(
                "client_certificate",
                &self.client_identity.as_ref().map(|(cert, _)| cert),
            )
            .field(
                "client_key",
                &self.client_identity.as_ref().map(|(_, key)| key),
            )
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// Why a TLS connection was refused, by the client's checks or by the server.
///
/// ```
/// use retry_core::TlsFailure;
///
/// let why = TlsFailure::WrongHostName { name: "127.0.0.1".into() };
/// assert_eq!(why.to_string(), "the server's certificate is not valid for 127.0.0.1");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsFailure {
    /// The server's certificate does not chain to a trusted CA.
    #[error("the server's certificate is signed by an unknown CA")]
    UnknownIssuer,
    /// The server's certificate does not name the host (or the configured server name).
    #[error("the server's certificate is not valid for {name}")]
    WrongHostName {
        /// The name it was checked against.
        name: String,
    },
    /// The server's certificate has expired, or is not valid yet.
    #[error("the server's certificate has expired or is not yet valid")]
    Expired,
    /// The peer did not answer the handshake with TLS: a plain-TCP port given as a TLS URL.
    #[error("the server did not answer with TLS (a plain-TCP port given as a TLS URL?)")]
    NotTls,
    /// The server refused the handshake with an alert, such as a client certificate it
    /// does not accept (or one it requires and did not get).
    #[error("the server refused the handshake: {alert}")]
    RefusedByServer {
        /// The TLS alert, as the client library names it.
        alert: String,
    },
    /// A CA file, client certificate or key could not be read or used.
    #[error("{file}: {reason}")]
    Configuration {
        /// The file, or the setting, at fault.
        file: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Any other handshake failure, as the client library words it.
    #[error("{0}")]
    Other(String),
}

#[cfg(feature = "rustls")]
mod with_rustls;
#[cfg(feature = "rustls")]
pub use with_rustls::{client_config, endpoint, failure, rustls_error_in};
