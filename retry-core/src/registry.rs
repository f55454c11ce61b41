//! The transport registry: a URL's scheme picks the transport, and [`Registry::connect`]
//! hands it back as a [`DynTransport`].
//!
//! Each transport crate offers a [`Registration`] (its `registration()` function): its
//! name, the URL schemes it speaks, the settings it takes and how it connects. A program
//! registers the transports it links and connects by URL; the `retry-transports` crate holds
//! the registry of this workspace's transports, each behind a cargo feature, and `retryctl`
//! takes a registry, so that a transport written elsewhere gets the CLI by registering.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::{DefaultLayout, DynTransport, Layout, TlsConfig, TransportError, redact_url};

/// How a [`Registration`] connects: given the endpoint, a transport or why not.
type ConnectFn =
    dyn Fn(Endpoint) -> BoxFuture<'static, Result<DynTransport, ConnectError>> + Send + Sync;

/// One transport as a [`Registry`] knows it.
///
/// ```
/// use retry_core::{ConnectError, DynTransport, Endpoint, Registration};
/// # use retry_core::TransportError;
/// # async fn connect_mine(_url: &str, _window: usize) -> Result<DynTransport, ConnectError> {
/// #     Err(TransportError::Closed.into())
/// # }
///
/// // A transport of your own, for `mq://` and `mqs://` URLs, with one setting of its own.
/// let mine = Registration::new("mq", "MyQueue", ["mq", "mqs"], |endpoint: Endpoint| async move {
///     let window = endpoint.parse_setting::<usize>("window")?.unwrap_or(100);
///     connect_mine(endpoint.url(), window).await
/// })
/// .with_settings(["window"])
/// .with_tls();
/// assert_eq!(mine.name(), "mq");
/// assert_eq!(mine.schemes(), ["mq", "mqs"]);
/// ```
#[derive(Clone)]
pub struct Registration {
    name: String,
    title: String,
    schemes: Vec<String>,
    settings: Vec<String>,
    tls: bool,
    connect: Arc<ConnectFn>,
    layout: Arc<dyn Layout>,
}

impl Registration {
    /// A transport called `name` (what `ConnectOptions::with_protocol` and `retryctl
    /// --protocol` take), shown as `title`, for URLs of `schemes` (without `://`, matched
    /// without regard to case), connected by `connect`. It takes no settings and no TLS
    /// configuration until [`with_settings`](Self::with_settings) and
    /// [`with_tls`](Self::with_tls) say so.
    pub fn new<S, F, Fut>(
        name: impl Into<String>,
        title: impl Into<String>,
        schemes: S,
        connect: F,
    ) -> Self
    where
        S: IntoIterator,
        S::Item: Into<String>,
        F: Fn(Endpoint) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<DynTransport, ConnectError>> + Send + 'static,
    {
        Registration {
            name: name.into(),
            title: title.into(),
            schemes: schemes
                .into_iter()
                .map(|s| s.into().to_ascii_lowercase())
                .collect(),
            settings: Vec::new(),
            tls: false,
            connect: Arc::new(move |endpoint| Box::pin(connect(endpoint))),
            layout: Arc::new(DefaultLayout),
        }
    }

    /// The settings this transport reads from [`Endpoint::setting`]; any other is refused
    /// before it connects, with [`ConnectError::UnknownSetting`].
    pub fn with_settings<S>(mut self, keys: S) -> Self
    where
        S: IntoIterator,
        S::Item: Into<String>,
    {
        self.settings.extend(keys.into_iter().map(Into::into));
        self
    }

    /// This transport takes a [`TlsConfig`] ([`Endpoint::tls`]); without this, one given is
    /// refused with [`ConnectError::TlsUnsupported`].
    pub fn with_tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// How this transport lays a plan out, when not as RabbitMQ does ([`DefaultLayout`]):
    /// what `retryctl topology` plans and shows without connecting.
    pub fn with_layout(mut self, layout: impl Layout) -> Self {
        self.layout = Arc::new(layout);
        self
    }

    /// How this transport lays a plan out.
    pub fn layout(&self) -> &dyn Layout {
        &*self.layout
    }

