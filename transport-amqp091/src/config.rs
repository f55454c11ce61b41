//! Connection settings, with the password kept out of every log line and error.

use std::fmt;
use std::time::Duration;

use retry_core::{NodeListError, QueueType, TlsConfig};
use transport_kit::settings::{ConnectionSettings, NodeList, NodeOrder};

use crate::nodes::{self, Node};

/// How to reach the broker, or the nodes of a cluster, and how long to wait for it.
///
/// `Debug` and [`redacted_url`](Self::redacted_url) never show the password.
///
/// A cluster is a list of nodes, from [`cluster`](Self::cluster) or a comma-separated URL
/// string: the connection goes to the first node that answers (in
/// [`NodeOrder`]), and when it drops, recovery moves it to any node that answers, each failed
/// node waiting out a backoff between [`with_reconnect_delay`](Self::with_reconnect_delay)'s
/// bounds before it is tried again. Every node is reached with the first URL's credentials,
/// virtual host and options, so they must agree ([`NodeListError`] otherwise).
///
/// The node list, its order, the connect, request and confirm timeouts and the TLS
/// settings are the [`ConnectionSettings`] every transport has ([`settings`](Self::settings)):
/// the request timeout is their operation timeout, the confirm timeout their publish
/// timeout. The rest is this transport's own.
///
/// ```
/// use transport_amqp091::AmqpConfig;
/// use std::time::Duration;
///
/// let config = AmqpConfig::new("amqp://app:s3cret@127.0.0.1:5672/%2f")
///     .with_confirm_timeout(Duration::from_secs(10))
///     .with_connection_name("orders-consumer");
/// assert_eq!(config.redacted_url(), "amqp://app:****@127.0.0.1:5672/%2f");
/// assert!(!format!("{config:?}").contains("s3cret"));
///
/// // Three nodes of one cluster, from one string (as in an AMQP_URL variable).
/// let cluster = AmqpConfig::new(
///     "amqp://app:s3cret@10.0.0.1:5672/%2f,amqp://app:s3cret@10.0.0.2:5672/%2f,amqp://app:s3cret@10.0.0.3:5672/%2f",
/// );
/// assert_eq!(cluster.nodes().unwrap().len(), 3);
/// assert!(cluster.is_cluster());
/// ```
#[derive(Clone)]
pub struct AmqpConfig {
    settings: ConnectionSettings,
    reconnect_delay: (Duration, Duration),
    connection_name: Option<String>,
    ack_flush_interval: Duration,
    auto_recover: bool,
    external_auth: bool,
}

impl AmqpConfig {
    /// Settings for `url` (`amqp://` or `amqps://`), with the defaults: a 30 s confirm
    /// timeout, a 20 s connect timeout, a 30 s request timeout, acks flushed at least every 20 ms, automatic recovery on, nodes in order,
    /// reconnect delays from 100 ms to 5 s.
    ///
    /// `url` may list the nodes of a cluster separated by commas. A list that cannot be used
    /// is reported by [`nodes`](Self::nodes) and refused by
    /// [`AmqpTransport::connect`](crate::AmqpTransport::connect); [`cluster`](Self::cluster)
    /// refuses it at once.
    pub fn new(url: impl Into<String>) -> Self {
        AmqpConfig {
            settings: ConnectionSettings::new(url)
                .with_publish_timeout(Duration::from_secs(30))
                .with_connect_timeout(Duration::from_secs(20))
                .with_operation_timeout(Duration::from_secs(30)),
            reconnect_delay: (Duration::from_millis(100), Duration::from_secs(5)),
            connection_name: None,
            ack_flush_interval: Duration::from_millis(20),
            auto_recover: true,
            external_auth: false,
        }
    }

    /// The connection settings every transport has, in place of these settings' own: the
    /// nodes and their order, the connect timeout, the request timeout (the settings'
    /// operation timeout), the confirm timeout (their publish timeout) and the TLS settings.
    /// What is this transport's own (reconnect delays, connection name, ack flushing,
    /// recovery, `EXTERNAL`) stays as it was.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp091::{AmqpConfig, ConnectionSettings};
    ///
    /// let shared = ConnectionSettings::new("amqp://app:s3cret@10.0.0.1:5672/%2f")
    ///     .with_publish_timeout(Duration::from_secs(5));
    /// let config = AmqpConfig::new("amqp://127.0.0.1:5672/%2f")
    ///     .with_connection_name("orders")
    ///     .with_settings(shared.clone());
    /// assert_eq!(config.confirm_timeout(), Duration::from_secs(5));
    /// assert_eq!(config.redacted_url(), "amqp://app:****@10.0.0.1:5672/%2f");
    /// assert_eq!(config.connection_name(), Some("orders"));
    /// assert_eq!(config.settings(), &shared);
    /// ```
    pub fn with_settings(mut self, settings: ConnectionSettings) -> Self {
        self.settings = settings;
        self
    }

