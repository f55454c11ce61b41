//! [`NatsConfig`]: where the server is, and the transport's timings.

use std::time::Duration;

use async_nats::ServerAddr;
use retry_core::NodeListError;
use transport_kit::settings::{ConnectionSettings, NodeList, NodeOrder};

/// How to reach NATS and how the transport behaves. Built with [`NatsConfig::new`] and the
/// `with_*` methods; checked when [`NatsTransport::connect`](crate::NatsTransport::connect)
/// runs.
///
/// The servers, their order, the connect, operation and publish timeouts are the
/// [`ConnectionSettings`] every transport has ([`settings`](Self::settings)); TLS comes from
/// the URL (`tls://`), and TLS settings in them are refused
/// ([`ConfigError::TlsSettings`]). The rest is this transport's own.
///
/// ```
/// use std::time::Duration;
/// use transport_nats::NatsConfig;
///
/// let config = NatsConfig::new("nats://app:s3cret@127.0.0.1:4222")
///     .with_ack_wait(Duration::from_secs(10))
///     .with_replicas(3);
/// assert_eq!(config.url(), "nats://app:****@127.0.0.1:4222");
/// assert_eq!(config.ack_wait(), Duration::from_secs(10));
/// ```
#[derive(Clone)]
pub struct NatsConfig {
    settings: ConnectionSettings,
    ack_wait: Duration,
    pull_wait: Duration,
    fetch_wait: Duration,
    replicas: usize,
    duplicate_window: Duration,
    name: Option<String>,
}

/// The server's default duplicate window, which the transport also uses.
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

impl NatsConfig {
    /// A configuration for the server (or the comma-separated servers of a cluster) at
    /// `urls`, such as `nats://127.0.0.1:4222`. Credentials may be in the URL
    /// (`nats://user:password@host:4222`); every message and log shows them masked.
    ///
    /// Defaults: ack wait 10 s, pull wait 1 s, fetch wait 250 ms, publish timeout 10 s,
    /// operation timeout 10 s (and connect timeout), one replica, a duplicate window of
    /// 2 min, servers tried in an order async-nats shuffles at each connection
    /// ([`NodeOrder::Shuffled`]). An empty URL between the commas is refused at its place.
    pub fn new(urls: impl Into<String>) -> Self {
        let urls = urls.into();
        NatsConfig {
            settings: ConnectionSettings::from_nodes(NodeList::from_urls(urls.split(',')))
                .with_node_order(NodeOrder::Shuffled)
                .with_connect_timeout(Duration::from_secs(10))
                .with_publish_timeout(Duration::from_secs(10))
                .with_operation_timeout(Duration::from_secs(10)),
            ack_wait: Duration::from_secs(10),
            pull_wait: Duration::from_secs(1),
            fetch_wait: Duration::from_millis(250),
            replicas: 1,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            name: None,
        }
    }