    /// Its name, such as `amqp091`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its title, such as `AMQP 0-9-1`.
    pub fn title(&self) -> &str {
        &self.title
    }

    /// The URL schemes it speaks, in lower case.
    pub fn schemes(&self) -> &[String] {
        &self.schemes
    }

    /// The settings it takes.
    pub fn settings(&self) -> &[String] {
        &self.settings
    }

    /// Whether it takes a [`TlsConfig`].
    pub fn takes_tls(&self) -> bool {
        self.tls
    }

    fn speaks(&self, scheme: &str) -> bool {
        self.schemes.iter().any(|s| s.eq_ignore_ascii_case(scheme))
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("name", &self.name)
            .field("title", &self.title)
            .field("schemes", &self.schemes)
            .field("settings", &self.settings)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

/// What to connect with, beside the URL: the transport when a scheme has several, a name
/// for the connection, TLS settings, and settings of the transport's own.
///
/// ```
/// use retry_core::{ConnectOptions, TlsConfig};
///
/// let options = ConnectOptions::new()
///     .with_protocol("amqp10")
///     .with_client_name("billing-consumer")
///     .with_tls(TlsConfig::new().with_ca_file("ca.pem"))
///     .with_setting("replicas", "3");
/// assert_eq!(options.protocol(), Some("amqp10"));
/// ```
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    protocol: Option<String>,
    client_name: Option<String>,
    tls: Option<TlsConfig>,
    settings: BTreeMap<String, String>,
}

impl ConnectOptions {
    /// No options: the scheme's first transport, its defaults.
    pub fn new() -> Self {
        ConnectOptions::default()
    }

    /// Connect with the transport of this [name](Registration::name), which must speak the
    /// URL's scheme, rather than the first registered for it.
    pub fn with_protocol(mut self, name: impl Into<String>) -> Self {
        self.protocol = Some(name.into());
        self
    }

    /// The name the connection shows the broker, where the transport has one.
    pub fn with_client_name(mut self, name: impl Into<String>) -> Self {
        self.client_name = Some(name.into());
        self
    }

    /// TLS settings, for a transport [that takes them](Registration::with_tls).
    pub fn with_tls(mut self, tls: TlsConfig) -> Self {
        self.tls = Some(tls);
        self
    }

    /// A setting of the transport's own ([`Registration::with_settings`]).
    pub fn with_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.insert(key.into(), value.into());
        self
    }

    /// The transport asked for, if any.
    pub fn protocol(&self) -> Option<&str> {
        self.protocol.as_deref()
    }
}

/// What a [`Registration`]'s connect function is given: the URL and the options, checked
/// against what it declared.
#[derive(Clone, Debug)]
pub struct Endpoint {
    url: String,
    /// The registration's title, for errors.
    title: String,
    client_name: Option<String>,
    tls: Option<TlsConfig>,
    settings: BTreeMap<String, String>,
}

impl Endpoint {
    /// The URL as given: one, or several separated by commas (the nodes of a cluster), each
    /// of a scheme the transport speaks.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The connection's name, if one was given.
    pub fn client_name(&self) -> Option<&str> {
        self.client_name.as_deref()
    }

