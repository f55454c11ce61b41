//! `Amqp10Transport`: the [`Transport`] implementation.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use retry_core::{
    Capabilities, CascadePlan, Delivery, Message, Publish, PublishResult, QueueRole, QueueWalk,
    Route, Settlement, TopologyPlan, Transport, TransportError,
};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info};

use crate::codec::{Schedule, UNDECODABLE_HEADER, build_clone};
use crate::config::Amqp10Config;
use crate::connection::{Probe, ProbeError};
use crate::fetch::{self, Purpose};
use crate::profile::{BrokerProfile, provision_hint};
use crate::publisher::Publisher;
use crate::receiver::{self, Amqp10Tag, Command};
use crate::shared::Shared;
use crate::subscription::Amqp10Subscription;
use crate::walk::LinkWalk;

/// How many addresses [`Amqp10Transport::missing`] probes at once: a plan of a few delay
/// levels is verified in about the time of its slowest probe, and a plan of many does not
/// open dozens of sessions at once.
const PROBES_AT_ONCE: usize = 8;

/// A [`Transport`] over AMQP 1.0, through fe2o3-amqp.
///
/// [`connect`](Self::connect) opens the connection that publishes clones and verifies
/// addresses. Every [`consume`](Transport::consume) opens a connection for its own
/// [`Amqp10Subscription`], and every queue read with [`fetch`](Transport::fetch) gets a fetch
/// link on a connection of its own; [`close`](Self::close) closes them all. See the
/// [crate documentation](crate) for the design and the RabbitMQ 3.x specifics.
///
/// ```no_run
/// use retry_core::{RetryPolicy, Settlement, Subscription, TopologyPlan, Transport};
/// use std::time::Duration;
/// use transport_amqp10::{Amqp10Config, Amqp10Transport};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// // On RabbitMQ this verifies the topology (declared beforehand over AMQP 0-9-1).
/// transport.provision(&plan).await?;
/// // One suspect at a time from the isolation queue...
/// if let Some(suspect) = transport.fetch(plan.isolation_queue()).await? {
///     transport.settle(&suspect.tag, Settlement::Ack).await?;
/// }
/// // ...and the work queue by subscription.
/// let work = transport.consume("comments", 20).await?;
/// while let Some(delivery) = work.recv().await? {
///     println!("{} bytes", delivery.message.body().len());
///     transport.settle(&delivery.tag, Settlement::Ack).await?;
/// }
/// transport.close().await;
/// # Ok(())
/// # }
/// ```
pub struct Amqp10Transport {
    shared: Arc<Shared>,
    routes: RwLock<Routes>,
}

/// What the provisioned plans say about routes.
#[derive(Default, Debug)]
struct Routes {
    /// (exchange, routing key) → the queue it is bound to.
    bound: HashMap<(String, String), String>,
    /// Routes into TTL queues, and the queue each expires into: a delay level's work queue,
    /// the crash delay's isolation queue.
    delays: HashMap<(String, String), String>,
    /// Delay cascades by entry exchange (only with native delays: `verify` refuses a
    /// cascade otherwise), each with the queues verified plans route through it.
    cascades: HashMap<String, Cascaded>,
}

/// A delay cascade of verified plans: its routing keys name a destination and a delay.
#[derive(Debug)]
struct Cascaded {
    cascade: CascadePlan,
    /// The queues bound to its delivery exchange by a verified plan: its work queue, and
    /// its isolation queue when crashed suspects wait in the cascade.
    destinations: HashSet<String>,
}

impl Routes {
    fn learn(&mut self, plan: &TopologyPlan) {
        for b in plan.bindings() {
            self.bound
                .insert((b.exchange.clone(), b.routing_key.clone()), b.queue.clone());
        }
        for (_, route, destination) in plan.delayed_destinations() {
            self.delays.insert(key(route), destination.to_owned());
        }
        if let Some(cascade) = plan.cascade() {
            // The entry exchange names the prefix, the unit, the queue type and the levels:
            // plans with the same entry have the same cascade.
            let cascaded = self
                .cascades
                .entry(cascade.entry_exchange().to_owned())
                .or_insert_with(|| Cascaded {
                    cascade: cascade.clone(),
                    destinations: HashSet::new(),
                });
            let delivered = plan
                .bindings()
                .iter()
                .filter(|b| b.exchange == cascade.delivery_exchange());
            cascaded
                .destinations
                .extend(delivered.map(|b| b.queue.clone()));
        }
    }
}

fn key(route: &Route) -> (String, String) {
    (route.exchange.to_string(), route.routing_key.to_string())
}