    /// The connection settings every transport has, in place of these settings' own: the
    /// servers, their order ([`NodeOrder::InOrder`] keeps the list's order; async-nats
    /// shuffles it otherwise), the connect, publish and operation timeouts. TLS settings
    /// are refused when connecting: NATS takes TLS from the URL. What is this transport's
    /// own (ack, pull and fetch waits, replicas, duplicate window, name) stays as it was.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_nats::{ConnectionSettings, NatsConfig, NodeOrder};
    ///
    /// let shared = ConnectionSettings::new("nats://10.0.0.1:4222,nats://10.0.0.2:4222")
    ///     .with_connect_timeout(Duration::from_secs(3));
    /// let config = NatsConfig::new("nats://127.0.0.1:4222")
    ///     .with_replicas(3)
    ///     .with_settings(shared.clone());
    /// assert_eq!(config.settings().node_order(), NodeOrder::InOrder);
    /// assert_eq!(config.url(), "nats://10.0.0.1:4222,nats://10.0.0.2:4222");
    /// assert_eq!(config.replicas(), 3);
    /// assert_eq!(config.settings(), &shared);
    /// ```
    pub fn with_settings(mut self, settings: ConnectionSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The connection settings every transport has.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_nats::{NatsConfig, NodeOrder};
    ///
    /// let config = NatsConfig::new("nats://127.0.0.1:4222");
    /// assert_eq!(config.settings().node_order(), NodeOrder::Shuffled);
    /// assert_eq!(config.settings().connect_timeout(), Duration::from_secs(10));
    /// ```
    pub fn settings(&self) -> &ConnectionSettings {
        &self.settings
    }

    /// How long the server waits for a delivery's ack before it hands the message out
    /// again (the consumers' `ack_wait`). While a handler runs, the transport tells the
    /// server it is still working (`+WPI`) every third of it, so a long handler is never
    /// redelivered under it; after a crash, the crashed consumer's deliveries come back
    /// once it has passed. Shorter finds crashes sooner.
    pub fn with_ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// How long one pull request of a subscription waits for messages (its `expires`).
    /// A cancelled subscription ends once its last pull has, so this bounds how long a
    /// graceful shutdown waits for the server.
    pub fn with_pull_wait(mut self, pull_wait: Duration) -> Self {
        self.pull_wait = pull_wait;
        self
    }

    /// How long a [`fetch`](retry_core::Transport::fetch) (a pull of one message, with
    /// this as its `expires`) waits for a message before it answers `None`. A queue with
    /// nothing pending and nothing handed out answers `None` at once, without a pull.
    pub fn with_fetch_wait(mut self, fetch_wait: Duration) -> Self {
        self.fetch_wait = fetch_wait;
        self
    }

    /// How long a publish waits for the stream's acknowledgement (PubAck).
    pub fn with_publish_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_publish_timeout(timeout);
        self
    }

    /// How long any other request to the server (a stream or consumer lookup, a fetch of a
    /// stored message) waits for its answer. It also bounds connecting: this sets the
    /// settings' connect timeout too (a connect timeout of its own goes in
    /// [`with_settings`](Self::with_settings), after this call).
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_nats::NatsConfig;
    ///
    /// let config = NatsConfig::new("nats://127.0.0.1:4222").with_operation_timeout(Duration::from_secs(2));
    /// assert_eq!(config.operation_timeout(), Duration::from_secs(2));
    /// assert_eq!(config.settings().connect_timeout(), Duration::from_secs(2));
    /// ```
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self
            .settings
            .with_operation_timeout(timeout)
            .with_connect_timeout(timeout);
        self
    }

    /// On how many servers of a cluster each stream is kept (1 to 5): 3 survives the loss
    /// of one server.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The streams' duplicate window: how long the server remembers a `Nats-Msg-Id`, and so
    /// how long a clone published twice (a retry of a publish whose acknowledgement was
    /// lost) is stored once.
    pub fn with_duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// The connection name the server shows (`connz`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The servers' URLs, passwords masked.
    pub fn url(&self) -> String {
        self.settings.redacted_url()
    }

    /// The ack wait.
    pub fn ack_wait(&self) -> Duration {
        self.ack_wait
    }

    /// The pull wait.
    pub fn pull_wait(&self) -> Duration {
        self.pull_wait
    }

    /// The fetch wait.
    pub fn fetch_wait(&self) -> Duration {
        self.fetch_wait
    }

    /// The publish timeout.
    pub fn publish_timeout(&self) -> Duration {
        self.settings.publish_timeout()
    }

    /// The operation timeout.
    pub fn operation_timeout(&self) -> Duration {
        self.settings.operation_timeout()
    }

    /// The number of replicas.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The duplicate window.
    pub fn duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    pub(crate) fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The servers, parsed; or why the list, or a setting, cannot be used.
    pub(crate) fn check(&self) -> Result<Vec<ServerAddr>, ConfigError> {
        let zero = |setting: &'static str, value: Duration| {
            if value.is_zero() {
                Err(ConfigError::ZeroDuration { setting })
            } else {
                Ok(())
            }
        };
        zero("ack_wait", self.ack_wait)?;
        zero("pull_wait", self.pull_wait)?;
        zero("fetch_wait", self.fetch_wait)?;
        zero("publish_timeout", self.settings.publish_timeout())?;
        zero("operation_timeout", self.settings.operation_timeout())?;
        zero("connect_timeout", self.settings.connect_timeout())?;
        zero("duplicate_window", self.duplicate_window)?;
        if !(1..=5).contains(&self.replicas) {
            return Err(ConfigError::Replicas {
                replicas: self.replicas,
            });
        }
        if self.settings.tls().is_some() {
            return Err(ConfigError::TlsSettings);
        }
        let nodes = self.settings.nodes().parse_with(|node, _: &[ServerAddr]| {
            if node.url().is_empty() {
                return Err(node.invalid("the URL is empty"));
            }
            node.check_scheme(&["nats", "tls"])?;
            node.url()
                .parse::<ServerAddr>()
                .map_err(|e| node.invalid(e.to_string()))
        })?;
        Ok(nodes)
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("settings", &self.settings)
            .field("ack_wait", &self.ack_wait)
            .field("pull_wait", &self.pull_wait)
            .field("fetch_wait", &self.fetch_wait)
            .field("replicas", &self.replicas)
            .field("duplicate_window", &self.duplicate_window)
            .finish()
    }
}

