//! Connection settings every transport has: the nodes to reach, the order they are tried in,
//! how long connecting, a request and a publish may take, and the TLS settings of TLS URLs.
//!
//! A transport's configuration holds one [`ConnectionSettings`] and adds what is its own
//! (a prefetch, a profile, replicas). Its builder methods forward to the settings under the
//! transport's own names where they differ (AMQP 0-9-1's `confirm_timeout` is the publish
//! timeout here, its `request_timeout` the operation timeout), and it starts from its own
//! defaults.
//!
//! * [`NodeList`]: the node URLs as given, split and trimmed, each with its place in the
//!   list and its address with the password replaced by `****`. A transport parses each
//!   URL with its broker client's parser through [`NodeList::parse_with`], which numbers
//!   the nodes and refuses an empty list; every refusal is a
//!   [`NodeListError`](retry_core::NodeListError) that names the node at fault.
//! * [`NodeOrder`]: in order, or shuffled.
//! * With the feature `tls`: `TlsClient`, the rustls client configuration built from a
//!   [`TlsConfig`], with the name the server's certificate is checked against; and
//!   `failure_in`, which finds the [`TlsFailure`](retry_core::TlsFailure) a refused
//!   handshake names in an error's chain.
//!
//! ```
//! use std::time::Duration;
//! use transport_kit::settings::{ConnectionSettings, NodeOrder};
//!
//! let settings = ConnectionSettings::new("amqp://app:s3cret@10.0.0.1:5672,amqp://app:s3cret@10.0.0.2:5672")
//!     .with_node_order(NodeOrder::Shuffled)
//!     .with_connect_timeout(Duration::from_secs(5));
//! assert_eq!(settings.nodes().len(), 2);
//! assert_eq!(settings.redacted_url(), "amqp://app:****@10.0.0.1:5672,amqp://app:****@10.0.0.2:5672");
//! assert!(!format!("{settings:?}").contains("s3cret"));
//! ```

use std::fmt;
use std::time::Duration;

use retry_core::TlsConfig;

mod nodes;
#[cfg(feature = "tls")]
mod tls;

pub use nodes::{NodeList, NodeOrder, NodeUrl};
#[cfg(feature = "tls")]
pub use tls::{DefaultRoots, TlsClient, failure_in};

/// The default of each timeout of [`ConnectionSettings::new`]: 10 s.
///
/// ```
/// use std::time::Duration;
/// use transport_kit::settings::{ConnectionSettings, DEFAULT_TIMEOUT};
///
/// assert_eq!(DEFAULT_TIMEOUT, Duration::from_secs(10));
/// assert_eq!(ConnectionSettings::new("amqp://h").publish_timeout(), DEFAULT_TIMEOUT);
/// ```
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a transport connects, and how long it waits: the node list and its order, three
/// timeouts and the TLS settings.
///
/// Built with [`new`](Self::new) and the `with_*` methods. `new`'s defaults are the kit's
/// (nodes in order, [`DEFAULT_TIMEOUT`] for each timeout, no TLS settings); a transport's
/// configuration starts from its own, which its `new` documents. Nothing is checked here:
/// a transport checks the nodes when it parses them ([`NodeList::parse_with`]) and the
/// TLS settings when it connects.
///
/// `Debug` and [`redacted_url`](Self::redacted_url) never show a password.
///
/// ```
/// use std::time::Duration;
/// use retry_core::TlsConfig;
/// use transport_kit::settings::{ConnectionSettings, NodeOrder};
///
/// let settings = ConnectionSettings::new("amqps://app:s3cret@10.0.0.7:5671/%2f")
///     .with_operation_timeout(Duration::from_secs(30))
///     .with_tls(TlsConfig::new().with_server_name("rabbit.internal"));
/// assert_eq!(settings.node_order(), NodeOrder::InOrder);
/// assert_eq!(settings.operation_timeout(), Duration::from_secs(30));
/// assert_eq!(settings.tls().and_then(TlsConfig::server_name), Some("rabbit.internal"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectionSettings {
    nodes: NodeList,
    node_order: NodeOrder,
    connect_timeout: Duration,
    operation_timeout: Duration,
    publish_timeout: Duration,
    tls: Option<TlsConfig>,
}