    /// The connection settings every transport has: what the `with_*` methods of the node
    /// list, the timeouts and TLS set.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::new("amqp://127.0.0.1:5672/%2f")
    ///     .with_request_timeout(Duration::from_secs(10));
    /// assert_eq!(config.settings().operation_timeout(), Duration::from_secs(10));
    /// assert_eq!(config.settings().connect_timeout(), Duration::from_secs(20));
    /// ```
    pub fn settings(&self) -> &ConnectionSettings {
        &self.settings
    }

    /// Settings for the nodes of one cluster, one URL each: refused with a [`NodeListError`]
    /// naming the node when the list is empty, a URL does not parse, or a node differs from
    /// the first in anything but host and port.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use transport_amqp091::{AmqpConfig, AmqpTransport, NodeOrder};
    ///
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// let config = AmqpConfig::cluster([
    ///     "amqp://app:s3cret@10.0.0.1:5672/%2f",
    ///     "amqp://app:s3cret@10.0.0.2:5672/%2f",
    ///     "amqp://app:s3cret@10.0.0.3:5672/%2f",
    /// ])?
    /// .with_node_order(NodeOrder::Shuffled) // default: in order, the first node that answers
    /// .with_reconnect_delay(Duration::from_millis(100), Duration::from_secs(5)); // the defaults
    /// let transport = AmqpTransport::connect(config).await?;
    /// println!("on {}", transport.node().unwrap_or_default());
    /// # Ok(()) }
    /// ```
    ///
    /// Every refusal names the node, with the password replaced by `****`:
    ///
    /// ```
    /// use transport_amqp091::{AmqpConfig, NodeListError};
    ///
    /// let err = AmqpConfig::cluster(Vec::<String>::new()).unwrap_err();
    /// assert_eq!(err, NodeListError::Empty);
    ///
    /// let err = AmqpConfig::cluster([
    ///     "amqp://app:s3cret@10.0.0.1:5672/orders",
    ///     "amqp://app:s3cret@10.0.0.2:5672/billing",
    /// ])
    /// .unwrap_err();
    /// assert!(matches!(err, NodeListError::Differs { position: 2, field: "virtual host", .. }));
    /// assert!(!err.to_string().contains("s3cret"));
    /// ```
    pub fn cluster<I>(urls: I) -> Result<Self, NodeListError>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let urls: Vec<String> = urls.into_iter().map(Into::into).collect();
        // Parse the list as given, so that an empty URL in it is an error too.
        nodes::parse(&NodeList::from_urls(&urls))?;
        Ok(AmqpConfig::new(urls.join(",")))
    }

    /// The order the nodes are tried in (in order by default).
    pub fn with_node_order(mut self, order: NodeOrder) -> Self {
        self.settings = self.settings.with_node_order(order);
        self
    }

    /// The bounds of each node's reconnect backoff: a node that failed is tried again after
    /// `min`, doubling with each further failure up to `max` (a `max` below `min` counts as
    /// `min`). Also the pause before each new round over the nodes when none answers.
    pub fn with_reconnect_delay(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_delay = (min, max.max(min));
        self
    }

    /// The nodes, passwords redacted, in the order given; or why the list cannot be used.
    ///
    /// ```
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::cluster([
    ///     "amqp://app:s3cret@10.0.0.1:5672/%2f",
    ///     "amqp://app:s3cret@10.0.0.2:5672/%2f",
    /// ])?;
    /// assert_eq!(
    ///     config.nodes()?,
    ///     ["amqp://app:****@10.0.0.1:5672/%2f", "amqp://app:****@10.0.0.2:5672/%2f"]
    /// );
    /// # Ok::<(), transport_amqp091::NodeListError>(())
    /// ```
    pub fn nodes(&self) -> Result<Vec<String>, NodeListError> {
        Ok(self.node_list()?.into_iter().map(|n| n.address).collect())
    }

    /// Whether the settings name more than one node (of a list that can be used).
    pub fn is_cluster(&self) -> bool {
        self.node_list().is_ok_and(|n| n.len() > 1)
    }

    /// The queue type these settings call for: [`QueueType::Quorum`] for a cluster,
    /// [`QueueType::Classic`] for one node. A classic queue lives on one node of a cluster:
    /// while that node is down its messages cannot be reached, and they are lost with its
    /// disk. A quorum queue is replicated to a majority of nodes and keeps serving while a
    /// minority is down, and its dead-lettering can be at-least-once, which the retry
    /// topology's delay queues use.
    ///
    /// ```
    /// use retry_core::{HeaderValue, QueueType, RetryPolicy, TopologyPlan};
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::new("amqp://10.0.0.1:5672/%2f,amqp://10.0.0.2:5672/%2f,amqp://10.0.0.3:5672/%2f");
    /// let policy = RetryPolicy::default();
    /// let plan = TopologyPlan::builder("orders", &policy)
    ///     .with_queue_type(config.queue_type())
    ///     .with_replication_factor(3) // x-quorum-initial-group-size, on every queue
    ///     .build()?;
    /// assert_eq!(plan.queue_type(), QueueType::Quorum);
    /// for queue in plan.queues() {
    ///     let args = queue.arguments.to_headers();
    ///     assert_eq!(args.get("x-queue-type"), Some(&HeaderValue::from("quorum")));
    ///     assert_eq!(args.get("x-quorum-initial-group-size"), Some(&HeaderValue::Int(3)));
    /// }
    /// assert_eq!(AmqpConfig::new("amqp://10.0.0.1:5672/%2f").queue_type(), QueueType::Classic);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn queue_type(&self) -> QueueType {
        if self.is_cluster() {
            QueueType::Quorum
        } else {
            QueueType::Classic
        }
    }

    /// The node order.
    pub fn node_order(&self) -> NodeOrder {
        self.settings.node_order()
    }

    /// The reconnect backoff's bounds, `(min, max)`.
    pub fn reconnect_delay(&self) -> (Duration, Duration) {
        self.reconnect_delay
    }

    /// How long a publish may wait for the broker's confirm before it counts as failed (and
    /// the original is requeued).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_publish_timeout(timeout);
        self
    }

    /// How long opening a connection may take, from the TCP connect to the end of the AMQP
    /// handshake, when connecting and when a stalled recovery is replaced by a new connection
    /// (20 s by default). A node that accepts TCP but never answers the handshake is given up
    /// on after it, and the next node, or the same one again later, is tried.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::new("amqp://127.0.0.1:5672/%2f")
    ///     .with_connect_timeout(Duration::from_secs(5));
    /// assert_eq!(config.connect_timeout(), Duration::from_secs(5));
    /// ```
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_connect_timeout(timeout);
        self
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.settings.connect_timeout()
    }

    /// How long a request to the broker other than a publish may take (30 s by default):
    /// writing an acknowledgement, a requeue or a reject, a `basic.get`, a passive declare,
    /// opening a consuming channel. A connection that stops taking writes (a stalled one,
    /// or one whose peer vanished without a reset) would otherwise hold the request, and
    /// everything queued behind it, for good. A settlement that fails this way leaves the
    /// delivery with the broker, which redelivers it; a fetch or a watch that fails is
    /// tried again by the consumer.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::new("amqp://127.0.0.1:5672/%2f")
    ///     .with_request_timeout(Duration::from_secs(10));
    /// assert_eq!(config.request_timeout(), Duration::from_secs(10));
    /// ```
    pub fn with_request_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_operation_timeout(timeout);
        self
    }

    /// The request timeout.
    pub fn request_timeout(&self) -> Duration {
        self.settings.operation_timeout()
    }

    /// The connection name the broker shows (and `rabbitmqctl list_connections` prints).
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// The longest an acknowledgement waits to be batched with others.
    pub fn with_ack_flush_interval(mut self, interval: Duration) -> Self {
        self.ack_flush_interval = interval;
        self
    }

    /// Whether to reconnect by itself when the connection drops (on by default).
    pub fn with_auto_recover(mut self, on: bool) -> Self {
        self.auto_recover = on;
        self
    }

    /// The TLS settings of `amqps://` URLs: which CAs to trust (the platform's roots by
    /// default), a client certificate and key to present, and the name the server's
    /// certificate is checked against (and sent as SNI) in place of the URL's host. Every
    /// node of a cluster is reached with the same settings.
    ///
    /// The files are read when the transport connects. A refused handshake, or a file that
    /// cannot be used, fails [`AmqpTransport::connect`](crate::AmqpTransport::connect) with
    /// [`TransportError::Tls`](retry_core::TransportError::Tls) naming the node's
    /// `host:port` and the [`TlsFailure`](retry_core::TlsFailure); an `amqps://` node is
    /// never reached in plain TCP. Without this call, an `amqps://` URL trusts the
    /// platform's roots and checks the URL's host. Given with an `amqp://` URL, the settings
    /// are refused when connecting (with [`TlsFailure::Configuration`](retry_core::TlsFailure::Configuration)) rather than
    /// ignored: the password would travel in clear.
    ///
    /// The guide's chapter on TLS (`docs/tls.md`) shows the broker's side.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_amqp091::AmqpConfig;
    ///
    /// // A broker reached by its address, whose certificate names `rabbit.internal`.
    /// let config = AmqpConfig::new("amqps://app:s3cret@10.0.0.7:5671/%2f").with_tls(
    ///     TlsConfig::new()
    ///         .with_ca_file("/etc/app/tls/ca.pem")
    ///         .with_server_name("rabbit.internal"),
    /// );
    /// assert_eq!(config.tls().unwrap().server_name(), Some("rabbit.internal"));
    /// assert!(!format!("{config:?}").contains("s3cret"));
    /// ```
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.settings = self.settings.with_tls(tls);
        self
    }

    /// The TLS settings, if given.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.settings.tls()
    }

    /// Logs in with SASL `EXTERNAL`: the broker takes the user from the client certificate
    /// of [`with_tls`](Self::with_tls) (on RabbitMQ, with the `rabbitmq_auth_mechanism_ssl`
    /// plugin, by default from the certificate's distinguished name, or its common name with
    /// `ssl_cert_login_from = common_name`), and any user and password in the URL are not
    /// sent. Off by default: it is never chosen by itself, so that a client certificate
    /// can be presented for the TLS handshake alone while logging in with a password.
    ///
    /// Connecting without a client certificate is refused with
    /// [`TlsFailure::Configuration`](retry_core::TlsFailure::Configuration). The URL option
    /// `?auth_mechanism=external` does the same as this call.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_amqp091::AmqpConfig;
    ///
    /// let config = AmqpConfig::new("amqps://rabbit.internal:5671/%2f")
    ///     .with_tls(
    ///         TlsConfig::new()
    ///             .with_ca_file("/etc/app/tls/ca.pem")
    ///             .with_client_identity("/etc/app/tls/client.pem", "/etc/app/tls/client.key"),
    ///     )
    ///     .with_external_auth();
    /// assert!(config.external_auth());
    /// ```
    pub fn with_external_auth(mut self) -> Self {
        self.external_auth = true;
        self
    }

    /// Whether the login is SASL `EXTERNAL`.
    pub fn external_auth(&self) -> bool {
        self.external_auth
    }

    /// The confirm timeout.
    pub fn confirm_timeout(&self) -> Duration {
        self.settings.publish_timeout()
    }

    /// The connection name, if set.
    pub fn connection_name(&self) -> Option<&str> {
        self.connection_name.as_deref()
    }

    /// The ack flush interval.
    pub fn ack_flush_interval(&self) -> Duration {
        self.ack_flush_interval
    }

    /// Whether automatic recovery is on.
    pub fn auto_recover(&self) -> bool {
        self.auto_recover
    }

    /// The URL with its password replaced by `****` ([`PASSWORD_MASK`](retry_core::PASSWORD_MASK);
    /// every node's, for a list).
    pub fn redacted_url(&self) -> String {
        self.settings.redacted_url()
    }

    /// The nodes, parsed.
    pub(crate) fn node_list(&self) -> Result<Vec<Node>, NodeListError> {
        nodes::parse(self.settings.nodes())
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("settings", &self.settings)
            .field("reconnect_delay", &self.reconnect_delay)
            .field("connection_name", &self.connection_name)
            .field("ack_flush_interval", &self.ack_flush_interval)
            .field("auto_recover", &self.auto_recover)
            .field("external_auth", &self.external_auth)
            .finish()
    }
}
