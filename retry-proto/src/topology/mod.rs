//! `TopologyPlan`: the exchanges, queues and bindings a work queue needs for a policy, as
//! plain data. The core computes it; transports declare it.
//!
//! Names are derived from the work queue `Q`:
//!
//! | object | name | kind / arguments |
//! |---|---|---|
//! | work queue | `Q` | dead-letters to `Q.dead-letter` with routing key `Q` |
//! | retry exchange | `Q.retry` | direct |
//! | delay queue, one per delay level | `Q.retry.<delay>`, e.g. `Q.retry.30s`, `Q.retry.1m30s` | `x-message-ttl` = the delay; dead-letters to the default exchange with routing key `Q` |
//! | isolation queue | `Q.suspect` | dead-letters to `Q.dead-letter` with routing key `Q`; suspects wait here to run alone |
//! | crash-delay queue (with [`CrashAction::Divert`](crate::CrashAction::Divert)) | `Q.crash.<delay>` | `x-message-ttl` = the crash delay; dead-letters to the default exchange with routing key `Q.suspect` |
//! | dead-letter exchange | `Q.dead-letter` | direct |
//! | parking queue | `Q.parking` | none; bound to `Q.dead-letter` with key `Q` |
//!
//! Each delay queue, the crash-delay queue and the isolation queue are bound to `Q.retry`
//! with their own names as routing keys. Delays are written by
//! [`format_delay`](crate::format_delay). With [`QueueType::Quorum`], every queue is a
//! quorum queue and the queues that dead-letter use at-least-once dead-lettering (which
//! RabbitMQ requires to be paired with `x-overflow: reject-publish`).
//!
//! With [`DelayStrategy::Cascade`] there are no delay or crash-delay queues: every delayed
//! clone goes through a binary cascade of TTL levels shared by all work queues (see
//! [`CascadePlan`]), and the work queue and the isolation queue are bound to the cascade's
//! delivery exchange.

mod cascade;

pub use cascade::{
    Cascade, CascadePlan, DEFAULT_CASCADE_PREFIX, DEFAULT_CASCADE_UNIT, ExchangeBindingSpec,
    MAX_CASCADE_LEVELS,
};

use std::sync::Arc;
use std::time::Duration;

use crate::decision::Lane;
use crate::headers::{HeaderValue, Headers};
use crate::policy::RetryPolicy;
use crate::time::{duration_millis, format_delay};

/// Longest queue or exchange name AMQP 0-9-1 allows (a short string), in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// Classic or quorum queues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QueueType {
    /// RabbitMQ classic queues (the default).
    #[default]
    Classic,
    /// RabbitMQ quorum queues: replicated, with a delivery count.
    Quorum,
}

/// How delays are realised on the broker.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DelayStrategy {
    /// One TTL queue per distinct delay of the policy: the classic "retry queue" topology.
    /// A jittered or retry-after delay goes to the smallest level that holds it, with a
    /// per-message expiration for the difference; since a broker expires messages only at
    /// the head of a queue, such a clone can wait behind a longer one ahead of it.
    #[default]
    PerDelayQueue,
    /// A binary cascade of TTL levels shared by every work queue: any delay, rounded up to
    /// the cascade's unit, never waiting behind a longer one. See [`CascadePlan`].
    Cascade(Cascade),
}

/// Exchange types the plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    /// Routes by exact routing key.
    Direct,
    /// Routes to every bound queue.
    Fanout,
    /// Routes by routing-key pattern.
    Topic,
}

impl ExchangeKind {
    /// The AMQP spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
        }
    }
}

/// An exchange to declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangeSpec {
    /// Its name.
    pub name: String,
    /// Its type.
    pub kind: ExchangeKind,
    /// Whether it survives a broker restart.
    pub durable: bool,
}