impl ConnectionSettings {
    /// Settings for `urls`: one URL, or the nodes of a cluster separated by commas
    /// ([`NodeList::new`]), with the kit's defaults: nodes in order, [`DEFAULT_TIMEOUT`] for
    /// connecting, for a request and for a publish, no TLS settings.
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, DEFAULT_TIMEOUT};
    ///
    /// let settings = ConnectionSettings::new("nats://10.0.0.1:4222, nats://10.0.0.2:4222");
    /// assert_eq!(settings.nodes().len(), 2);
    /// assert_eq!(settings.connect_timeout(), DEFAULT_TIMEOUT);
    /// assert!(settings.tls().is_none());
    /// ```
    pub fn new(urls: impl Into<String>) -> Self {
        ConnectionSettings::from_nodes(NodeList::new(&urls.into()))
    }

    /// Settings for `nodes`, with the kit's defaults (see [`new`](Self::new)).
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, NodeList};
    ///
    /// // One URL each: an empty one keeps its place, for the transport to refuse.
    /// let settings = ConnectionSettings::from_nodes(NodeList::from_urls(["nats://h1:4222", ""]));
    /// assert_eq!(settings.nodes().len(), 2);
    /// assert_eq!(settings.redacted_url(), "nats://h1:4222,");
    /// ```
    pub fn from_nodes(nodes: NodeList) -> Self {
        ConnectionSettings {
            nodes,
            node_order: NodeOrder::InOrder,
            connect_timeout: DEFAULT_TIMEOUT,
            operation_timeout: DEFAULT_TIMEOUT,
            publish_timeout: DEFAULT_TIMEOUT,
            tls: None,
        }
    }

    /// The nodes, as given.
    ///
    /// ```
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqp://h1,amqp://h2");
    /// let places: Vec<usize> = settings.nodes().urls().map(|n| n.position()).collect();
    /// assert_eq!(places, [1, 2]);
    /// ```
    pub fn nodes(&self) -> &NodeList {
        &self.nodes
    }

    /// Every node's URL with its password replaced by `****`
    /// ([`PASSWORD_MASK`](retry_core::PASSWORD_MASK)), separated by commas: for logs and
    /// errors.
    ///
    /// ```
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqp://app:s3cret@h1:5672/%2f");
    /// assert_eq!(settings.redacted_url(), "amqp://app:****@h1:5672/%2f");
    /// ```
    pub fn redacted_url(&self) -> String {
        self.nodes.redacted()
    }

    /// The order the nodes are tried in. Default: [`NodeOrder::InOrder`].
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, NodeOrder};
    ///
    /// let settings = ConnectionSettings::new("amqp://h1,amqp://h2").with_node_order(NodeOrder::Shuffled);
    /// assert_eq!(settings.node_order(), NodeOrder::Shuffled);
    /// ```
    pub fn with_node_order(mut self, order: NodeOrder) -> Self {
        self.node_order = order;
        self
    }

    /// The node order.
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, NodeOrder};
    ///
    /// assert_eq!(ConnectionSettings::new("amqp://h").node_order(), NodeOrder::InOrder);
    /// ```
    pub fn node_order(&self) -> NodeOrder {
        self.node_order
    }

    /// How long opening a connection may take: TCP, TLS and the protocol's handshake.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqp://h").with_connect_timeout(Duration::from_secs(20));
    /// assert_eq!(settings.connect_timeout(), Duration::from_secs(20));
    /// ```
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The connect timeout.
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, DEFAULT_TIMEOUT};
    ///
    /// assert_eq!(ConnectionSettings::new("amqp://h").connect_timeout(), DEFAULT_TIMEOUT);
    /// ```
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// How long a request to the broker other than a publish may take (a settlement, a
    /// fetch, a lookup): AMQP 0-9-1's request timeout, AMQP 1.0's and NATS' operation
    /// timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqp://h").with_operation_timeout(Duration::from_secs(30));
    /// assert_eq!(settings.operation_timeout(), Duration::from_secs(30));
    /// ```
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// The operation timeout.
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, DEFAULT_TIMEOUT};
    ///
    /// assert_eq!(ConnectionSettings::new("amqp://h").operation_timeout(), DEFAULT_TIMEOUT);
    /// ```
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// How long a publish may wait for the broker's acceptance (AMQP 0-9-1's confirm, AMQP
    /// 1.0's outcome, NATS' PubAck) before it counts as failed and the original is requeued:
    /// AMQP 0-9-1's confirm timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqp://h").with_publish_timeout(Duration::from_secs(5));
    /// assert_eq!(settings.publish_timeout(), Duration::from_secs(5));
    /// ```
    pub fn with_publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// The publish timeout.
    ///
    /// ```
    /// use transport_kit::settings::{ConnectionSettings, DEFAULT_TIMEOUT};
    ///
    /// assert_eq!(ConnectionSettings::new("amqp://h").publish_timeout(), DEFAULT_TIMEOUT);
    /// ```
    pub fn publish_timeout(&self) -> Duration {
        self.publish_timeout
    }

    /// The TLS settings of TLS URLs (`amqps://`): which CAs to trust, a client certificate
    /// to present, the name the server's certificate is checked against. Every node is
    /// reached with the same settings. A transport that cannot use them refuses them when
    /// it connects rather than ignoring them.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqps://h:5671")
    ///     .with_tls(TlsConfig::new().with_ca_file("/etc/app/tls/ca.pem"));
    /// assert_eq!(settings.tls().unwrap().ca_files().len(), 1);
    /// ```
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// No TLS settings: a TLS URL gets the transport's defaults.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// let settings = ConnectionSettings::new("amqps://h").with_tls(TlsConfig::new()).without_tls();
    /// assert!(settings.tls().is_none());
    /// ```
    pub fn without_tls(mut self) -> Self {
        self.tls = None;
        self
    }

    /// The TLS settings, if given.
    ///
    /// ```
    /// use transport_kit::settings::ConnectionSettings;
    ///
    /// assert!(ConnectionSettings::new("amqps://h").tls().is_none());
    /// ```
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.tls.as_ref()
    }
}

impl fmt::Debug for ConnectionSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionSettings")
            .field("url", &self.redacted_url())
            .field("node_order", &self.node_order)
            .field("connect_timeout", &self.connect_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .field("publish_timeout", &self.publish_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_every_setting_and_no_password() {
        let settings = ConnectionSettings::new("amqp://u:hunter2@h1,amqp://u:hunter2@h2")
            .with_tls(TlsConfig::new().with_ca_file("/ca.pem"));
        let shown = format!("{settings:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        for field in [
            "amqp://u:****@h1,amqp://u:****@h2",
            "InOrder",
            "connect_timeout: 10s",
            "operation_timeout: 10s",
            "publish_timeout: 10s",
            "/ca.pem",
        ] {
            assert!(shown.contains(field), "{field} in {shown}");
        }
    }
}
