//! `Amqp10Config`: where to connect and how long to wait, with the password kept out of
//! every log line, error and `Debug` output.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use retry_core::{NodeListError, PASSWORD_MASK, TlsConfig, TlsFailure};
use transport_kit::settings::{ConnectionSettings, DefaultRoots, NodeUrl, TlsClient};

use crate::profile::BrokerProfile;

/// Settings of an [`Amqp10Transport`](crate::Amqp10Transport). Built with `with_*` methods;
/// each documents its default.
///
/// The URL is `amqp://user:password@host:port[/vhost]`, or `amqps://` for TLS (port 5671 by
/// default). On the RabbitMQ profile a path selects the virtual host (`/%2f` or none is the
/// default one).
///
/// The nodes of a cluster are given as several URLs separated by commas, or with
/// [`cluster`](Self::cluster). Every connection (publishing, consuming, fetching) opens on
/// the node that answered last, or failing that on the next node of the list that answers,
/// so a connection lost with its node comes back on another; each move is logged with the
/// node it left and the node it reached.
///
/// The node list, its order, the connect, operation and publish timeouts and the TLS
/// settings are the [`ConnectionSettings`] every transport has ([`settings`](Self::settings)).
/// The rest is this transport's own.
///
/// ```
/// use std::time::Duration;
/// use transport_amqp10::{Amqp10Config, BrokerProfile};
///
/// let config = Amqp10Config::new("amqp://guest:s3cret@127.0.0.1:5672")
///     .with_profile(BrokerProfile::RabbitMq3)
///     .with_publish_timeout(Duration::from_secs(2));
/// assert_eq!(config.publish_timeout(), Duration::from_secs(2));
/// assert!(!format!("{config:?}").contains("s3cret"));
/// assert_eq!(config.redacted_url(), "amqp://guest:****@127.0.0.1:5672");
///
/// let cluster = Amqp10Config::cluster(["amqp://guest:s3cret@10.0.0.1:5672", "amqp://guest:s3cret@10.0.0.2:5672"])?;
/// assert_eq!(cluster.redacted_url(), "amqp://guest:****@10.0.0.1:5672,amqp://guest:****@10.0.0.2:5672");
/// # Ok::<(), transport_amqp10::NodeListError>(())
/// ```
#[derive(Clone)]
pub struct Amqp10Config {
    settings: ConnectionSettings,
    /// A rustls configuration given whole: used in place of the settings' TLS settings,
    /// which are then none (whichever was given last wins).
    tls_config: Option<Arc<rustls::ClientConfig>>,
    profile: BrokerProfile,
    container_id: Option<String>,
    fetch_wait: Duration,
    reverify_after: Duration,
    idle_timeout: Option<Duration>,
    external_auth: bool,
}

impl Amqp10Config {
    /// Settings for `url`, with the defaults below (nodes in order).
    pub fn new(url: impl Into<String>) -> Self {
        Amqp10Config {
            settings: ConnectionSettings::new(url)
                .with_connect_timeout(Duration::from_secs(10))
                .with_publish_timeout(Duration::from_secs(5))
                .with_operation_timeout(Duration::from_secs(10)),
            tls_config: None,
            profile: BrokerProfile::RabbitMq3,
            container_id: None,
            fetch_wait: Duration::from_millis(250),
            reverify_after: Duration::from_secs(5),
            idle_timeout: Some(Duration::from_secs(60)),
            external_auth: false,
        }
    }