/// What a queue is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueRole {
    /// The queue the consumer reads.
    Work,
    /// A delay queue nobody consumes; messages expire back to the work queue.
    Delay {
        /// Its TTL.
        ttl: Duration,
    },
    /// Where suspects (deliveries that came back redelivered) wait to run one at a time,
    /// with nothing else running. Consumers take from it one message at a time, never by
    /// subscription.
    Isolation,
    /// The delay a crashed suspect waits; messages expire back to the isolation queue.
    CrashDelay {
        /// Its TTL.
        ttl: Duration,
    },
    /// Where parked messages wait for a human.
    Parking,
    /// Level `level` of a delay cascade, shared by every work queue that uses it: every
    /// message waits `ttl`, then moves down a level.
    CascadeLevel {
        /// The level, from 0.
        level: u32,
        /// Its TTL: the cascade's unit × 2^level.
        ttl: Duration,
    },
}

impl QueueRole {
    /// How long a message waits in a queue of this role before it expires onward: the TTL
    /// of a delay, crash-delay or cascade queue; `None` for the others.
    ///
    /// ```
    /// use retry_proto::QueueRole;
    /// use std::time::Duration;
    ///
    /// let delay = QueueRole::Delay { ttl: Duration::from_secs(30) };
    /// assert_eq!(delay.ttl(), Some(Duration::from_secs(30)));
    /// assert_eq!(QueueRole::Parking.ttl(), None);
    /// ```
    pub fn ttl(self) -> Option<Duration> {
        match self {
            QueueRole::Delay { ttl }
            | QueueRole::CrashDelay { ttl }
            | QueueRole::CascadeLevel { ttl, .. } => Some(ttl),
            QueueRole::Work | QueueRole::Isolation | QueueRole::Parking => None,
        }
    }

    /// Its short name, as reports in JSON give it: `work`, `delay`, `isolation`,
    /// `crash-delay`, `parking` or `cascade-level`.
    ///
    /// ```
    /// use retry_proto::QueueRole;
    ///
    /// assert_eq!(QueueRole::Isolation.name(), "isolation");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            QueueRole::Work => "work",
            QueueRole::Delay { .. } => "delay",
            QueueRole::Isolation => "isolation",
            QueueRole::CrashDelay { .. } => "crash-delay",
            QueueRole::Parking => "parking",
            QueueRole::CascadeLevel { .. } => "cascade-level",
        }
    }

    /// What a queue of this role is for, in words, as operators' tools print it.
    ///
    /// ```
    /// use retry_proto::QueueRole;
    /// use std::time::Duration;
    ///
    /// let delay = QueueRole::Delay { ttl: Duration::from_secs(30) };
    /// assert_eq!(delay.describe(), "delay queue, 30s");
    /// ```
    pub fn describe(self) -> String {
        match self {
            QueueRole::Work => "work queue".into(),
            QueueRole::Delay { ttl } => format!("delay queue, {}", crate::format_delay(ttl)),
            QueueRole::Isolation => "isolation queue, where suspects run alone".into(),
            QueueRole::CrashDelay { ttl } => {
                format!("crash-delay queue, {}", crate::format_delay(ttl))
            }
            QueueRole::Parking => "parking queue".into(),
            QueueRole::CascadeLevel { level, ttl } => {
                format!("cascade level {level}, {}", crate::format_delay(ttl))
            }
        }
    }
}

/// `x-overflow` behaviours the plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// Refuse publishes when full (nack with confirms).
    RejectPublish,
}

