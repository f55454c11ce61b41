//! The TLS client of `amqps://` connections (feature `tls`): the rustls configuration built
//! from a [`TlsConfig`], the name the server's certificate is checked against, and the
//! [`TlsFailure`] a refused handshake names.
//!
//! The handshake itself stays with each transport: lapin's and tokio-rustls' streams differ.
//! Errors name files and checks, never what a file holds.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use retry_core::{TlsConfig, TlsFailure};
use rustls::pki_types::ServerName;
use rustls::{ClientConfig, RootCertStore};

/// Which certificate authorities a [`TlsClient`] trusts when its [`TlsConfig`] names no CA
/// file.
///
/// ```
/// use retry_core::TlsConfig;
/// use transport_kit::settings::{DefaultRoots, TlsClient};
///
/// // The bundled roots need nothing from the machine.
/// let client = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
/// assert!(!client.presents_certificate());
/// # Ok::<(), retry_core::TlsFailure>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultRoots {
    /// The platform's CA certificates (`rustls-native-certs`), as lapin's own TLS loads
    /// them. None found is a [`TlsFailure::Configuration`] asking for a CA file.
    Platform,
    /// The public authorities compiled in (`webpki-roots`).
    Bundled,
}

impl DefaultRoots {
    fn load(self) -> Result<RootCertStore, TlsFailure> {
        match self {
            DefaultRoots::Bundled => Ok(RootCertStore::from_iter(
                webpki_roots::TLS_SERVER_ROOTS.iter().cloned(),
            )),
            DefaultRoots::Platform => {
                let found = rustls_native_certs::load_native_certs();
                let mut roots = RootCertStore::empty();
                roots.add_parsable_certificates(found.certs);
                if roots.is_empty() {
                    let why = found
                        .errors
                        .first()
                        .map_or_else(|| "none found".to_owned(), ToString::to_string);
                    return Err(TlsFailure::Configuration {
                        file: "the platform's CA certificates".into(),
                        reason: format!("no usable CA certificate ({why}); give a CA file"),
                    });
                }
                Ok(roots)
            }
        }
    }
}

/// A rustls client configuration for TLS connections, with the name each server's
/// certificate is checked against (and sent as SNI): the [`TlsConfig`]'s server name, or
/// the host of the node's URL.
///
/// `Debug` shows the server name and whether a client certificate is presented.
///
/// ```
/// use retry_core::TlsConfig;
/// use transport_kit::settings::{DefaultRoots, TlsClient};
///
/// let client = TlsClient::new(
///     &TlsConfig::new().with_server_name("rabbit.internal"),
///     DefaultRoots::Bundled,
/// )?;
/// assert_eq!(client.checked_name("10.0.0.7"), "rabbit.internal");
/// # Ok::<(), retry_core::TlsFailure>(())
/// ```
#[derive(Clone)]
pub struct TlsClient {
    config: Arc<ClientConfig>,
    server_name: Option<String>,
    presents_certificate: bool,
}

impl TlsClient {
    /// The client of `settings`, its files read now: its CA files in place of
    /// `default_roots`, its client certificate, its server name. A file that cannot be
    /// read or used is a [`TlsFailure::Configuration`] naming it (see
    /// [`retry_core::tls::client_config`]).
    ///
    /// ```
    /// use retry_core::{TlsConfig, TlsFailure};
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let missing = TlsConfig::new().with_ca_file("/nonexistent/ca.pem");
    /// let err = TlsClient::new(&missing, DefaultRoots::Bundled).unwrap_err();
    /// assert!(matches!(err, TlsFailure::Configuration { file, .. } if file == "/nonexistent/ca.pem"));
    /// ```
    pub fn new(settings: &TlsConfig, default_roots: DefaultRoots) -> Result<Self, TlsFailure> {
        let config = retry_core::tls::client_config(settings, || default_roots.load())?;
        Ok(TlsClient {
            config: Arc::new(config),
            server_name: settings.server_name().map(str::to_owned),
            presents_certificate: settings.client_identity().is_some(),
        })
    }