    /// The connection settings every transport has, in place of these settings' own: the
    /// nodes and their order, the connect, publish and operation timeouts and the TLS
    /// settings. TLS settings in them replace a configuration given with
    /// [`with_tls_config`](Self::with_tls_config); without, it stays. What is this
    /// transport's own (profile, container id, fetch wait, re-verification, idle timeout,
    /// `EXTERNAL`) stays as it was.
    ///
    /// With [`NodeOrder::Shuffled`](transport_kit::settings::NodeOrder::Shuffled) the list
    /// is shuffled once per transport; connections still open on the node that answered
    /// last first.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp10::{Amqp10Config, ConnectionSettings, NodeOrder};
    ///
    /// let shared = ConnectionSettings::new("amqp://guest:s3cret@10.0.0.1:5672,amqp://guest:s3cret@10.0.0.2:5672")
    ///     .with_node_order(NodeOrder::Shuffled)
    ///     .with_publish_timeout(Duration::from_secs(2));
    /// let config = Amqp10Config::new("amqp://127.0.0.1:5672")
    ///     .with_container_id("orders")
    ///     .with_settings(shared.clone());
    /// assert_eq!(config.publish_timeout(), Duration::from_secs(2));
    /// assert_eq!(config.container_id(), Some("orders"));
    /// assert_eq!(config.settings(), &shared);
    /// ```
    pub fn with_settings(mut self, settings: ConnectionSettings) -> Self {
        if settings.tls().is_some() {
            self.tls_config = None;
        }
        self.settings = settings;
        self
    }

    /// The connection settings every transport has: what the `with_*` methods of the
    /// timeouts and of [`with_tls`](Self::with_tls) set, and the nodes.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp10::Amqp10Config;
    ///
    /// let config = Amqp10Config::new("amqp://127.0.0.1:5672");
    /// assert_eq!(config.settings().publish_timeout(), Duration::from_secs(5));
    /// assert_eq!(config.settings().nodes().len(), 1);
    /// ```
    pub fn settings(&self) -> &ConnectionSettings {
        &self.settings
    }