/// Queue arguments, typed. [`QueueArguments::to_headers`] gives the `x-` table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueArguments {
    /// `x-queue-type`.
    pub queue_type: QueueType,
    /// `x-message-ttl`.
    pub message_ttl: Option<Duration>,
    /// `x-dead-letter-exchange` (`""` is the default exchange).
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-overflow`.
    pub overflow: Option<Overflow>,
    /// `x-dead-letter-strategy: at-least-once` (quorum queues only).
    pub at_least_once: bool,
    /// `x-delivery-limit` (quorum queues only).
    pub delivery_limit: Option<u32>,
    /// `x-quorum-initial-group-size` (quorum queues only): on how many nodes of a cluster
    /// the queue is replicated when it is created.
    pub initial_group_size: Option<u32>,
}

impl QueueArguments {
    /// The arguments as an AMQP argument table.
    ///
    /// ```
    /// use retry_proto::{HeaderValue, QueueArguments};
    /// use std::time::Duration;
    ///
    /// let args = QueueArguments {
    ///     message_ttl: Some(Duration::from_secs(30)),
    ///     dead_letter_exchange: Some(String::new()),
    ///     dead_letter_routing_key: Some("comments".into()),
    ///     ..QueueArguments::default()
    /// };
    /// let table = args.to_headers();
    /// assert_eq!(table.get("x-message-ttl"), Some(&HeaderValue::Int(30_000)));
    /// assert_eq!(table.get("x-queue-type"), Some(&HeaderValue::Str("classic".into())));
    /// ```
    pub fn to_headers(&self) -> Headers {
        let mut h = Headers::new();
        h.insert(
            "x-queue-type",
            match self.queue_type {
                QueueType::Classic => "classic",
                QueueType::Quorum => "quorum",
            },
        );
        if let Some(ttl) = self.message_ttl {
            let ms = i64::try_from(duration_millis(ttl)).unwrap_or(i64::MAX);
            h.insert("x-message-ttl", HeaderValue::Int(ms));
        }
        if let Some(x) = &self.dead_letter_exchange {
            h.insert("x-dead-letter-exchange", x.as_str());
        }
        if let Some(k) = &self.dead_letter_routing_key {
            h.insert("x-dead-letter-routing-key", k.as_str());
        }
        if let Some(Overflow::RejectPublish) = self.overflow {
            h.insert("x-overflow", "reject-publish");
        }
        if self.at_least_once {
            h.insert("x-dead-letter-strategy", "at-least-once");
        }
        if let Some(n) = self.delivery_limit {
            h.insert("x-delivery-limit", i64::from(n));
        }
        if let Some(n) = self.initial_group_size {
            h.insert("x-quorum-initial-group-size", i64::from(n));
        }
        h
    }
}

/// A queue to declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueSpec {
    /// Its name.
    pub name: String,
    /// What it is for.
    pub role: QueueRole,
    /// Whether it survives a broker restart.
    pub durable: bool,
    /// Its arguments.
    pub arguments: QueueArguments,
}

/// A binding to declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BindingSpec {
    /// The source exchange.
    pub exchange: String,
    /// The destination queue.
    pub queue: String,
    /// The routing key.
    pub routing_key: String,
}

/// Where a clone goes: an exchange and a routing key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Route {
    /// The exchange to publish to.
    pub exchange: Arc<str>,
    /// The routing key to publish with.
    pub routing_key: Arc<str>,
}

/// Why a plan could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The work queue name was empty.
    #[error("work queue name is empty")]
    EmptyQueueName,
    /// A replication factor of 0.
    #[error("a replication factor of 0 replicates to no node: give at least 1")]
    ZeroReplicationFactor,
    /// A replication factor for classic queues, which are never replicated.
    #[error(
        "a replication factor ({nodes}) needs quorum queues: classic queues live on one node (with_queue_type(QueueType::Quorum))"
    )]
    ReplicationNeedsQuorum {
        /// The factor given.
        nodes: u32,
    },
    /// The broker reserves names starting with `amq.`.
    #[error("work queue name {name:?} starts with \"amq.\", which the broker reserves")]
    ReservedQueueName {
        /// The name given.
        name: String,
    },
    /// The cascade's unit is not a whole number of milliseconds of at least 1 ms.
    #[error(
        "cascade unit {unit:?} must be a whole number of milliseconds, at least 1 ms (broker TTLs are milliseconds)"
    )]
    InvalidCascadeUnit {
        /// The unit given.
        unit: Duration,
    },
    /// The cascade's name prefix is empty or starts with `amq.`.
    #[error("cascade prefix {prefix:?} must be non-empty and must not start with \"amq.\"")]
    InvalidCascadePrefix {
        /// The prefix given.
        prefix: String,
    },
    /// The cascade's number of levels is out of range, or too few for the longest delay.
    #[error(
        "a cascade of {levels} levels is out of range: the policy's longest delay {longest:?} needs {needed} (at most 32)"
    )]
    CascadeLevels {
        /// The levels asked for.
        levels: u32,
        /// The fewest that hold the longest delay (33 when even 32 do not).
        needed: u32,
        /// The policy's longest delay.
        longest: Duration,
    },
    /// The cascade's top level would hold messages longer than a broker TTL can.
    #[error(
        "cascade level {level} would hold messages for {ttl:?}, longer than a broker TTL can (about 49.7 days): use a smaller unit or fewer levels"
    )]
    CascadeLevelTooLong {
        /// The top level.
        level: u32,
        /// Its TTL.
        ttl: Duration,
    },
    /// A destination queue's name has a word that a topic binding reads as a wildcard.
    #[error(
        "queue name {name:?} has a `*` or `#` word, which the cascade's topic bindings would read as a wildcard"
    )]
    WildcardInQueueName {
        /// The queue name.
        name: String,
    },
    /// A derived name would be longer than AMQP allows.
    #[error(
        "work queue name {name:?} is too long: derived name {derived:?} is {len} bytes, the limit is 255"
    )]
    NameTooLong {
        /// The work queue name.
        name: String,
        /// The longest derived name.
        derived: String,
        /// Its length in bytes.
        len: usize,
    },
}

