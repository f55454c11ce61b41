//! [`NatsConfig`]: where the server is, and the transport's timings.

use std::time::Duration;

use async_nats::ServerAddr;
use retry_core::{NodeListError, redact_url};

/// How to reach NATS and how the transport behaves. Built with [`NatsConfig::new`] and the
/// `with_*` methods; checked when [`NatsTransport::connect`](crate::NatsTransport::connect)
/// runs.
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
    urls: String,
    ack_wait: Duration,
    pull_wait: Duration,
    fetch_wait: Duration,
    publish_timeout: Duration,
    operation_timeout: Duration,
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
    /// operation timeout 10 s, one replica, a duplicate window of 2 min.
    pub fn new(urls: impl Into<String>) -> Self {
        NatsConfig {
            urls: urls.into(),
            ack_wait: Duration::from_secs(10),
            pull_wait: Duration::from_secs(1),
            fetch_wait: Duration::from_millis(250),
            publish_timeout: Duration::from_secs(10),
            operation_timeout: Duration::from_secs(10),
            replicas: 1,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            name: None,
        }
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
        self.publish_timeout = timeout;
        self
    }

    /// How long any other request to the server (a stream or consumer lookup, a fetch of a
    /// stored message) waits for its answer.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
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
        self.urls
            .split(',')
            .map(|u| redact_url(u.trim()))
            .collect::<Vec<_>>()
            .join(",")
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
        self.publish_timeout
    }

    /// The operation timeout.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
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
        zero("publish_timeout", self.publish_timeout)?;
        zero("operation_timeout", self.operation_timeout)?;
        zero("duplicate_window", self.duplicate_window)?;
        if !(1..=5).contains(&self.replicas) {
            return Err(ConfigError::Replicas {
                replicas: self.replicas,
            });
        }
        let mut nodes = Vec::new();
        for (i, node) in self.urls.split(',').map(str::trim).enumerate() {
            let position = i + 1;
            if node.is_empty() {
                return Err(NodeListError::Invalid {
                    position,
                    node: String::new(),
                    reason: "the URL is empty".to_owned(),
                }
                .into());
            }
            let scheme = node.split_once("://").map(|(s, _)| s);
            match scheme {
                Some("nats" | "tls") | None => {}
                Some(other) => {
                    return Err(NodeListError::UnsupportedScheme {
                        position,
                        node: redact_url(node),
                        scheme: other.to_owned(),
                    }
                    .into());
                }
            }
            let addr = node
                .parse::<ServerAddr>()
                .map_err(|e| NodeListError::Invalid {
                    position,
                    node: redact_url(node),
                    reason: e.to_string(),
                })?;
            nodes.push(addr);
        }
        Ok(nodes)
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("urls", &self.url())
            .field("ack_wait", &self.ack_wait)
            .field("pull_wait", &self.pull_wait)
            .field("fetch_wait", &self.fetch_wait)
            .field("publish_timeout", &self.publish_timeout)
            .field("operation_timeout", &self.operation_timeout)
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
    fn debug_masks_the_password() {
        let config = NatsConfig::new("nats://u:hunter2@127.0.0.1:4222");
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
