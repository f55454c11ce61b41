//! The broker a command talks to: the URL, the transport the registry picks for it, and the
//! connection options. `retryctl` knows no broker of its own: what it asks of one goes
//! through [`Admin`](retry_core::Admin) on the [`DynTransport`] the registry connects.

use retry_core::{
    Admin, ConnectError, ConnectOptions, Depth, DynTransport, Registration, Registry,
    TransportError, redact_url,
};

use crate::error::CliError;

/// The connection setting a transport may take to stay down once its connection is lost:
/// a command that loses it fails and says so, rather than waiting for it to come back.
const AUTO_RECOVER: &str = "auto_recover";

/// The broker of a command: `--url`, `--protocol` and the `--tls-*` options, and the
/// registry of transports that may speak it.
#[derive(Clone, Debug)]
pub struct Broker {
    registry: Registry,
    url: String,
    options: ConnectOptions,
}

impl Broker {
    /// The broker at `url`, connected with `options` through `registry`.
    pub fn new(registry: Registry, url: impl Into<String>, options: ConnectOptions) -> Self {
        Broker {
            registry,
            url: url.into(),
            options: options.with_client_name("retryctl"),
        }
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL as printed: every password masked.
    pub fn shown(&self) -> String {
        redact_url(&self.url)
    }

    /// The transport that speaks the URL: a usage error naming the URL's scheme, or the
    /// protocol asked for, when none does.
    pub fn registration(&self) -> Result<&Registration, CliError> {
        self.registry
            .resolve(&self.url, self.options.protocol())
            .map_err(|e| connect_error(&self.registry, e))
    }

    /// Connects, with `settings` of the transport's own beside the options.
    pub async fn connect(&self, settings: &[(String, String)]) -> Result<DynTransport, CliError> {
        let registration = self.registration()?;
        let mut options = self.options.clone();
        if registration.settings().iter().any(|s| s == AUTO_RECOVER) {
            options = options.with_setting(AUTO_RECOVER, "false");
        }
        for (key, value) in settings {
            options = options.with_setting(key, value);
        }
        self.registry
            .connect_with(&self.url, options)
            .await
            .map_err(|e| connect_error(&self.registry, e))
    }

    /// Connects, runs `job` on the transport, and closes it, whatever `job` returned.
    pub async fn with_transport<T>(
        &self,
        settings: &[(String, String)],
        job: impl AsyncFnOnce(&DynTransport) -> Result<T, CliError>,
    ) -> Result<T, CliError> {
        let transport = self.connect(settings).await?;
        let result = job(&transport).await;
        retry_core::Transport::close(&transport).await;
        result
    }
}

/// Queue `name`'s depth, or why the transport could not tell.
pub async fn depth(transport: &DynTransport, name: &str) -> Result<Depth, CliError> {
    transport
        .depth(name)
        .await
        .map_err(|e| CliError::from_transport(format!("cannot inspect queue {name:?}"), e))
}

/// A refusal of the registry is the user's input (exit 2), worded with the option that
/// gave it; a transport that could not connect is a failure (exit 1), reported without
/// "connection lost": there was none yet.
fn connect_error(registry: &Registry, e: ConnectError) -> CliError {
    let accepted = || registry.accepted();
    let unknown_scheme = |scheme: &str| {
        CliError::usage(format!(
            "URL scheme \"{scheme}://\" in --url (or AMQP_URL): retryctl accepts {}",
            accepted()
        ))
    };
    match e {
        ConnectError::Transport(TransportError::Connection {
            context,
            source: Some(source),
        }) => CliError::failure_from(context, source),
        ConnectError::Transport(e) => CliError::failure(e),
        ConnectError::EmptyUrl => CliError::usage("--url is empty"),
        ConnectError::NoScheme { .. } => CliError::usage(format!(
            "a URL without a scheme in --url (or AMQP_URL): retryctl accepts {}",
            accepted()
        )),
        ConnectError::UnknownScheme { scheme, .. } => unknown_scheme(&scheme),
        ConnectError::UnknownProtocol { protocol, known } => CliError::usage(format!(
            "--protocol {protocol}: no transport is called so; retryctl speaks {}",
            known.join(", ")
        )),
        // A scheme nothing speaks is named as such, whatever was asked for.
        ConnectError::SchemeNotSpoken { scheme, .. }
            if !registry
                .registrations()
                .iter()
                .any(|r| r.schemes().contains(&scheme)) =>
        {
            unknown_scheme(&scheme)
        }
        ConnectError::SchemeNotSpoken {
            protocol, scheme, ..
        } => CliError::usage(format!(
            "--protocol {protocol} does not speak {scheme}:// URLs: retryctl accepts {}",
            accepted()
        )),
        ConnectError::MixedProtocols { .. } => CliError::usage(
            "the URLs of --url call for different transports: list the nodes of one broker",
        ),
        ConnectError::TlsUnsupported { protocol } => CliError::usage(format!(
            "--tls-ca, --tls-cert, --tls-key and --tls-server-name do not apply to {protocol}: \
             it takes no TLS settings"
        )),
        e => CliError::usage(e),
    }
}