/// Everything a work queue needs on the broker for a policy.
///
/// ```
/// use retry_proto::{QueueRole, RetryPolicy, TopologyPlan};
/// use std::time::Duration;
///
/// let spring = RetryPolicy::exponential(Duration::from_secs(1), 3.0, Duration::from_secs(10))
///     .with_max_attempts(5)
///     .build()?;
/// let plan = TopologyPlan::new("comments", &spring)?;
/// let delay_queues: Vec<&str> = plan
///     .queues()
///     .iter()
///     .filter(|q| matches!(q.role, QueueRole::Delay { .. }))
///     .map(|q| q.name.as_str())
///     .collect();
/// assert_eq!(delay_queues, ["comments.retry.1s", "comments.retry.3s", "comments.retry.9s", "comments.retry.10s"]);
/// assert_eq!(plan.parking_queue(), "comments.parking");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyPlan {
    work_queue: String,
    exchanges: Vec<ExchangeSpec>,
    queues: Vec<QueueSpec>,
    bindings: Vec<BindingSpec>,
    delay_routes: Vec<(Duration, Route)>,
    isolation_queue: String,
    isolation_route: Route,
    crash_route: Option<(Duration, Route)>,
    parking_route: Route,
    parking_queue: String,
    cascade: Option<CascadePlan>,
}

impl TopologyPlan {
    /// The plan for `work_queue` and `policy` with classic queues and one TTL queue per delay.
    pub fn new(work_queue: &str, policy: &RetryPolicy) -> Result<Self, TopologyError> {
        Self::builder(work_queue, policy).build()
    }

    /// A builder, for quorum queues or a delivery limit.
    pub fn builder<'a>(work_queue: &'a str, policy: &'a RetryPolicy) -> TopologyBuilder<'a> {
        TopologyBuilder {
            work_queue,
            policy,
            queue_type: QueueType::Classic,
            delivery_limit: None,
            replication_factor: None,
            strategy: DelayStrategy::PerDelayQueue,
        }
    }

    /// The work queue.
    pub fn work_queue(&self) -> &str {
        &self.work_queue
    }

    /// The type of every queue of the plan.
    ///
    /// ```
    /// use retry_proto::{QueueType, RetryPolicy, TopologyPlan};
    ///
    /// let policy = RetryPolicy::default();
    /// let plan = TopologyPlan::builder("orders", &policy).with_queue_type(QueueType::Quorum).build()?;
    /// assert_eq!(plan.queue_type(), QueueType::Quorum);
    /// # Ok::<(), retry_proto::TopologyError>(())
    /// ```
    pub fn queue_type(&self) -> QueueType {
        self.queues[0].arguments.queue_type
    }

    /// The exchanges to declare.
    pub fn exchanges(&self) -> &[ExchangeSpec] {
        &self.exchanges
    }

    /// The queues to declare, the work queue first.
    pub fn queues(&self) -> &[QueueSpec] {
        &self.queues
    }

    /// The bindings to declare. With a cascade, these include the work queue's (and the
    /// isolation queue's) binding to the cascade's delivery exchange.
    pub fn bindings(&self) -> &[BindingSpec] {
        &self.bindings
    }