    /// The TLS settings, if any were given.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.tls.as_ref()
    }

    /// A setting's value, if it was given.
    pub fn setting(&self, key: &str) -> Option<&str> {
        self.settings.get(key).map(String::as_str)
    }

    /// A setting parsed as a `T`; a value that does not parse is a
    /// [`ConnectError::BadSetting`] naming it.
    ///
    /// ```
    /// # use retry_core::*;
    /// # async fn demo() -> Result<(), ConnectError> {
    /// let registry = Registry::new().with(Registration::new(
    ///     "mq", "MyQueue", ["mq"],
    ///     |endpoint: Endpoint| async move {
    ///         let window = endpoint.parse_setting::<u16>("window")?;
    ///         # let _ = window;
    ///         # Err(ConnectError::from(TransportError::Closed))
    ///     },
    /// ).with_settings(["window"]));
    /// let options = ConnectOptions::new().with_setting("window", "lots");
    /// let err = registry.connect_with("mq://host", options).await.unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "setting window = \"lots\" of MyQueue: invalid digit found in string"
    /// );
    /// # Ok(()) }
    /// # futures::executor::block_on(demo()).unwrap();
    /// ```
    pub fn parse_setting<T>(&self, key: &str) -> Result<Option<T>, ConnectError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        let Some(value) = self.setting(key) else {
            return Ok(None);
        };
        value
            .parse()
            .map(Some)
            .map_err(|e: T::Err| self.bad_setting(key, e))
    }

    /// A setting read as a human duration ("30s", "10m", "250ms").
    pub fn duration_setting(&self, key: &str) -> Result<Option<Duration>, ConnectError> {
        let Some(value) = self.setting(key) else {
            return Ok(None);
        };
        humantime::parse_duration(value)
            .map(Some)
            .map_err(|e| self.bad_setting(key, e))
    }

    /// The refusal of `key`'s value, for `why`.
    pub fn bad_setting(&self, key: &str, why: impl fmt::Display) -> ConnectError {
        ConnectError::BadSetting {
            protocol: self.title.clone(),
            key: key.to_owned(),
            value: self.setting(key).unwrap_or_default().to_owned(),
            why: why.to_string(),
        }
    }
}

/// The transports a program can connect to by URL.
///
/// ```
/// use retry_core::{ConnectError, ConnectOptions, Registration, Registry};
/// # use retry_core::TransportError;
/// # async fn demo() {
/// # let connect = |_| async { Err(ConnectError::from(TransportError::Closed)) };
/// let registry = Registry::new()
///     .with(Registration::new("amqp091", "AMQP 0-9-1", ["amqp", "amqps"], connect))
///     .with(Registration::new("amqp10", "AMQP 1.0", ["amqp", "amqps"], connect));
///
/// // The scheme's first transport, unless another that speaks it is asked for.
/// assert_eq!(registry.resolve("amqp://host", None).unwrap().name(), "amqp091");
/// assert_eq!(registry.resolve("amqps://host", Some("amqp10")).unwrap().name(), "amqp10");
///
/// // Bad input is refused before anything connects, naming the culprit.
/// let err = registry.connect("redis://:secret@host").await.unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "URL scheme \"redis://\" is not registered: this program connects to amqp:// \
///      (amqp091 or amqp10), amqps:// (amqp091 or amqp10)"
/// );
/// let options = ConnectOptions::new().with_setting("windw", "3");
/// let err = registry.connect_with("amqp://host", options).await.unwrap_err();
/// assert!(matches!(err, ConnectError::UnknownSetting { key, .. } if key == "windw"));
/// # }
/// # futures::executor::block_on(demo());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Registry {
    entries: Vec<Registration>,
}

impl Registry {
    /// A registry of no transport.
    pub fn new() -> Self {
        Registry::default()
    }

    /// Adds `registration`, after those already there (a scheme goes to the first transport
    /// registered for it). One of the same name replaces the one there, in its place.
    pub fn register(&mut self, registration: Registration) -> &mut Self {
        match self
            .entries
            .iter_mut()
            .find(|r| r.name == registration.name)
        {
            Some(there) => *there = registration,
            None => self.entries.push(registration),
        }
        self
    }

    /// [`register`](Self::register), by value.
    pub fn with(mut self, registration: Registration) -> Self {
        self.register(registration);
        self
    }

    /// The registered transports, in the order registered.
    pub fn registrations(&self) -> &[Registration] {
        &self.entries
    }

    /// The registration of this name.
    pub fn get(&self, name: &str) -> Option<&Registration> {
        self.entries.iter().find(|r| r.name == name)
    }