/// Where a clone goes, and how that address is verified before a send.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    address: String,
    probe: Probe,
    native_delay: bool,
    /// The delay the route itself says (a cascade routing key's), which a native delay
    /// uses before the clone's headers.
    delay: Option<Duration>,
}

/// How a queue is probed on `profile`: on RabbitMQ by attaching a receiver with no credit
/// (`/amq/queue/NAME` never declares, so a missing queue fails), elsewhere by attaching a
/// sender.
fn queue_probe(profile: &BrokerProfile) -> Probe {
    match profile {
        BrokerProfile::RabbitMq3 => Probe::Receiver,
        BrokerProfile::Generic(_) => Probe::Sender,
    }
}

/// What [`Amqp10Transport::verify`] checks: (what, address, probe). With native delays the
/// TTL queues are left out: nothing is sent to them.
pub(crate) fn checks(plan: &TopologyPlan, profile: &BrokerProfile) -> Vec<(String, String, Probe)> {
    let mut checks = Vec::new();
    for queue in plan.queues() {
        let delayed_natively = matches!(
            queue.role,
            QueueRole::Delay { .. } | QueueRole::CrashDelay { .. }
        ) && profile.native_delay().is_some();
        if delayed_natively {
            continue;
        }
        let probe = queue_probe(profile);
        checks.push((
            format!("queue {}", queue.name),
            profile.queue_address(&queue.name),
            probe,
        ));
    }
    // Exchanges are RabbitMQ's; elsewhere clones go to queues by name.
    if *profile == BrokerProfile::RabbitMq3 {
        for exchange in plan.exchanges() {
            checks.push((
                format!("exchange {}", exchange.name),
                profile.exchange_address(&exchange.name),
                Probe::Sender,
            ));
        }
    }
    checks
}

/// Why `plan` cannot be carried out on `profile`, if it cannot: a delay cascade without
/// native delays.
///
/// A cascade is a chain of exchanges and exchange-to-exchange bindings. This transport
/// never sends through an exchange, since it cannot see a binding: it sends each clone to
/// the verified queue its route is bound to. A cascade's level is reached only through
/// bindings, so it could neither be verified nor used: refused, before anything is probed
/// or sent.
fn unsupported(plan: &TopologyPlan, profile: &BrokerProfile) -> Option<TransportError> {
    let cascade = plan.cascade()?;
    let why = match profile {
        BrokerProfile::Generic(generic) if generic.native_delay().is_some() => return None,
        BrokerProfile::RabbitMq3 => {
            "RabbitMQ's AMQP 1.0 plugin can neither declare nor inspect bindings, and it accepts a send to an exchange with no matching binding and drops it without a word: a cascade missing one exchange-to-exchange binding would lose retries silently. Use the per-delay-queue strategy (`DelayStrategy::PerDelayQueue`, the default) with this transport, whose every delay queue is verified and sent to directly, or consume with transport-amqp091, which declares the cascade and is told of an unroutable publish"
        }
        BrokerProfile::Generic(_) => {
            "AMQP 1.0 can neither declare nor inspect bindings, and a broker may accept a send with no matching route and drop it without a word: a cascade missing one of its bindings would lose retries silently, so this transport sends only to verified queues, never through a cascade's exchanges. Use the per-delay-queue strategy (`DelayStrategy::PerDelayQueue`, the default), or, if the broker schedules deliveries itself, a profile with native delays (`GenericProfile::with_native_delay`), which sends a delayed clone straight to its queue"
        }
    };
    Some(TransportError::Unsupported {
        what: format!(
            "the delay cascade {:?} of work queue {:?} on {}",
            cascade.entry_exchange(),
            plan.work_queue(),
            profile.name()
        ),
        why: why.to_owned(),
    })
}

impl Amqp10Transport {
    /// Opens the publishing connection. Consuming starts with
    /// [`consume`](Transport::consume) or [`fetch`](Transport::fetch).
    pub async fn connect(config: Amqp10Config) -> Result<Self, TransportError> {
        let nodes = config
            .node_list()
            .map_err(|e| TransportError::Other(Box::new(e)))?;
        let publisher = Publisher::new(nodes.clone(), config.clone());
        publisher.connect().await?;
        info!(node = %nodes.current(), nodes = %nodes.all(), profile = config.profile().name(), "AMQP 1.0 transport connected");
        Ok(Amqp10Transport {
            shared: Arc::new(Shared {
                config,
                nodes,
                publisher,
                links: std::sync::Mutex::new(Vec::new()),
                fetchers: std::sync::Mutex::new(HashMap::new()),
                closed: AtomicBool::new(false),
                ahead: std::sync::Mutex::new(HashMap::new()),
                aheads: std::sync::atomic::AtomicU64::new(0),
            }),
            routes: RwLock::new(Routes::default()),
        })
    }