    /// Settings for the nodes of one cluster, one URL each; refused with a [`NodeListError`]
    /// naming the node when the list is empty or a URL cannot be used.
    pub fn cluster<I>(urls: I) -> Result<Self, NodeListError>
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let urls: Vec<String> = urls.into_iter().map(Into::into).collect();
        if urls.iter().any(|u| u.trim().is_empty()) {
            return Err(NodeListError::Empty);
        }
        let config = Amqp10Config::new(urls.join(","));
        config.node_list()?;
        Ok(config)
    }

    /// The broker profile. Default: [`BrokerProfile::RabbitMq3`].
    pub fn with_profile(mut self, profile: BrokerProfile) -> Self {
        self.profile = profile;
        self
    }

    /// The AMQP container id this client announces. Default: `retry-engine-<pid>`.
    pub fn with_container_id(mut self, id: impl Into<String>) -> Self {
        self.container_id = Some(id.into());
        self
    }

    /// How long opening a connection (TCP, TLS, SASL, open) may take. Default: 10 s.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_connect_timeout(timeout);
        self
    }

    /// How long a publish may wait for the broker's outcome before it counts as failed and
    /// the original is requeued. Default: 5 s. Every send has this bound: on RabbitMQ 3.x a
    /// send refused by a full `reject-publish` queue never resolves (the broker's session
    /// process fails and the connection closes).
    pub fn with_publish_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_publish_timeout(timeout);
        self
    }

    /// How long attaching or detaching a link, verifying an address or settling a delivery
    /// may take. Default: 10 s.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.settings = self.settings.with_operation_timeout(timeout);
        self
    }

    /// How long a [`fetch`](retry_core::Transport::fetch) waits for a message after granting
    /// its one credit, before it takes the credit back and reports the queue empty. Default:
    /// 250 ms; never more than the operation timeout.
    ///
    /// On RabbitMQ a fetch grants only after the broker counted a ready message, and waits on
    /// past this for a message the broker's answer to the grant says is on its way: the wait
    /// ends a fetch only when another consumer took the message first. On a generic broker,
    /// which need not count, every empty fetch waits this long. Too short, and there a message
    /// still on its way when the credit is taken back returns to the queue marked
    /// redelivered; too long, and each empty fetch keeps the consumer's work lane paused for
    /// longer.
    pub fn with_fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait;
        self
    }

    /// How old the verification of an address may be when a clone is sent to it: a send to
    /// an address verified longer ago than this probes it again first, and fails with
    /// [`TransportError::MissingAddress`](retry_core::TransportError::MissingAddress) if it
    /// is gone (the engine then requeues the original instead of acknowledging it).
    /// Default: 5 s.
    ///
    /// This bounds a window that remains: RabbitMQ's AMQP 1.0 plugin offers nothing like
    /// AMQP 0-9-1's `mandatory`, and accepts a send to a missing queue and drops it. So
    /// between a queue's deletion (an operator fixing a conflict deletes and recreates it)
    /// and the next verification of its address, clones sent to it are accepted and lost,
    /// and their originals acknowledged. That window lasts at most this long. Every new
    /// publishing connection verifies each address again before its first send,
    /// whatever the age.
    ///
    /// The cost is one probe per address per age: a session begun and a link attached (two
    /// round trips; the link is detached and the session ended in the background), taken by
    /// the first send after the age runs out. Concurrent sends to that address wait for that
    /// one probe; sends to other addresses go on. `Duration::ZERO` probes before every send
    /// (a probe that finishes while a send waits still counts for it), which serialises
    /// the sends to an address behind its probes and still leaves the moments between a
    /// probe and its send; `Duration::MAX` never probes again on one connection. See the
    /// crate documentation for the measured cost.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_amqp10::Amqp10Config;
    ///
    /// let config = Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672");
    /// assert_eq!(config.reverify_after(), Duration::from_secs(5));
    /// // Notice a deleted queue within a second, at five times the probing.
    /// let config = config.with_reverify_after(Duration::from_secs(1));
    /// assert_eq!(config.reverify_after(), Duration::from_secs(1));
    /// ```
    pub fn with_reverify_after(mut self, age: Duration) -> Self {
        self.reverify_after = age;
        self
    }

    /// The idle timeout announced to the broker, which makes both ends send heartbeats and
    /// notice a dead peer; `None` announces none. Default: 60 s.
    pub fn with_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// What `amqps://` connections trust and present: CA files in place of the public
    /// roots, a client certificate and key, a server name in place of the URL's host.
    /// Default: the `webpki-roots` certificate authorities, the URL's host, no client
    /// certificate. Replaces a configuration given with
    /// [`with_tls_config`](Self::with_tls_config).
    ///
    /// The files are read each time a connection opens (so a renewed certificate is picked
    /// up by the next one); one that cannot be read or parsed fails that connection with
    /// [`TransportError::Tls`](retry_core::TransportError::Tls) and
    /// [`TlsFailure::Configuration`](retry_core::TlsFailure::Configuration) naming the file.
    /// A refused handshake fails with the same variant naming the check (unknown CA, wrong
    /// host name, expired certificate, a server that does not speak TLS, a server's alert);
    /// an `amqps://` URL never falls back to plain TCP.
    ///
    /// A client certificate is presented during the handshake; the login is still the
    /// URL's (SASL PLAIN, or ANONYMOUS without credentials) unless
    /// [`with_external_auth`](Self::with_external_auth) logs in as the certificate.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_amqp10::Amqp10Config;
    ///
    /// let config = Amqp10Config::new("amqps://app:s3cret@10.0.0.5:5671")
    ///     .with_tls(
    ///         TlsConfig::new()
    ///             .with_ca_file("/etc/rabbitmq/ca.pem")
    ///             .with_client_identity("/etc/app/client.pem", "/etc/app/client.key")
    ///             // The broker's certificate names rabbit.internal, not the address.
    ///             .with_server_name("rabbit.internal"),
    ///     );
    /// assert_eq!(config.tls().and_then(|t| t.server_name()), Some("rabbit.internal"));
    /// assert!(!format!("{config:?}").contains("s3cret"));
    /// ```
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.settings = self.settings.with_tls(tls);
        self.tls_config = None;
        self
    }

    /// A rustls client configuration for `amqps://` URLs, used as given: for what
    /// [`with_tls`](Self::with_tls) does not cover (another crypto provider, a custom
    /// verifier). The server name is the URL's host. Replaces settings given with
    /// `with_tls`. Default: see `with_tls`.
    pub fn with_tls_config(mut self, tls: Arc<rustls::ClientConfig>) -> Self {
        self.settings = self.settings.without_tls();
        self.tls_config = Some(tls);
        self
    }

    /// Logs in with SASL EXTERNAL: as the client certificate of the TLS connection
    /// (given with [`with_tls`](Self::with_tls)), instead of with the URL's user and
    /// password, which are then not used. Default: off (SASL PLAIN with the URL's
    /// credentials, ANONYMOUS without).
    ///
    /// Only `amqps://` URLs can: on `amqp://` connecting fails with
    /// [`TransportError::Unsupported`](retry_core::TransportError::Unsupported). The broker
    /// must offer EXTERNAL; RabbitMQ does with the `rabbitmq_auth_mechanism_ssl` plugin,
    /// `EXTERNAL` in `auth_mechanisms`, and a TLS listener that asks for client certificates
    /// (`ssl_options.verify = verify_peer`); the user is the certificate's subject, or its
    /// common name with `ssl_cert_login_from = common_name`, and needs no password.
    ///
    /// ```
    /// use retry_core::TlsConfig;
    /// use transport_amqp10::Amqp10Config;
    ///
    /// let config = Amqp10Config::new("amqps://rabbit.internal:5671")
    ///     .with_tls(
    ///         TlsConfig::new()
    ///             .with_ca_file("/etc/rabbitmq/ca.pem")
    ///             .with_client_identity("/etc/app/client.pem", "/etc/app/client.key"),
    ///     )
    ///     .with_external_auth();
    /// assert!(config.external_auth());
    /// ```
    pub fn with_external_auth(mut self) -> Self {
        self.external_auth = true;
        self
    }

    /// Whether the login is SASL EXTERNAL.
    pub fn external_auth(&self) -> bool {
        self.external_auth
    }

    /// The broker profile.
    pub fn profile(&self) -> BrokerProfile {
        self.profile
    }

    /// The container id, if one was set.
    pub fn container_id(&self) -> Option<&str> {
        self.container_id.as_deref()
    }

    /// The connect timeout.
    pub fn connect_timeout(&self) -> Duration {
        self.settings.connect_timeout()
    }

    /// The publish timeout.
    pub fn publish_timeout(&self) -> Duration {
        self.settings.publish_timeout()
    }

    /// The operation timeout.
    pub fn operation_timeout(&self) -> Duration {
        self.settings.operation_timeout()
    }

    /// The fetch wait.
    pub fn fetch_wait(&self) -> Duration {
        self.fetch_wait
    }

    /// The re-verification age.
    pub fn reverify_after(&self) -> Duration {
        self.reverify_after
    }

    /// The idle timeout.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    /// The TLS settings given with [`with_tls`](Self::with_tls), if any.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.settings.tls()
    }

    /// The rustls configuration given with [`with_tls_config`](Self::with_tls_config), if
    /// any.
    pub fn tls_config(&self) -> Option<&Arc<rustls::ClientConfig>> {
        self.tls_config.as_ref()
    }

    /// The TLS client of a connection: the configuration given whole, or one built from the
    /// TLS settings (the bundled public roots without a CA file), their files read now.
    pub(crate) fn tls_client(&self) -> Result<TlsClient, TlsFailure> {
        match (&self.tls_config, self.settings.tls()) {
            (Some(given), _) => Ok(TlsClient::from_config(Arc::clone(given))),
            (None, Some(settings)) => TlsClient::new(settings, DefaultRoots::Bundled),
            (None, None) => TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled),
        }
    }

    /// The URL with its password replaced by `****`
    /// ([`PASSWORD_MASK`](retry_core::PASSWORD_MASK)), for logs (every node's, for a list).
    pub fn redacted_url(&self) -> String {
        self.settings.redacted_url()
    }

    /// The nodes, parsed, in the settings' order.
    pub(crate) fn node_list(&self) -> Result<Nodes, NodeListError> {
        let parsed = self
            .settings
            .nodes()
            .parse_with(|url, _: &[Endpoint]| Endpoint::parse(url, &self.profile))?;
        let order = self.settings.node_order().arrange(parsed.len());
        Ok(Nodes {
            list: order.into_iter().map(|i| parsed[i].clone()).collect(),
            last: Arc::new(AtomicUsize::new(NONE_YET)),
        })
    }

    #[cfg(test)]
    pub(crate) fn endpoint(&self) -> Result<Endpoint, NodeListError> {
        Ok(self.node_list()?.list[0].clone())
    }
}