    /// The transport `url` calls for: `protocol`, when given, if it speaks every URL's
    /// scheme; else the first registered for the scheme. `url` is one URL, or several
    /// separated by commas, which must call for the same transport.
    pub fn resolve(
        &self,
        url: &str,
        protocol: Option<&str>,
    ) -> Result<&Registration, ConnectError> {
        let asked = match protocol {
            Some(name) => Some(
                self.get(name)
                    .ok_or_else(|| ConnectError::UnknownProtocol {
                        protocol: name.to_owned(),
                        known: self.names(),
                    })?,
            ),
            None => None,
        };
        let mut chosen: Option<&Registration> = None;
        for node in url.split(',').map(str::trim) {
            let Some((scheme, _)) = node.split_once("://").filter(|(s, _)| !s.is_empty()) else {
                return Err(if node.is_empty() {
                    ConnectError::EmptyUrl
                } else {
                    ConnectError::NoScheme {
                        url: masked(node),
                        accepted: self.accepted(),
                    }
                });
            };
            let registration = match asked {
                Some(r) if r.speaks(scheme) => r,
                Some(r) => {
                    return Err(ConnectError::SchemeNotSpoken {
                        protocol: r.name.clone(),
                        scheme: scheme.to_ascii_lowercase(),
                        schemes: r.schemes.clone(),
                    });
                }
                None => self
                    .entries
                    .iter()
                    .find(|r| r.speaks(scheme))
                    .ok_or_else(|| ConnectError::UnknownScheme {
                        scheme: scheme.to_ascii_lowercase(),
                        accepted: self.accepted(),
                    })?,
            };
            if chosen.is_some_and(|c| c.name != registration.name) {
                return Err(ConnectError::MixedProtocols { url: masked(url) });
            }
            chosen = Some(registration);
        }
        chosen.ok_or(ConnectError::EmptyUrl)
    }

    /// Connects to `url` with the transport its scheme calls for, with its defaults.
    pub async fn connect(&self, url: &str) -> Result<DynTransport, ConnectError> {
        self.connect_with(url, ConnectOptions::new()).await
    }

    /// Connects to `url` with `options`. Everything is checked before anything connects:
    /// the scheme, the transport asked for, each setting's key, and TLS settings given to a
    /// transport that takes none.
    pub async fn connect_with(
        &self,
        url: &str,
        options: ConnectOptions,
    ) -> Result<DynTransport, ConnectError> {
        let registration = self.resolve(url, options.protocol.as_deref())?;
        if let Some(key) = options
            .settings
            .keys()
            .find(|key| !registration.settings.contains(key))
        {
            return Err(ConnectError::UnknownSetting {
                protocol: registration.title.clone(),
                key: key.clone(),
                known: registration.settings.clone(),
            });
        }
        if options.tls.is_some() && !registration.tls {
            return Err(ConnectError::TlsUnsupported {
                protocol: registration.title.clone(),
            });
        }
        let endpoint = Endpoint {
            url: url.to_owned(),
            title: registration.title.clone(),
            client_name: options.client_name,
            tls: options.tls,
            settings: options.settings,
        };
        (registration.connect)(endpoint).await
    }