    /// The delay cascade, with [`DelayStrategy::Cascade`]: shared objects to provision
    /// before [`exchanges`](Self::exchanges), [`queues`](Self::queues) and
    /// [`bindings`](Self::bindings), and never to delete with this work queue's.
    pub fn cascade(&self) -> Option<&CascadePlan> {
        self.cascade.as_ref()
    }

    /// The parking (dead-letter) queue.
    pub fn parking_queue(&self) -> &str {
        &self.parking_queue
    }

    /// The name of `work_queue`'s parking queue, whatever the policy: `Q.parking`.
    ///
    /// ```
    /// use retry_proto::TopologyPlan;
    ///
    /// assert_eq!(TopologyPlan::parking_queue_of("comments"), "comments.parking");
    /// ```
    pub fn parking_queue_of(work_queue: &str) -> String {
        format!("{work_queue}.parking")
    }

    /// The route parked clones are published to.
    pub fn parking_route(&self) -> &Route {
        &self.parking_route
    }

    /// The delay levels, ascending, each with its route; empty with a cascade, which has
    /// no per-delay routes.
    pub fn delay_routes(&self) -> &[(Duration, Route)] {
        &self.delay_routes
    }

    /// The isolation queue: where suspects wait to run alone.
    pub fn isolation_queue(&self) -> &str {
        &self.isolation_queue
    }

    /// The queue a lane takes its deliveries from: the work queue or the isolation queue.
    ///
    /// ```
    /// use retry_proto::{Lane, RetryPolicy, TopologyPlan};
    ///
    /// let plan = TopologyPlan::new("comments", &RetryPolicy::default())?;
    /// assert_eq!(plan.lane_queue(Lane::Work), "comments");
    /// assert_eq!(plan.lane_queue(Lane::Isolation), "comments.suspect");
    /// # Ok::<(), retry_proto::TopologyError>(())
    /// ```
    pub fn lane_queue(&self, lane: Lane) -> &str {
        match lane {
            Lane::Work => self.work_queue(),
            Lane::Isolation => self.isolation_queue(),
        }
    }

    /// The route into the isolation queue.
    pub fn isolation_route(&self) -> &Route {
        &self.isolation_route
    }

    /// The crash delay and the route into its queue, which expires back into the isolation
    /// queue; `None` when crashed suspects go straight back to the isolation queue, or wait
    /// in the cascade.
    pub fn crash_route(&self) -> Option<(Duration, &Route)> {
        self.crash_route.as_ref().map(|(d, r)| (*d, r))
    }