impl fmt::Debug for Amqp10Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Amqp10Config")
            .field("settings", &self.settings)
            .field(
                "tls_config",
                &self.tls_config.as_ref().map(|_| "a rustls ClientConfig"),
            )
            .field("profile", &self.profile)
            .field("container_id", &self.container_id)
            .field("fetch_wait", &self.fetch_wait)
            .field("reverify_after", &self.reverify_after)
            .field("idle_timeout", &self.idle_timeout)
            .field("external_auth", &self.external_auth)
            .finish()
    }
}

/// The nodes connections open on: from the one that answered last, then the rest in order.
#[derive(Clone, Debug)]
pub(crate) struct Nodes {
    pub(crate) list: Arc<[Endpoint]>,
    /// The node that answered last, or [`NONE_YET`].
    last: Arc<AtomicUsize>,
}

/// No node has answered yet.
const NONE_YET: usize = usize::MAX;

impl Nodes {
    /// The order to try them in now: the node that answered last first.
    pub(crate) fn order(&self) -> impl Iterator<Item = (usize, &Endpoint)> {
        let n = self.list.len();
        let start = match self.last.load(Ordering::Relaxed) {
            i if i < n => i,
            _ => 0,
        };
        (0..n).map(move |k| {
            let i = (start + k) % n;
            (i, &self.list[i])
        })
    }