    /// The settings.
    pub fn config(&self) -> &Amqp10Config {
        &self.shared.config
    }

    /// The broker profile.
    pub fn profile(&self) -> BrokerProfile {
        self.shared.config.profile()
    }

    /// Checks that everything in `plan` exists, without declaring anything, and learns the
    /// plan's routes. Every missing object is named in one
    /// [`TransportError::MissingAddress`]. This is what [`provision`](Transport::provision)
    /// and [`Transport::verify`] do, so a [`Consumer`](retry_core::Consumer) verifies the
    /// plan before consuming whether or not it provisions. Until a plan is verified no clone
    /// can be sent on its routes: a route no verified plan knows fails with
    /// `MissingAddress`.
    ///
    /// Every address is probed now, however recently it was verified. After that, a send
    /// probes its address again when its verification is older than
    /// [`Amqp10Config::with_reverify_after`] or was made on an earlier publishing
    /// connection.
    ///
    /// On RabbitMQ queues are probed by attaching a receiver with no credit (`/amq/queue/NAME`
    /// never declares, so a missing queue fails NOT_FOUND) and exchanges by attaching a
    /// sender. Bindings cannot be seen over AMQP 1.0; clones are therefore sent to the
    /// verified queue a route is bound to, not through the exchange. With native delays the
    /// delay and crash-delay queues are not needed (a delayed clone goes straight to the
    /// work or isolation queue, scheduled) and are not checked.
    ///
    /// A plan with a delay cascade ([`TopologyPlan::cascade`]) is refused with
    /// [`TransportError::Unsupported`] before anything is probed, on RabbitMQ 3.x and on a
    /// generic profile without native delays: a cascade is exchanges and exchange-to-exchange
    /// bindings, which AMQP 1.0 can neither declare nor see, and a send into a cascade with
    /// one binding missing would be accepted and dropped. With native delays a cascade route
    /// is sent straight to its destination queue (the plan's work or isolation queue),
    /// scheduled for the delay its routing key says, and the cascade's own objects are not
    /// needed.
    ///
    /// ```no_run
    /// use retry_core::{Cascade, DelayStrategy, RetryPolicy, TopologyPlan, TransportError};
    /// use std::time::Duration;
    /// use transport_amqp10::{Amqp10Config, Amqp10Transport};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::builder("comments", &policy)
    ///     .with_strategy(DelayStrategy::Cascade(Cascade::new()))
    ///     .build()?;
    /// // RabbitMQ 3.x (the default profile): refused, nothing sent.
    /// let err = transport.verify(&plan).await.unwrap_err();
    /// assert!(matches!(err, TransportError::Unsupported { .. }));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let missing = self.missing(plan).await?;
        if !missing.is_empty() {
            return Err(TransportError::MissingAddress {
                address: missing.join(", "),
                hint: provision_hint(&self.profile()),
            });
        }
        if let Ok(mut routes) = self.routes.write() {
            routes.learn(plan);
        }
        Ok(())
    }

    /// The objects of `plan` that do not exist, each as `queue NAME` or `exchange NAME`, in
    /// the plan's order: what [`verify`](Self::verify) probes, for a tool that reports object
    /// by object. Every address is probed now; a plan this transport cannot serve is refused
    /// as `verify` refuses it, and a probe that fails for another reason than a missing
    /// object is that error. Unlike `verify`, it does not learn the plan's routes.
    ///
    /// ```no_run
    /// use retry_core::{RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    /// use transport_amqp10::{Amqp10Config, Amqp10Transport};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("comments", &policy)?;
    /// for object in transport.missing(&plan).await? {
    ///     println!("missing: {object}"); // e.g. "queue comments.retry.30s"
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn missing(&self, plan: &TopologyPlan) -> Result<Vec<String>, TransportError> {
        let profile = self.profile();
        if let Some(refused) = unsupported(plan, &profile) {
            return Err(refused);
        }
        // The probes run side by side, a few at a time (each is a session of its own on
        // the publishing connection), and are answered in the plan's order.
        let checks = checks(plan, &profile);
        let mut probes = Vec::with_capacity(checks.len());
        for (_, address, probe) in &checks {
            probes.push(self.shared.publisher.verify(address, *probe));
        }
        let answers: Vec<_> = futures::stream::iter(probes)
            .buffered(PROBES_AT_ONCE)
            .collect()
            .await;
        let mut missing = Vec::new();
        for ((what, address, _), answer) in checks.into_iter().zip(answers) {
            match answer {
                Ok(_) => debug!(%address, "verified"),
                Err(ProbeError::Missing(why)) => {
                    debug!(%address, %why, "missing");
                    missing.push(what);
                }
                Err(ProbeError::Failed(e)) => return Err(e),
            }
        }
        Ok(missing)
    }

    /// Stops every subscription and fetch link this transport made, detaches their links and
    /// closes every connection. Deliveries not yet settled go back to the queue, redelivered;
    /// a subscription's [`recv`](retry_core::Subscription::recv) returns `Ok(None)` from then
    /// on, and a fetch fails with [`TransportError::Closed`].
    pub async fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let mut links: Vec<mpsc::Sender<Command>> = self
            .shared
            .links
            .lock()
            .map(|mut links| links.drain(..).filter_map(|l| l.upgrade()).collect())
            .unwrap_or_default();
        if let Ok(mut fetchers) = self.shared.fetchers.lock() {
            links.extend(fetchers.drain().map(|(_, link)| link));
        }
        let after = self.shared.config.operation_timeout();
        let closing = links.into_iter().map(|link| async move {
            let (done, closed) = oneshot::channel();
            if link.send(Command::Close { done }).await.is_ok() {
                let _ = tokio::time::timeout(after, closed).await;
            }
        });
        futures::future::join_all(closing).await;
        // Links opened ahead and never consumed from close with their connections.
        if let Ok(mut ahead) = self.shared.ahead.lock() {
            ahead.clear();
        }
        self.shared.publisher.close().await;
    }

    /// [`verify`](Self::verify) for a consumer about to start, which then fetches from the
    /// plan's isolation queue (the suspects a previous run left run before any work) and,
    /// once that is empty, consumes its work queue. While the plan's addresses are probed,
    /// the isolation queue's fetch link is attached and a consuming link on the work queue is
    /// opened, both granting nothing (nothing is taken from either queue before a fetch or
    /// a `consume` asks): connecting and attaching are then off the path to the first
    /// delivery. Neither is done for a plan that cannot be served at all. The consuming link
    /// waits for the next [`consume`](Transport::consume) of the work queue, for the
    /// operation timeout at most (then it is closed); a failure to open either is reported by
    /// the fetch or `consume` that would have used it, which tries again.
    async fn verify_to_consume(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        if unsupported(plan, &self.profile()).is_none() && !self.shared.is_closed() {
            if let Ok(link) = self.fetcher(plan.isolation_queue()) {
                fetch::attach_ahead(&link);
            }
            self.shared.open_ahead(plan.work_queue());
        }
        Amqp10Transport::verify(self, plan).await
    }

    /// The fetch link task of `queue`, started if there is none (or it ended).
    fn fetcher(&self, queue: &str) -> Result<mpsc::Sender<Command>, TransportError> {
        let mut fetchers = self
            .shared
            .fetchers
            .lock()
            .map_err(|_| TransportError::Other("fetch links poisoned".into()))?;
        if self.shared.is_closed() {
            return Err(TransportError::Closed);
        }
        let spawn = || {
            fetch::spawn(
                &self.shared.nodes,
                &self.shared.config,
                queue,
                Purpose::Fetch,
            )
        };
        Ok(fetchers
            .entry(queue.to_owned())
            .and_modify(|link| {
                if link.is_closed() {
                    *link = spawn();
                }
            })
            .or_insert_with(spawn)
            .clone())
    }

    fn target(&self, route: &Route) -> Result<Target, TransportError> {
        let routes = self
            .routes
            .read()
            .map_err(|_| TransportError::Other("route table poisoned".into()))?;
        routes.target(&self.profile(), route)
    }
}

