//! Connection settings, with the password kept out of every log line and error.

use std::fmt;
use std::time::Duration;

use retry_core::{NodeListError, QueueType, TlsConfig, redact_url};

use crate::nodes::{self, Node, NodeOrder};

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
    url: String,
    nodes: Result<Vec<Node>, NodeListError>,
    node_order: NodeOrder,
    reconnect_delay: (Duration, Duration),
    confirm_timeout: Duration,
    connect_timeout: Duration,
    request_timeout: Duration,
    connection_name: Option<String>,
    ack_flush_interval: Duration,
    auto_recover: bool,
    tls: Option<TlsConfig>,
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
        let url = url.into();
        AmqpConfig {
            nodes: nodes::parse(&nodes::split(&url)),
            url,
            node_order: NodeOrder::InOrder,
            reconnect_delay: (Duration::from_millis(100), Duration::from_secs(5)),
            confirm_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(20),
            request_timeout: Duration::from_secs(30),
            connection_name: None,
            ack_flush_interval: Duration::from_millis(20),
            auto_recover: true,
            tls: None,
            external_auth: false,
        }
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
        let config = AmqpConfig::new(urls.join(","));
        // Parse the list as given, so that an empty URL in it is an error too.
        nodes::parse(&urls)?;
        Ok(config)
    }

    /// The order the nodes are tried in (in order by default).
    pub fn with_node_order(mut self, order: NodeOrder) -> Self {
        self.node_order = order;
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
        Ok(self
            .node_list()?
            .iter()
            .map(|n| n.address.clone())
            .collect())
    }

    /// Whether the settings name more than one node.
    pub fn is_cluster(&self) -> bool {
        self.nodes.as_ref().is_ok_and(|n| n.len() > 1)
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
        self.node_order
    }

    /// The reconnect backoff's bounds, `(min, max)`.
    pub fn reconnect_delay(&self) -> (Duration, Duration) {
        self.reconnect_delay
    }

    /// How long a publish may wait for the broker's confirm before it counts as failed (and
    /// the original is requeued).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
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
        self.connect_timeout = timeout;
        self
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
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
        self.request_timeout = timeout;
        self
    }

    /// The request timeout.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
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
        self.tls = Some(tls);
        self
    }

    /// The TLS settings, if given.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.tls.as_ref()
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
        self.confirm_timeout
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
        match &self.nodes {
            Ok(nodes) => nodes
                .iter()
                .map(|n| n.address.as_str())
                .collect::<Vec<_>>()
                .join(","),
            Err(_) => nodes::split(&self.url)
                .iter()
                .map(|u| redact_url(u))
                .collect::<Vec<_>>()
                .join(","),
        }
    }

    pub(crate) fn node_list(&self) -> Result<&[Node], NodeListError> {
        self.nodes.as_deref().map_err(Clone::clone)
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.redacted_url())
            .field("node_order", &self.node_order)
            .field("reconnect_delay", &self.reconnect_delay)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("connection_name", &self.connection_name)
            .field("ack_flush_interval", &self.ack_flush_interval)
            .field("auto_recover", &self.auto_recover)
            .field("tls", &self.tls)
            .field("external_auth", &self.external_auth)
            .finish()
    }
}