    /// The accepted schemes and what speaks each, as errors name them:
    /// `amqp:// (amqp091 or amqp10), nats:// (nats)`.
    pub fn accepted(&self) -> String {
        let mut schemes: Vec<&str> = Vec::new();
        for r in &self.entries {
            for s in &r.schemes {
                if !schemes.contains(&s.as_str()) {
                    schemes.push(s);
                }
            }
        }
        if schemes.is_empty() {
            return "no transport: none is registered".to_owned();
        }
        schemes
            .iter()
            .map(|scheme| {
                let names: Vec<&str> = self
                    .entries
                    .iter()
                    .filter(|r| r.speaks(scheme))
                    .map(|r| r.name.as_str())
                    .collect();
                format!("{scheme}:// ({})", names.join(" or "))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn names(&self) -> Vec<String> {
        self.entries.iter().map(|r| r.name.clone()).collect()
    }
}

/// `url` for an error: every comma-separated node's password masked, a node without a
/// scheme read as the authority it would be after one.
fn masked(url: &str) -> String {
    url.split(',')
        .map(|node| {
            let node = node.trim();
            if node.contains("//") {
                redact_url(node)
            } else {
                redact_url(&format!("//{node}"))[2..].to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Why [`Registry::connect`] gave no transport. URLs in it have their passwords masked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The URL is empty, or one of its comma-separated parts is.
    #[error("the URL is empty")]
    EmptyUrl,
    /// A URL has no `scheme://`.
    #[error("{url} has no scheme: this program connects to {accepted}")]
    NoScheme {
        /// The URL, its password masked.
        url: String,
        /// The accepted schemes ([`Registry::accepted`]).
        accepted: String,
    },
    /// No registered transport speaks the URL's scheme.
    #[error("URL scheme \"{scheme}://\" is not registered: this program connects to {accepted}")]
    UnknownScheme {
        /// The scheme, in lower case.
        scheme: String,
        /// The accepted schemes ([`Registry::accepted`]).
        accepted: String,
    },
    /// The transport asked for is not registered.
    #[error("no transport is called {protocol:?}: the registered ones are {known:?}")]
    UnknownProtocol {
        /// The name asked for.
        protocol: String,
        /// The registered names.
        known: Vec<String>,
    },
    /// The transport asked for does not speak the URL's scheme.
    #[error("{protocol} does not speak {scheme}:// URLs, only {schemes:?}")]
    SchemeNotSpoken {
        /// The transport asked for.
        protocol: String,
        /// The URL's scheme.
        scheme: String,
        /// The schemes it speaks.
        schemes: Vec<String>,
    },
    /// The comma-separated URLs call for different transports.
    #[error("the URLs of {url} call for different transports: list the nodes of one broker")]
    MixedProtocols {
        /// The URLs, their passwords masked.
        url: String,
    },
    /// A setting the transport does not take.
    #[error("{protocol} has no setting {key:?}: it takes {known:?}")]
    UnknownSetting {
        /// The transport's title.
        protocol: String,
        /// The key given.
        key: String,
        /// The keys it takes.
        known: Vec<String>,
    },
    /// A setting's value the transport cannot use.
    #[error("setting {key} = {value:?} of {protocol}: {why}")]
    BadSetting {
        /// The transport's title.
        protocol: String,
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// Why it was refused.
        why: String,
    },
    /// TLS settings given to a transport that takes none.
    #[error("{protocol} takes no TLS settings here")]
    TlsUnsupported {
        /// The transport's title.
        protocol: String,
    },
    /// The transport was chosen, and connecting failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn never(_: Endpoint) -> impl Future<Output = Result<DynTransport, ConnectError>> {
        std::future::ready(Err(ConnectError::from(TransportError::Closed)))
    }

    fn registry() -> Registry {
        Registry::new()
            .with(Registration::new("amqp091", "AMQP 0-9-1", ["amqp", "AMQPS"], never).with_tls())
            .with(Registration::new(
                "amqp10",
                "AMQP 1.0",
                ["amqp", "amqps"],
                never,
            ))
            .with(
                Registration::new("nats", "NATS JetStream", ["nats", "tls"], never)
                    .with_settings(["replicas"]),
            )
    }

    fn connect(url: &str, options: ConnectOptions) -> ConnectError {
        futures::executor::block_on(registry().connect_with(url, options)).unwrap_err()
    }

    #[test]
    fn a_scheme_goes_to_its_first_transport_unless_another_is_asked_for() {
        let r = registry();
        assert_eq!(
            r.resolve("AMQPS://n1, amqp://n2", None).unwrap().name(),
            "amqp091"
        );
        assert_eq!(
            r.resolve("amqp://n1", Some("amqp10")).unwrap().name(),
            "amqp10"
        );
        assert_eq!(
            r.resolve("tls://n1,nats://n2", None).unwrap().name(),
            "nats"
        );
        assert_eq!(
            r.accepted(),
            "amqp:// (amqp091 or amqp10), amqps:// (amqp091 or amqp10), nats:// (nats), tls:// (nats)"
        );
    }

    #[test]
    fn bad_urls_are_refused_naming_the_culprit_without_its_password() {
        let r = registry();
        let cases: [(&str, Option<&str>, &str); 6] = [
            ("", None, "the URL is empty"),
            ("amqp://n1,", None, "the URL is empty"),
            ("u:secret@host:5672", None, "u:****@host:5672 has no scheme"),
            (
                "redis://u:secret@host",
                None,
                "URL scheme \"redis://\" is not registered",
            ),
            (
                "nats://n1",
                Some("amqp10"),
                "amqp10 does not speak nats:// URLs",
            ),
            (
                "nats://u:secret@n1,amqp://n2",
                None,
                "nats://u:****@n1,amqp://n2 call for different",
            ),
        ];
        for (url, protocol, expected) in cases {
            let err = r.resolve(url, protocol).unwrap_err().to_string();
            assert!(err.contains(expected), "{url}: {err}");
            assert!(!err.contains("secret"), "{url}: {err}");
        }
        let err = r.resolve("amqp://n1", Some("amqp1")).unwrap_err();
        assert!(
            matches!(err, ConnectError::UnknownProtocol { ref protocol, .. } if protocol == "amqp1")
        );
        let empty = Registry::new()
            .resolve("amqp://n1", None)
            .unwrap_err()
            .to_string();
        assert!(empty.contains("none is registered"), "{empty}");
    }

    #[test]
    fn settings_and_tls_are_checked_before_connecting() {
        let err = connect(
            "nats://n1",
            ConnectOptions::new().with_setting("replica", "3"),
        );
        assert_eq!(
            err.to_string(),
            "NATS JetStream has no setting \"replica\": it takes [\"replicas\"]"
        );
        let err = connect(
            "nats://n1",
            ConnectOptions::new().with_tls(TlsConfig::new()),
        );
        assert!(matches!(err, ConnectError::TlsUnsupported { .. }), "{err}");
        // Taken: the registration's own function answers.
        let err = connect(
            "amqp://n1",
            ConnectOptions::new().with_tls(TlsConfig::new()),
        );
        assert!(
            matches!(err, ConnectError::Transport(TransportError::Closed)),
            "{err}"
        );
    }

    #[test]
    fn a_registration_of_the_same_name_replaces_the_one_there() {
        let r = registry().with(Registration::new("amqp091", "mine", ["amqp"], never));
        assert_eq!(r.registrations().len(), 3);
        assert_eq!(r.registrations()[0].title(), "mine");
        assert!(r.resolve("amqps://n1", None).unwrap().name() == "amqp10");
    }

    #[test]
    fn settings_parse_or_name_the_bad_value() {
        let endpoint = Endpoint {
            url: "nats://n1".into(),
            title: "NATS JetStream".into(),
            client_name: None,
            tls: None,
            settings: [
                ("replicas".into(), "three".into()),
                ("wait".into(), "2s".into()),
            ]
            .into(),
        };
        let err = endpoint.parse_setting::<usize>("replicas").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("setting replicas = \"three\" of NATS JetStream"),
            "{err}"
        );
        assert_eq!(
            endpoint.duration_setting("wait").unwrap(),
            Some(Duration::from_secs(2))
        );
        assert_eq!(endpoint.parse_setting::<usize>("absent").unwrap(), None);
        assert!(endpoint.duration_setting("replicas").is_err());
    }

    proptest::proptest! {
        /// Whatever a configuration holds (any characters, any number of schemes, commas
        /// and `://`), resolving it answers without a panic.
        #[test]
        fn any_url_resolves_or_is_refused_without_a_panic(url in "\\PC{0,80}", protocol in proptest::option::of("[a-z0-9]{0,8}")) {
            let _ = registry().resolve(&url, protocol.as_deref());
        }

        /// A password in any node of a list never appears in a refusal, with or without a
        /// scheme, known or not.
        #[test]
        fn a_password_never_appears_in_a_refusal(
            scheme in "(amqp|nats|redis|)",
            other in "(amqp|nats|http)",
            user in "[a-z]{1,6}",
            host in "[a-z0-9.]{1,12}",
            first in proptest::bool::ANY,
        ) {
            let secret = "Zq9secretXw";
            let node = if scheme.is_empty() {
                format!("{user}:{secret}@{host}")
            } else {
                format!("{scheme}://{user}:{secret}@{host}")
            };
            let url = if first { format!("{node},{other}://{host}") } else { format!("{other}://{host},{node}") };
            if let Err(err) = registry().resolve(&url, None) {
                let text = format!("{err} {err:?}");
                proptest::prop_assert!(!text.contains(secret), "{url}: {text}");
            }
        }
    }
}