    /// Node `i` answered: connections open there first from now on. Returns the node the
    /// previous connection opened on, if there was one and it was another.
    pub(crate) fn answered(&self, i: usize) -> Option<&Endpoint> {
        let left = self.last.swap(i, Ordering::Relaxed);
        (left != i).then(|| self.list.get(left)).flatten()
    }

    /// The node that answered last (the first node before any did), password redacted.
    pub(crate) fn current(&self) -> &str {
        let i = self.last.load(Ordering::Relaxed);
        self.list
            .get(i)
            .or(self.list.first())
            .map_or("", |e| e.redacted.as_str())
    }

    /// Every node, passwords redacted.
    pub(crate) fn all(&self) -> String {
        self.list
            .iter()
            .map(|e| e.redacted.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// A password that prints as [`PASSWORD_MASK`].
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(String);

impl Secret {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PASSWORD_MASK)
    }
}

/// Where and how to connect, parsed from the URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) tls: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
    /// `None` connects with SASL ANONYMOUS.
    pub(crate) credentials: Option<(String, Secret)>,
    /// The `hostname` of the AMQP open frame: RabbitMQ selects a virtual host with
    /// `vhost:NAME`.
    pub(crate) open_hostname: String,
    pub(crate) redacted: String,
}

impl Endpoint {
    /// One node of the list.
    fn parse(node: NodeUrl<'_>, profile: &BrokerProfile) -> Result<Self, NodeListError> {
        node.check_scheme(&["amqp", "amqps"])?;
        let redacted = node.redacted();
        let url = url::Url::parse(node.url()).map_err(|e| node.invalid(e.to_string()))?;
        let tls = match url.scheme() {
            "amqp" => false,
            "amqps" => true,
            // A URL without `//`, such as `host:5672`, whose "scheme" is its host.
            other => {
                return Err(NodeListError::UnsupportedScheme {
                    position: node.position(),
                    node: redacted,
                    scheme: other.to_owned(),
                });
            }
        };
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h.trim_start_matches('[').trim_end_matches(']'),
            _ => return Err(node.invalid("it names no host")),
        }
        .to_owned();
        let port = url.port().unwrap_or(if tls { 5671 } else { 5672 });
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| {
                node.invalid("user name or password is not valid percent-encoded UTF-8")
            })
        };
        let credentials = match (url.username(), url.password()) {
            ("", None) => None,
            (user, password) => Some((decode(user)?, Secret(decode(password.unwrap_or(""))?))),
        };
        let vhost = percent_decode(url.path().trim_start_matches('/')).unwrap_or_default();
        let open_hostname = match profile {
            BrokerProfile::RabbitMq3 if !vhost.is_empty() && vhost != "/" => {
                format!("vhost:{vhost}")
            }
            _ => host.clone(),
        };
        Ok(Endpoint {
            tls,
            host,
            port,
            credentials,
            open_hostname,
            redacted,
        })
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::GenericProfile;
    use retry_core::redact_url;

    #[test]
    fn parses_plain_and_tls_urls() {
        let e = Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")
            .endpoint()
            .expect("valid");
        assert!(!e.tls);
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 5672));
        assert_eq!(e.open_hostname, "127.0.0.1");
        let e = Amqp10Config::new("amqps://u:p@broker.example")
            .endpoint()
            .expect("valid");
        assert!(e.tls);
        assert_eq!(e.port, 5671);
        let e = Amqp10Config::new("amqp://broker")
            .endpoint()
            .expect("valid");
        assert_eq!(e.credentials, None, "anonymous");
    }

    #[test]
    fn rabbitmq_vhosts_go_into_the_open_hostname() {
        let e = Amqp10Config::new("amqp://u:p@h/prod%2Fa")
            .endpoint()
            .expect("valid");
        assert_eq!(e.open_hostname, "vhost:prod/a");
        let e = Amqp10Config::new("amqp://u:p@h/%2f")
            .endpoint()
            .expect("valid");
        assert_eq!(e.open_hostname, "h", "the default vhost needs no selection");
        let generic = Amqp10Config::new("amqp://u:p@h/ns")
            .with_profile(BrokerProfile::Generic(GenericProfile::new()))
            .endpoint()
            .expect("valid");
        assert_eq!(generic.open_hostname, "h");
    }

    #[test]
    fn credentials_are_percent_decoded_and_never_printed() {
        let config = Amqp10Config::new("amqp://al%40ice:p%3Ass%2Fw0rd@h:1234");
        let e = config.endpoint().expect("valid");
        let (user, password) = e.credentials.clone().expect("credentials");
        assert_eq!(user, "al@ice");
        assert_eq!(password.expose(), "p:ss/w0rd");
        for shown in [
            format!("{config:?}"),
            format!("{e:?}"),
            config.redacted_url(),
            e.redacted.clone(),
        ] {
            assert!(!shown.contains("p%3Ass"), "{shown}");
            assert!(!shown.contains("p:ss"), "{shown}");
        }
        assert_eq!(config.redacted_url(), "amqp://al%40ice:****@h:1234");
    }

    #[test]
    fn bad_urls_are_refused_without_the_password() {
        let err = Amqp10Config::new("http://u:hunter2@h")
            .endpoint()
            .expect_err("scheme");
        assert!(matches!(err, NodeListError::UnsupportedScheme { .. }));
        assert!(!err.to_string().contains("hunter2"), "{err}");
        let err = Amqp10Config::new("amqp://u:hunter2@[::1")
            .endpoint()
            .expect_err("invalid");
        assert!(!err.to_string().contains("hunter2"), "{err}");
        assert_eq!(redact_url("no-scheme"), "no-scheme");
        assert_eq!(redact_url("amqp://h/v"), "amqp://h/v");
        assert_eq!(redact_url("amqp://u@h"), "amqp://u@h");
        assert_eq!(redact_url("amqp://u:p:q@h/x@y"), "amqp://u:****@h/x@y");
    }

    #[test]
    fn the_tls_given_last_wins() {
        let given = Arc::new(
            TlsClient::new(&TlsConfig::new(), DefaultRoots::Bundled)
                .expect("no file to read")
                .config()
                .as_ref()
                .clone(),
        );
        let named = TlsConfig::new().with_server_name("rabbit.internal");
        let config = Amqp10Config::new("amqps://h")
            .with_tls(named.clone())
            .with_tls_config(Arc::clone(&given));
        assert!(config.tls().is_none() && config.tls_config().is_some());
        let client = config.tls_client().expect("given whole");
        assert_eq!(client.checked_name("h"), "h");
        // Shared settings without TLS keep the configuration given whole; with, replace it.
        let config = config.with_settings(ConnectionSettings::new("amqps://h"));
        assert!(config.tls_config().is_some());
        let config = config.with_settings(ConnectionSettings::new("amqps://h").with_tls(named));
        assert!(config.tls_config().is_none());
        let client = config.tls_client().expect("no file to read");
        assert_eq!(client.checked_name("h"), "rabbit.internal");
        assert!(!format!("{config:?}").contains("ClientConfig {"));
    }

    #[test]
    fn a_shuffled_list_holds_every_node_once() {
        let urls = ["amqp://h1", "amqp://h2", "amqp://h3", "amqp://h4"];
        let config = Amqp10Config::new("amqp://h").with_settings(
            ConnectionSettings::from_nodes(transport_kit::settings::NodeList::from_urls(urls))
                .with_node_order(transport_kit::settings::NodeOrder::Shuffled),
        );
        let nodes = config.node_list().expect("four nodes");
        let mut hosts: Vec<&str> = nodes.list.iter().map(|e| e.host.as_str()).collect();
        hosts.sort_unstable();
        assert_eq!(hosts, ["h1", "h2", "h3", "h4"]);
    }

    #[test]
    fn a_node_list_is_tried_from_the_node_that_answered_last() {
        let config = Amqp10Config::new("amqp://u:pw@h1:5672, amqp://u:pw@h2:5673,,amqp://h3");
        let nodes = config.node_list().expect("three nodes");
        let order = |n: &Nodes| n.order().map(|(i, _)| i).collect::<Vec<_>>();
        assert_eq!(order(&nodes), [0, 1, 2]);
        assert_eq!(nodes.current(), "amqp://u:****@h1:5672");
        // The first connection names no node it left.
        assert!(nodes.answered(1).is_none());
        assert_eq!(order(&nodes), [1, 2, 0]);
        assert_eq!(nodes.answered(2).map(|e| e.port), Some(5673));
        assert_eq!(order(&nodes), [2, 0, 1]);
        assert_eq!(
            config.redacted_url(),
            "amqp://u:****@h1:5672,amqp://u:****@h2:5673,amqp://h3"
        );

        assert_eq!(
            Amqp10Config::new(" , ").node_list().unwrap_err(),
            NodeListError::Empty
        );
        assert_eq!(
            Amqp10Config::cluster(["amqp://h1", ""]).unwrap_err(),
            NodeListError::Empty
        );
        let err = Amqp10Config::cluster(["amqp://u:pw@h1", "http://u:pw@h2"]).unwrap_err();
        assert!(
            matches!(err, NodeListError::UnsupportedScheme { position: 2, .. }),
            "{err:?}"
        );
        assert!(!err.to_string().contains("pw"), "{err}");
    }
}