impl Routes {
    /// Where a clone on `route` goes on `profile`.
    fn target(&self, profile: &BrokerProfile, route: &Route) -> Result<Target, TransportError> {
        let k = key(route);
        if profile.native_delay().is_some()
            && let Some(destination) = self.delays.get(&k)
        {
            return Ok(Target {
                address: profile.queue_address(destination),
                probe: Probe::Sender,
                native_delay: true,
                delay: None,
            });
        }
        if profile.native_delay().is_some()
            && let Some(cascaded) = self.cascades.get(&*route.exchange)
        {
            return cascaded.target(profile, route);
        }
        let queue_probe = queue_probe(profile);
        if let Some(queue) = self.bound.get(&k) {
            return Ok(Target {
                address: profile.queue_address(queue),
                probe: queue_probe,
                native_delay: false,
                delay: None,
            });
        }
        if route.exchange.is_empty() {
            return Ok(Target {
                address: profile.queue_address(&route.routing_key),
                probe: queue_probe,
                native_delay: false,
                delay: None,
            });
        }
        // Not from a verified plan. Its exchange could be checked, but not its binding (AMQP
        // 1.0 cannot see bindings), and RabbitMQ drops an unroutable send without a word.
        Err(TransportError::MissingAddress {
            address: format!(
                "the queue behind exchange {:?} with routing key {:?}",
                route.exchange, route.routing_key
            ),
            hint: "no verified plan routes it: this transport sends only to queues it has verified (`provision` or `verify` with the plan first; a Consumer does one of them before consuming)".into(),
        })
    }
}