    /// A client configuration given whole (another crypto provider, a verifier of one's
    /// own), used as it is: each server's certificate is checked against its URL's host.
    /// It presents a certificate when it has one to present.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let built = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
    /// let given = TlsClient::from_config(Arc::clone(built.config()));
    /// assert_eq!(given.checked_name("broker.example"), "broker.example");
    /// assert!(!given.presents_certificate());
    /// # Ok::<(), retry_core::TlsFailure>(())
    /// ```
    pub fn from_config(config: Arc<ClientConfig>) -> Self {
        TlsClient {
            presents_certificate: config.client_auth_cert_resolver.has_certs(),
            config,
            server_name: None,
        }
    }

    /// The rustls configuration.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let client = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
    /// assert!(!client.config().client_auth_cert_resolver.has_certs());
    /// # Ok::<(), retry_core::TlsFailure>(())
    /// ```
    pub fn config(&self) -> &Arc<ClientConfig> {
        &self.config
    }

    /// The name the certificate of the server at `host` is checked against: the configured
    /// server name, or `host`.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let client = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
    /// assert_eq!(client.checked_name("localhost"), "localhost");
    /// # Ok::<(), retry_core::TlsFailure>(())
    /// ```
    pub fn checked_name<'a>(&'a self, host: &'a str) -> &'a str {
        self.server_name.as_deref().unwrap_or(host)
    }

    /// [`checked_name`](Self::checked_name) as rustls takes it; a name that is neither a
    /// DNS name nor an IP address is a [`TlsFailure::Configuration`].
    ///
    /// ```
    /// use retry_core::{TlsConfig, TlsFailure};
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let client = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
    /// assert_eq!(client.server_name("127.0.0.1")?.to_str(), "127.0.0.1");
    /// assert!(matches!(client.server_name("not a name"), Err(TlsFailure::Configuration { .. })));
    /// # Ok::<(), retry_core::TlsFailure>(())
    /// ```
    pub fn server_name(&self, host: &str) -> Result<ServerName<'static>, TlsFailure> {
        let name = self.checked_name(host);
        ServerName::try_from(name.to_owned()).map_err(|e| TlsFailure::Configuration {
            file: "the server name".into(),
            reason: format!("{name:?} is not a DNS name or an IP address: {e}"),
        })
    }

    /// Whether the handshake presents a client certificate.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::{DefaultRoots, TlsClient};
    ///
    /// let client = TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)?;
    /// assert!(!client.presents_certificate());
    /// # Ok::<(), retry_core::TlsFailure>(())
    /// ```
    pub fn presents_certificate(&self) -> bool {
        self.presents_certificate
    }
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.server_name)
            .field("presents_certificate", &self.presents_certificate)
            .finish_non_exhaustive()
    }
}

/// The TLS failure somewhere in the causes of `e`, if there is one: rustls' own error, as a
/// TLS stream hands it over inside an `io::Error`. `name` is the name the server's
/// certificate was checked against ([`TlsClient::checked_name`]).
///
/// ```
/// use retry_core::TlsFailure;
/// use rustls::{CertificateError, Error};
///
/// let io = std::io::Error::new(
///     std::io::ErrorKind::InvalidData,
///     Error::InvalidCertificate(CertificateError::UnknownIssuer),
/// );
/// assert_eq!(transport_kit::settings::failure_in(&io, "h"), Some(TlsFailure::UnknownIssuer));
/// assert_eq!(transport_kit::settings::failure_in(&std::io::Error::other("reset"), "h"), None);
/// ```
pub fn failure_in(e: &(dyn StdError + 'static), name: &str) -> Option<TlsFailure> {
    retry_core::tls::rustls_error_in(e).map(|tls| retry_core::tls::failure(tls, name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::AlertDescription;

    fn io(e: rustls::Error) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
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

    #[test]
    fn the_checked_name_is_the_configured_one_or_the_host() {
        let named = TlsClient::new(
            &TlsConfig::new().with_server_name("rabbit.internal"),
            DefaultRoots::Bundled,
        )
        .expect("no file to read");
        assert_eq!(named.checked_name("10.0.0.7"), "rabbit.internal");
        assert_eq!(
            named.server_name("10.0.0.7").expect("a DNS name").to_str(),
            "rabbit.internal"
        );
        let shown = format!("{named:?}");
        assert!(shown.contains("rabbit.internal"), "{shown}");
        let plain = TlsClient::from_config(Arc::clone(named.config()));
        assert_eq!(plain.checked_name("10.0.0.7"), "10.0.0.7");
    }
}