    /// The route for a crashed suspect that waits `delay` before it goes back to the
    /// isolation queue: the crash-delay queue when `delay` is its TTL, the cascade with one,
    /// and the isolation queue itself for a zero delay (or one the plan has no queue for).
    ///
    /// ```
    /// use retry_proto::{CrashAction, RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::builder()
    ///     .with_on_crash(CrashAction::Divert)
    ///     .with_crash_delay(Duration::from_secs(5))
    ///     .build()?;
    /// let plan = TopologyPlan::new("q", &policy)?;
    /// assert_eq!(&*plan.divert_route(Duration::from_secs(5)).routing_key, "q.crash.5s");
    /// assert_eq!(&*plan.divert_route(Duration::ZERO).routing_key, "q.suspect");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn divert_route(&self, delay: Duration) -> Route {
        if let Some(cascade) = &self.cascade
            && !delay.is_zero()
        {
            return cascade.route(delay, &self.isolation_queue);
        }
        match &self.crash_route {
            Some((level, route)) if *level == delay => route.clone(),
            _ => self.isolation_route.clone(),
        }
    }

    /// The queues of this plan that a message dead-lettered from `spec` reaches: through the
    /// default exchange, the queue named by its dead-letter routing key; through another
    /// exchange of the plan, the queues bound to it with that key. None for a queue that
    /// does not dead-letter.
    ///
    /// ```
    /// use retry_proto::{QueueRole, RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("orders", &policy)?;
    /// let delay = plan.queues().iter().find(|q| matches!(q.role, QueueRole::Delay { .. })).unwrap();
    /// assert_eq!(plan.dead_letter_destinations(delay), ["orders"]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dead_letter_destinations<'p>(&'p self, spec: &'p QueueSpec) -> Vec<&'p str> {
        let args = &spec.arguments;
        let (Some(exchange), Some(key)) =
            (&args.dead_letter_exchange, &args.dead_letter_routing_key)
        else {
            return Vec::new();
        };
        if exchange.is_empty() {
            return vec![key.as_str()];
        }
        self.bindings
            .iter()
            .filter(|b| &b.exchange == exchange && &b.routing_key == key)
            .map(|b| b.queue.as_str())
            .collect()
    }

    /// Every route that leads into a TTL queue, with the queue it expires into: the delay
    /// levels into the work queue, and the crash delay into the isolation queue. A transport
    /// with native scheduled delivery sends these straight to the destination instead.
    pub fn delayed_destinations(&self) -> impl Iterator<Item = (Duration, &Route, &str)> {
        self.delay_routes
            .iter()
            .map(|(d, r)| (*d, r, self.work_queue.as_str()))
            .chain(
                self.crash_route
                    .iter()
                    .map(|(d, r)| (*d, r, self.isolation_queue.as_str())),
            )
    }

    /// The queue of this plan a publish on `route` lands in, as the plan's exchanges and
    /// bindings route it: for a transport whose broker has no exchanges, which publishes
    /// to that queue itself. A route on the default exchange (`""`) names its queue. `None`
    /// for a route the plan does not bind to a queue of its own (a cascade's, or another
    /// plan's).
    ///
    /// ```
    /// use retry_proto::{QueueRole, RetryPolicy, Route, TopologyPlan};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("orders", &policy)?;
    /// let (_, retry) = &plan.delay_routes()[0];
    /// let queue = plan.queue_behind(retry).unwrap();
    /// assert_eq!(queue.name, "orders.retry.30s");
    /// assert_eq!(queue.role, QueueRole::Delay { ttl: Duration::from_secs(30) });
    /// assert_eq!(plan.queue_behind(plan.parking_route()).unwrap().name, "orders.parking");
    /// let direct = Route { exchange: "".into(), routing_key: "orders".into() };
    /// assert_eq!(plan.queue_behind(&direct).unwrap().name, "orders");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn queue_behind(&self, route: &Route) -> Option<&QueueSpec> {
        let name = if route.exchange.is_empty() {
            &*route.routing_key
        } else {
            self.bindings
                .iter()
                .find(|b| *b.exchange == *route.exchange && *b.routing_key == *route.routing_key)
                .map(|b| b.queue.as_str())?
        };
        self.queues.iter().find(|q| q.name == name)
    }

    /// The route for a delay, and the per-message expiration to set when the delay is shorter
    /// than the level it goes to. The level is the smallest one that holds `delay`, or the
    /// largest if none does; `None` when the plan has no delay levels. With a cascade, the
    /// route through it to the work queue, with no expiration: every delay, rounded up to
    /// the unit (and cut to the longest the cascade holds).
    ///
    /// ```
    /// use retry_proto::{RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([10, 60].map(Duration::from_secs)).build()?;
    /// let plan = TopologyPlan::new("q", &policy)?;
    /// let (route, expiration) = plan.route_for(Duration::from_secs(20)).unwrap();
    /// assert_eq!(&*route.routing_key, "q.retry.1m");
    /// assert_eq!(expiration, Some(Duration::from_secs(20)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn route_for(&self, delay: Duration) -> Option<(Route, Option<Duration>)> {
        if let Some(cascade) = &self.cascade {
            return Some((cascade.route(delay, &self.work_queue), None));
        }
        let (level, route) = self
            .delay_routes
            .iter()
            .find(|(level, _)| *level >= delay)
            .or(self.delay_routes.last())?;
        let expiration = (delay < *level).then_some(delay);
        Some((route.clone(), expiration))
    }
}

/// Builds a [`TopologyPlan`]. Defaults: classic queues, no delivery limit,
/// [`DelayStrategy::PerDelayQueue`].
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct TopologyBuilder<'a> {
    work_queue: &'a str,
    policy: &'a RetryPolicy,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    replication_factor: Option<u32>,
    strategy: DelayStrategy,
}