/// Why a [`NatsConfig`] cannot be used.
///
/// ```
/// use transport_nats::{ConfigError, NatsConfig};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let err = transport_nats::NatsTransport::connect(NatsConfig::new("nats://127.0.0.1:4222").with_replicas(0))
///     .await
///     .unwrap_err();
/// assert!(err.to_string().contains("replicas"), "{err}");
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A server URL is unusable.
    #[error(transparent)]
    Nodes(#[from] NodeListError),
    /// A duration that must be positive is zero.
    #[error("{setting} must be longer than zero")]
    ZeroDuration {
        /// The setting.
        setting: &'static str,
    },
    /// The replica count is out of JetStream's range.
    #[error("replicas must be 1 to 5, not {replicas}")]
    Replicas {
        /// What was given.
        replicas: usize,
    },
    /// TLS settings were given ([`ConnectionSettings::with_tls`]): NATS takes TLS from the
    /// URL.
    #[error(
        "TLS settings are not supported over NATS: a tls:// URL connects with TLS, trusting the platform's roots"
    )]
    TlsSettings,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        let base = || NatsConfig::new("nats://127.0.0.1:4222");
        assert!(base().check().is_ok());
        let err = base().with_ack_wait(Duration::ZERO).check().unwrap_err();
        assert_eq!(err.to_string(), "ack_wait must be longer than zero");
        let err = base().with_replicas(6).check().unwrap_err();
        assert_eq!(err.to_string(), "replicas must be 1 to 5, not 6");
        let err = NatsConfig::new("nats://a:pw@127.0.0.1:4222,http://b:pw@h")
            .check()
            .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("http") && !text.contains("pw"), "{text}");
        let err = NatsConfig::new("nats://127.0.0.1:4222,")
            .check()
            .unwrap_err();
        assert!(err.to_string().contains('2'), "{err}");
    }

    #[test]
    fn the_shared_settings_are_checked_and_tls_settings_refused() {
        let base = NatsConfig::new("nats://127.0.0.1:4222");
        let tls = base
            .settings()
            .clone()
            .with_tls(retry_core::TlsConfig::new());
        let err = base.clone().with_settings(tls).check().unwrap_err();
        assert!(matches!(err, ConfigError::TlsSettings), "{err:?}");
        let zero = base.settings().clone().with_connect_timeout(Duration::ZERO);
        let err = base.clone().with_settings(zero).check().unwrap_err();
        assert_eq!(err.to_string(), "connect_timeout must be longer than zero");
        let none = base.with_settings(ConnectionSettings::new(" , "));
        assert!(matches!(
            none.check().unwrap_err(),
            ConfigError::Nodes(NodeListError::Empty)
        ));
        // Schemes are told apart whatever their case, as async-nats reads them.
        assert!(NatsConfig::new("NATS://127.0.0.1:4222").check().is_ok());
    }

    #[test]
    fn debug_masks_the_password() {
        let config = NatsConfig::new("nats://u:hunter2@127.0.0.1:4222");
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