impl Cascaded {
    /// A clone on a route through the cascade goes straight to its destination queue,
    /// scheduled natively for the delay its routing key says: the levels are never used.
    /// Only a destination a verified plan routes through the cascade is accepted.
    fn target(&self, profile: &BrokerProfile, route: &Route) -> Result<Target, TransportError> {
        let key = &*route.routing_key;
        let destination = self.cascade.destination_of(key);
        match (destination, self.cascade.delay_of(key)) {
            (Some(queue), Some(delay)) if self.destinations.contains(queue) => Ok(Target {
                address: profile.queue_address(queue),
                probe: Probe::Sender,
                native_delay: true,
                delay: Some(delay),
            }),
            _ => Err(TransportError::MissingAddress {
                address: format!(
                    "queue {:?} through the delay cascade {:?}",
                    destination.unwrap_or(key),
                    route.exchange
                ),
                hint: "no verified plan routes that queue through this cascade: this transport sends only to queues it has verified (`provision` or `verify` with the plan first; a Consumer does one of them before consuming)".into(),
            }),
        }
    }
}

impl std::fmt::Debug for Amqp10Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp10Transport")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for Amqp10Transport {
    type Tag = Amqp10Tag;
    type Subscription = Amqp10Subscription;

    fn capabilities(&self) -> Capabilities {
        self.profile().capabilities()
    }

    /// Verifies the plan (see [`verify`](Amqp10Transport::verify)): neither profile declares
    /// topology over AMQP 1.0. Attaches the isolation queue's fetch link meanwhile, as
    /// [`Transport::verify`] does.
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.verify_to_consume(plan).await
    }

    /// Verifies the plan (see [`verify`](Amqp10Transport::verify)). A
    /// [`Consumer`](retry_core::Consumer) with provisioning off calls this before
    /// consuming: without it no route of the plan is known, and nothing can be sent.
    ///
    /// A consumer's first step after it is to fetch from the plan's isolation queue (the
    /// suspects a previous run left are run before any work), so that queue's fetch link
    /// is attached meanwhile, granting nothing: the first fetch then only counts the queue.
    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.verify_to_consume(plan).await
    }

    /// Attaches a new link on a connection of its own, with a credit of `prefetch`. A missing
    /// queue fails here, with [`TransportError::MissingAddress`].
    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Amqp10Subscription, TransportError> {
        if self.shared.is_closed() {
            return Err(TransportError::Closed);
        }
        if prefetch == 0 {
            return Err(TransportError::Other(
                "prefetch must be at least 1: it is the consuming link's credit".into(),
            ));
        }
        Amqp10Subscription::start(Arc::clone(&self.shared), queue, prefetch).await
    }

    /// Takes at most one message on the queue's fetch link. On RabbitMQ it first asks for
    /// the queue's count of ready messages, with a `flow` that grants nothing, and answers
    /// `Ok(None)` at once if there are none. Otherwise it grants a credit of exactly 1; if
    /// nothing arrives within [`Amqp10Config::with_fetch_wait`] (and the broker's answer to
    /// the grant does not say a message is on its way, which is then waited for), the credit
    /// is taken back by detaching the link, and the answer is `Ok(None)`; the link's session
    /// then ends, which puts back any fetched delivery still unsettled. When the message
    /// the broker said was on its way never arrives, or the link breaks with the credit
    /// granted, the message goes back to the queue redelivered and the fetch fails with
    /// [`TransportError::FetchLost`]. A queue that does not exist fails with
    /// [`TransportError::MissingAddress`]. A message that cannot be decoded is rejected, so
    /// that the queue dead-letters it, and the next one is taken.
    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Amqp10Tag>>, TransportError> {
        let link = self.fetcher(queue)?;
        fetch::ask(&link, &self.shared.config).await
    }

    /// Resolves once `queue` has a message ready, taking none. On RabbitMQ it asks for the
    /// queue's count every `poll` on the queue's fetch link, with a `flow` that grants
    /// nothing, as [`fetch`](Transport::fetch) does first. Where the broker does not count
    /// (the generic profile), or the count fails, it resolves after `poll`, and the consumer
    /// finds out with a fetch (which reports the failure).
    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        let link = match self.fetcher(queue) {
            Ok(link) if self.profile().answers_flows() => link,
            _ => {
                tokio::time::sleep(poll).await;
                return Ok(());
            }
        };
        loop {
            match fetch::count(&link, &self.shared.config).await {
                Ok(Some(0)) => tokio::time::sleep(poll).await,
                Ok(Some(_)) => return Ok(()),
                Ok(None) | Err(_) => {
                    tokio::time::sleep(poll).await;
                    return Ok(());
                }
            }
        }
    }

    /// Sends the clone to the verified queue its route is bound to (with native delays, a
    /// delayed clone to the queue its delay queue or cascade leads to, scheduled). The address
    /// is probed first if its verification is older than [`Amqp10Config::with_reverify_after`]
    /// or was made on an earlier publishing connection; a missing one, or a route no verified
    /// plan knows, fails with [`TransportError::MissingAddress`] and nothing is sent.
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        if let Some(why) = original.headers().get(UNDECODABLE_HEADER) {
            return PublishResult::Failed(TransportError::Unsupported {
                what: "a copy of a message that could not be decoded".to_owned(),
                why: format!(
                    "only its raw sections are known ({}): read it over AMQP 0-9-1 (retryctl parked show), where RabbitMQ shows it byte for byte, then purge it or publish a repaired one",
                    why.as_str().unwrap_or("no reason given")
                ),
            });
        }
        let target = match self.target(&publish.route) {
            Ok(t) => t,
            Err(e) => return PublishResult::Failed(e),
        };
        // A cascade route says its delay (rounded up to the cascade's unit, as the levels
        // would hold it); a delay queue's route says only its level, so the clone's delay
        // header (or expiration) is the one asked for.
        let schedule = match (target.native_delay, self.profile().native_delay()) {
            (true, Some(kind)) => Some(Schedule {
                kind,
                now: self.now(),
                delay: target
                    .delay
                    .or(publish.headers.delay)
                    .or(publish.expiration)
                    .unwrap_or_default(),
            }),
            _ => None,
        };
        let clone = build_clone(original, publish, schedule);
        // RabbitMQ accepts and drops a send to a missing queue: `send` verifies the address
        // first unless it was verified on its connection within the re-verification age.
        self.shared
            .publisher
            .send(&target.address, target.probe, clone)
            .await
    }

    async fn settle(&self, tag: &Amqp10Tag, settlement: Settlement) -> Result<(), TransportError> {
        receiver::settle(tag, settlement, self.shared.config.operation_timeout()).await
    }

    /// A walk on a fetch link and connection of its own: a delivery left stays unsettled on
    /// that link, and the end closes the connection, which puts back every one left at once.
    /// Releasing them one by one instead would requeue one message at a time, which RabbitMQ
    /// 3.10 does in worse than linear time. A fetch that waits past
    /// [`Amqp10Config::with_fetch_wait`] ends the walk as if the queue were empty.
    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<Amqp10Tag> + 'a>, TransportError> {
        if self.shared.is_closed() {
            return Err(TransportError::Closed);
        }
        Ok(Box::new(LinkWalk::open(
            &self.shared.nodes,
            &self.shared.config,
            queue,
        )))
    }

    /// [`Amqp10Transport::close`]: stops every subscription and fetch link and closes every
    /// connection.
    async fn close(&self) {
        // The inherent method, not this one.
        Amqp10Transport::close(self).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GenericProfile, NativeDelay};
    use retry_core::RetryPolicy;
    use std::collections::HashSet;

    fn routes(plan: &TopologyPlan) -> Routes {
        let mut r = Routes::default();
        r.learn(plan);
        r
    }

    fn orders() -> TopologyPlan {
        let policy = RetryPolicy::delays([Duration::from_secs(1), Duration::from_secs(60)])
            .build()
            .expect("policy");
        TopologyPlan::new("orders", &policy).expect("plan")
    }

    #[test]
    fn plan_routes_resolve_to_their_bound_queues() {
        let plan = orders();
        let r = routes(&plan);
        let (_, delay) = &plan.delay_routes()[1];
        assert_eq!(
            r.bound.get(&key(delay)).map(String::as_str),
            Some("orders.retry.1m")
        );
        assert_eq!(
            r.bound.get(&key(plan.parking_route())).map(String::as_str),
            Some("orders.parking")
        );
        assert_eq!(
            r.bound
                .get(&key(plan.isolation_route()))
                .map(String::as_str),
            Some("orders.suspect")
        );
        let (_, crash) = plan.crash_route().expect("crash route");
        assert_eq!(
            r.bound.get(&key(crash)).map(String::as_str),
            Some("orders.crash.1s")
        );
        let unique: HashSet<_> = r.bound.values().collect();
        assert_eq!(unique.len(), 5, "{unique:?}");
    }

    #[test]
    fn ttl_routes_remember_the_queue_they_expire_into() {
        let plan = orders();
        let r = routes(&plan);
        let (_, delay) = &plan.delay_routes()[0];
        assert_eq!(
            r.delays.get(&key(delay)).map(String::as_str),
            Some("orders")
        );
        let (_, crash) = plan.crash_route().expect("crash route");
        assert_eq!(
            r.delays.get(&key(crash)).map(String::as_str),
            Some("orders.suspect")
        );
        assert!(!r.delays.contains_key(&key(plan.isolation_route())));
        assert_eq!(r.delays.len(), 3);
    }

    #[test]
    fn native_delays_send_crashed_suspects_straight_back_to_isolation() {
        let plan = orders();
        let r = routes(&plan);
        let artemis = BrokerProfile::Generic(
            GenericProfile::new().with_native_delay(NativeDelay::DeliveryTime),
        );
        let (_, crash) = plan.crash_route().expect("crash route");
        let to_isolation = r.target(&artemis, crash).expect("target");
        assert_eq!(to_isolation.address, "orders.suspect");
        assert!(to_isolation.native_delay);
        let (_, delay) = &plan.delay_routes()[1];
        let to_work = r.target(&artemis, delay).expect("target");
        assert_eq!(to_work.address, "orders");
        assert!(to_work.native_delay);
        let isolate = r.target(&artemis, plan.isolation_route()).expect("target");
        assert_eq!(isolate.address, "orders.suspect");
        assert!(!isolate.native_delay, "isolating is not delayed");
    }

    fn checked(plan: &TopologyPlan, profile: &BrokerProfile) -> Vec<String> {
        checks(plan, profile)
            .into_iter()
            .map(|(_, address, _)| address)
            .collect()
    }

    #[test]
    fn verification_covers_the_isolation_and_crash_delay_queues() {
        let plan = orders();
        let rabbit = checked(&plan, &BrokerProfile::RabbitMq3);
        for queue in [
            "orders",
            "orders.retry.1s",
            "orders.retry.1m",
            "orders.suspect",
            "orders.crash.1s",
            "orders.parking",
        ] {
            assert!(
                rabbit.contains(&format!("/amq/queue/{queue}")),
                "{queue}: {rabbit:?}"
            );
        }
        assert!(
            rabbit.contains(&"/exchange/orders.retry".to_owned()),
            "{rabbit:?}"
        );

        let artemis = BrokerProfile::Generic(
            GenericProfile::new().with_native_delay(NativeDelay::DeliveryTime),
        );
        let native = checked(&plan, &artemis);
        assert_eq!(native, ["orders", "orders.suspect", "orders.parking"]);
    }

    #[test]
    fn a_route_no_verified_plan_knows_is_refused_on_every_profile() {
        let plan = orders();
        let (_, delay) = &plan.delay_routes()[0];
        let generic = BrokerProfile::Generic(GenericProfile::new());
        for profile in [BrokerProfile::RabbitMq3, generic] {
            let err = Routes::default()
                .target(&profile, delay)
                .expect_err("no plan verified");
            let TransportError::MissingAddress { address, hint } = &err else {
                panic!("{err:?}")
            };
            assert!(address.contains("orders.retry"), "{address}");
            assert!(hint.contains("verify"), "{hint}");
        }
        // A queue named by the default exchange is its own address, checked before a send.
        let direct = Route {
            exchange: "".into(),
            routing_key: "orders.retry.1s".into(),
        };
        let target = Routes::default()
            .target(&BrokerProfile::RabbitMq3, &direct)
            .expect("target");
        assert_eq!(target.address, "/amq/queue/orders.retry.1s");
        assert_eq!(target.probe, Probe::Receiver);
    }

    /// `queue`'s plan with `orders()`'s policy, through a cascade of 10 ms units.
    fn cascaded(queue: &str) -> TopologyPlan {
        let policy = RetryPolicy::delays([Duration::from_secs(1), Duration::from_secs(60)])
            .build()
            .expect("policy");
        TopologyPlan::builder(queue, &policy)
            .with_strategy(retry_core::DelayStrategy::Cascade(
                retry_core::Cascade::new(),
            ))
            .build()
            .expect("plan")
    }

    fn artemis() -> BrokerProfile {
        BrokerProfile::Generic(GenericProfile::new().with_native_delay(NativeDelay::DeliveryTime))
    }

    #[test]
    fn a_cascade_is_refused_without_native_delays() {
        let plan = cascaded("orders");
        let generic = BrokerProfile::Generic(GenericProfile::new());
        for (profile, instead) in [
            (BrokerProfile::RabbitMq3, "transport-amqp091"),
            (generic, "GenericProfile::with_native_delay"),
        ] {
            let err = unsupported(&plan, &profile).expect("refused");
            let TransportError::Unsupported { what, why } = &err else {
                panic!("{err:?}")
            };
            assert!(what.contains("retry.cascade.10ms.12"), "{what}");
            assert!(
                what.contains("\"orders\"") && what.contains(profile.name()),
                "{what}"
            );
            for says in [
                "can neither declare nor inspect bindings",
                "without a word",
                "lose retries silently",
                "DelayStrategy::PerDelayQueue",
                instead,
            ] {
                assert!(
                    why.contains(says),
                    "{}: {says:?} missing from {why}",
                    profile.name()
                );
            }
        }
        assert!(
            unsupported(&plan, &artemis()).is_none(),
            "native delays need no cascade"
        );
        for profile in [BrokerProfile::RabbitMq3, generic, artemis()] {
            assert!(
                unsupported(&orders(), &profile).is_none(),
                "no cascade, nothing refused"
            );
        }
    }

    #[test]
    fn native_delays_send_cascade_clones_straight_to_their_queue() {
        let plan = cascaded("orders");
        let cascade = plan.cascade().expect("cascade");
        let mut r = routes(&plan);
        // Another work queue of the same cascade, verified too.
        r.learn(&cascaded("payments"));
        assert_eq!(r.cascades.len(), 1, "one cascade, shared");
        let (retry, expiration) = plan.route_for(Duration::from_secs(20)).expect("route");
        assert_eq!(&*retry.exchange, cascade.entry_exchange());
        assert_eq!(expiration, None);
        let target = r.target(&artemis(), &retry).expect("target");
        assert_eq!(
            target,
            Target {
                address: "orders".into(),
                probe: Probe::Sender,
                native_delay: true,
                delay: Some(Duration::from_secs(20)),
            }
        );
        // The delay is the route's, rounded up to the unit as the levels would hold it.
        let (odd, _) = plan.route_for(Duration::from_millis(15)).expect("route");
        let odd = r.target(&artemis(), &odd).expect("target");
        assert_eq!(odd.delay, Some(Duration::from_millis(20)));
        // A crashed suspect goes back to the isolation queue the same way.
        let divert = r
            .target(&artemis(), &plan.divert_route(Duration::from_secs(1)))
            .expect("target");
        assert_eq!(divert.address, "orders.suspect");
        assert_eq!(divert.delay, Some(Duration::from_secs(1)));
        assert!(divert.native_delay);
        let theirs = cascade.route(Duration::from_secs(5), "payments");
        assert_eq!(
            r.target(&artemis(), &theirs).expect("target").address,
            "payments"
        );
        // Isolating is not delayed: it goes to the bound queue.
        let isolate = r
            .target(&artemis(), plan.isolation_route())
            .expect("target");
        assert_eq!(isolate.address, "orders.suspect");
        assert!(!isolate.native_delay && isolate.delay.is_none());

        // A destination no verified plan routes through the cascade, or a key that is not
        // a cascade's, is never sent.
        for stray in [
            cascade.route(Duration::from_secs(5), "invoices"),
            Route {
                exchange: retry.exchange.clone(),
                routing_key: "orders".into(),
            },
        ] {
            let err = r.target(&artemis(), &stray).expect_err("not verified");
            let TransportError::MissingAddress { address, hint } = &err else {
                panic!("{err:?}")
            };
            assert!(address.contains(cascade.entry_exchange()), "{address}");
            assert!(hint.contains("verify"), "{hint}");
        }
        // Without native delays nothing goes through the cascade, even from a plan learned.
        for profile in [
            BrokerProfile::RabbitMq3,
            BrokerProfile::Generic(GenericProfile::new()),
        ] {
            let err = r.target(&profile, &retry).expect_err("no native delays");
            assert!(
                matches!(err, TransportError::MissingAddress { .. }),
                "{err:?}"
            );
        }
        // And only the plan's own queues are verified: the cascade's objects are not needed.
        assert_eq!(
            checked(&plan, &artemis()),
            ["orders", "orders.suspect", "orders.parking"]
        );
    }

    #[test]
    fn without_native_delays_crashed_suspects_wait_in_the_crash_delay_queue() {
        let plan = orders();
        let r = routes(&plan);
        let (_, crash) = plan.crash_route().expect("crash route");
        let rabbit = r.target(&BrokerProfile::RabbitMq3, crash).expect("target");
        assert_eq!(rabbit.address, "/amq/queue/orders.crash.1s");
        assert_eq!(rabbit.probe, Probe::Receiver);
        assert!(!rabbit.native_delay);
        let generic = BrokerProfile::Generic(GenericProfile::new());
        let plain = r.target(&generic, crash).expect("target");
        assert_eq!(plain.address, "orders.crash.1s");
        assert!(!plain.native_delay);
    }
}