impl TopologyBuilder<'_> {
    /// Classic or quorum queues.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Quorum only: the broker dead-letters a message (to the parking queue, reason
    /// `delivery_limit`) after this many returns to the work queue. It backs up the engine's
    /// crash limit for consumers that run the handler on redelivery.
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// Quorum only: on how many nodes of a cluster every queue of the plan (work, delay
    /// levels or cascade levels, isolation, crash delay and parking) is replicated when it
    /// is created (`x-quorum-initial-group-size`). Without it the broker replicates to every
    /// node (RabbitMQ 3.10 caps that with its `quorum_cluster_size` setting, 3 by default).
    /// Refused at [`build`](Self::build) for classic queues and for 0.
    ///
    /// ```
    /// use retry_proto::{HeaderValue, QueueType, RetryPolicy, TopologyPlan};
    ///
    /// let policy = RetryPolicy::default();
    /// let plan = TopologyPlan::builder("orders", &policy)
    ///     .with_queue_type(QueueType::Quorum)
    ///     .with_replication_factor(3)
    ///     .build()?;
    /// for queue in plan.queues() {
    ///     let args = queue.arguments.to_headers();
    ///     assert_eq!(args.get("x-quorum-initial-group-size"), Some(&HeaderValue::Int(3)));
    /// }
    /// # Ok::<(), retry_proto::TopologyError>(())
    /// ```
    pub fn with_replication_factor(mut self, nodes: u32) -> Self {
        self.replication_factor = Some(nodes);
        self
    }

    /// How delays are realised.
    pub fn with_strategy(mut self, strategy: DelayStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Validates the name and computes the plan.
    pub fn build(self) -> Result<TopologyPlan, TopologyError> {
        let q = self.work_queue;
        if q.is_empty() {
            return Err(TopologyError::EmptyQueueName);
        }
        if q.starts_with("amq.") {
            return Err(TopologyError::ReservedQueueName { name: q.to_owned() });
        }
        match self.replication_factor {
            Some(0) => return Err(TopologyError::ZeroReplicationFactor),
            Some(nodes) if self.queue_type != QueueType::Quorum => {
                return Err(TopologyError::ReplicationNeedsQuorum { nodes });
            }
            _ => {}
        }
        let replicated = |mut queues: Vec<QueueSpec>| {
            for queue in &mut queues {
                queue.arguments.initial_group_size = self.replication_factor;
            }
            queues
        };
        let cascade = match &self.strategy {
            DelayStrategy::PerDelayQueue => None,
            DelayStrategy::Cascade(settings) => {
                let longest = self.policy.longest_broker_delay().unwrap_or_default();
                let mut cascade = CascadePlan::new(settings, self.queue_type, longest)?;
                cascade.queues = replicated(std::mem::take(&mut cascade.queues));
                Some(cascade)
            }
        };
        let quorum = self.queue_type == QueueType::Quorum;
        let retry_exchange = format!("{q}.retry");
        let dead_letter_exchange = format!("{q}.dead-letter");
        let parking_queue = TopologyPlan::parking_queue_of(q);
        let isolation_queue = format!("{q}.suspect");

        let args = |ttl: Option<Duration>, dlx: Option<&str>| QueueArguments {
            queue_type: self.queue_type,
            message_ttl: ttl,
            dead_letter_exchange: dlx.map(str::to_owned),
            dead_letter_routing_key: dlx.map(|_| q.to_owned()),
            overflow: (quorum && dlx.is_some()).then_some(Overflow::RejectPublish),
            at_least_once: quorum && dlx.is_some(),
            delivery_limit: None,
            initial_group_size: None,
        };

        // A redelivered work delivery, or one rejected past a quorum delivery limit, is
        // parked by the broker through the dead-letter exchange: the same for suspects.
        let mut work_args = args(None, Some(&dead_letter_exchange));
        if quorum {
            work_args.delivery_limit = self.delivery_limit;
        }
        let mut queues = vec![QueueSpec {
            name: q.to_owned(),
            role: QueueRole::Work,
            durable: true,
            arguments: work_args.clone(),
        }];
        let mut bindings = Vec::new();
        let retry_exchange_arc: Arc<str> = Arc::from(retry_exchange.as_str());
        // Every queue the engine publishes into hangs off the retry exchange by its name.
        let mut routed_queue = |queues: &mut Vec<QueueSpec>, spec: QueueSpec| {
            bindings.push(BindingSpec {
                exchange: retry_exchange.clone(),
                queue: spec.name.clone(),
                routing_key: spec.name.clone(),
            });
            let route = Route {
                exchange: retry_exchange_arc.clone(),
                routing_key: Arc::from(spec.name.as_str()),
            };
            queues.push(spec);
            route
        };
        let mut delay_routes = Vec::new();
        let per_delay_levels = match cascade {
            None => self.policy.delay_levels(),
            Some(_) => &[],
        };
        for &ttl in per_delay_levels {
            let spec = QueueSpec {
                name: format!("{q}.retry.{}", format_delay(ttl)),
                role: QueueRole::Delay { ttl },
                durable: true,
                arguments: args(Some(ttl), Some("")),
            };
            delay_routes.push((ttl, routed_queue(&mut queues, spec)));
        }
        let isolation_route = routed_queue(
            &mut queues,
            QueueSpec {
                name: isolation_queue.clone(),
                role: QueueRole::Isolation,
                durable: true,
                arguments: work_args,
            },
        );
        let crash_delay_queue = self
            .policy
            .crash_delay_level()
            .filter(|_| cascade.is_none());
        let crash_route = crash_delay_queue.map(|ttl| {
            let mut arguments = args(Some(ttl), Some(""));
            arguments.dead_letter_routing_key = Some(isolation_queue.clone());
            let spec = QueueSpec {
                name: format!("{q}.crash.{}", format_delay(ttl)),
                role: QueueRole::CrashDelay { ttl },
                durable: true,
                arguments,
            };
            (ttl, routed_queue(&mut queues, spec))
        });
        queues.push(QueueSpec {
            name: parking_queue.clone(),
            role: QueueRole::Parking,
            durable: true,
            arguments: args(None, None),
        });
        bindings.push(BindingSpec {
            exchange: dead_letter_exchange.clone(),
            queue: parking_queue.clone(),
            routing_key: q.to_owned(),
        });
        if let Some(cascade) = &cascade {
            // Delayed retries come back to the work queue, crashed suspects to isolation.
            let destinations = std::iter::once(q).chain(
                self.policy
                    .crash_delay_level()
                    .map(|_| isolation_queue.as_str()),
            );
            for destination in destinations {
                if destination.split('.').any(|w| w == "*" || w == "#") {
                    return Err(TopologyError::WildcardInQueueName {
                        name: destination.to_owned(),
                    });
                }
                bindings.push(BindingSpec {
                    exchange: cascade.delivery_exchange().to_owned(),
                    queue: destination.to_owned(),
                    routing_key: CascadePlan::delivery_pattern(destination),
                });
            }
        }
        let exchanges = vec![
            ExchangeSpec {
                name: retry_exchange,
                kind: ExchangeKind::Direct,
                durable: true,
            },
            ExchangeSpec {
                name: dead_letter_exchange.clone(),
                kind: ExchangeKind::Direct,
                durable: true,
            },
        ];

        // A routing key is a short string too: the cascade's are 64 bytes longer than the
        // queue they lead to.
        let cascade_names = cascade.iter().flat_map(|c| {
            c.queues()
                .iter()
                .map(|s| s.name.as_str())
                .chain(c.exchanges().iter().map(|e| e.name.as_str()))
        });
        let longest = queues
            .iter()
            .map(|s| s.name.as_str())
            .chain(exchanges.iter().map(|e| e.name.as_str()))
            .chain(bindings.iter().map(|b| b.routing_key.as_str()))
            .chain(cascade_names)
            .max_by_key(|n| n.len())
            .unwrap_or(q);
        if longest.len() > MAX_NAME_LEN {
            return Err(TopologyError::NameTooLong {
                name: q.to_owned(),
                derived: longest.to_owned(),
                len: longest.len(),
            });
        }
        Ok(TopologyPlan {
            work_queue: q.to_owned(),
            exchanges,
            queues: replicated(queues),
            bindings,
            delay_routes,
            isolation_queue,
            isolation_route,
            crash_route,
            parking_route: Route {
                exchange: Arc::from(dead_letter_exchange),
                routing_key: Arc::from(q),
            },
            parking_queue,
            cascade,
        })
    }
}
