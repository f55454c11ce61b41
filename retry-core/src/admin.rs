//! What operators' tools ask of a broker beside the data path: [`Admin`] (how deep a queue
//! is, create a plan's objects, check the broker against a plan) and [`Layout`] (how a
//! transport lays a plan out, without connecting).
//!
//! A transport implements [`Transport`] for consumers and, to get `retryctl` and its
//! console, [`Admin`] too; its [`Registration`](crate::Registration) hands it out with
//! [`DynTransport::with_admin`](crate::DynTransport::with_admin) and may carry a [`Layout`]
//! of its own. `retryctl` speaks only these traits: it has no code for any broker.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Message, QueueType, RetryPolicy, TopologyError, TopologyPlan, Transport, TransportError,
};

/// How many messages a queue holds, as far as a transport can tell without taking any.
///
/// ```
/// use retry_core::Depth;
///
/// assert_eq!(Depth::Ready(3).ready(), Some(3));
/// assert_eq!(Depth::Unknown.ready(), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Depth {
    /// There is no such queue.
    Missing,
    /// It exists, with this many messages ready.
    Ready(u64),
    /// The transport cannot tell: a walk of the queue finds out.
    Unknown,
}

impl Depth {
    /// The messages ready, when the transport counted them.
    pub fn ready(self) -> Option<u64> {
        match self {
            Depth::Ready(n) => Some(n),
            Depth::Missing | Depth::Unknown => None,
        }
    }
}

/// What [`Admin::apply`] did with one object of a plan.
///
/// ```
/// use retry_core::Applied;
///
/// assert_eq!(Applied::Created.as_str(), "created");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// It did not exist, and was created.
    Created,
    /// It existed with the planned settings.
    Verified,
    /// It was declared without asking first (a binding): it exists now as planned.
    Declared,
}

impl Applied {
    /// The word a report shows: `created`, `verified` or `declared`.
    pub fn as_str(self) -> &'static str {
        match self {
            Applied::Created => "created",
            Applied::Verified => "verified",
            Applied::Declared => "declared",
        }
    }
}

/// One object of a plan on the broker, as [`Admin::apply`] reports it.
///
/// ```
/// use retry_core::{Applied, AppliedObject};
///
/// let line = AppliedObject::new("queue comments.parking", Applied::Verified);
/// assert_eq!(line.object, "queue comments.parking");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AppliedObject {
    /// The object as an operator names it: `queue comments.parking`, `stream ...`.
    pub object: String,
    /// What was done.
    pub applied: Applied,
}

impl AppliedObject {
    /// `object`, and what was done with it.
    pub fn new(object: impl Into<String>, applied: Applied) -> Self {
        AppliedObject {
            object: object.into(),
            applied,
        }
    }
}

/// What [`Admin::check`] found of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checked {
    /// It is as planned; the text says more when it is not empty (`2 ready, 1 consumers`).
    Ok(String),
    /// It does not exist.
    Missing,
    /// It exists but is not as planned, or could not be checked: why.
    Failed(String),
}

/// One object of a plan, as [`Admin::check`] found it.
///
/// ```
/// use retry_core::{Checked, ObjectCheck};
///
/// let line = ObjectCheck::new("queue comments", Checked::Missing).for_queue("comments");
/// assert!(line.is_problem());
/// assert_eq!(line.queue.as_deref(), Some("comments"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectCheck {
    /// The object as an operator names it.
    pub object: String,
    /// The plan's queue this object holds, when it holds one (a stream, a queue); a tool
    /// tells a missing work queue (a wrong name, most likely) from other mismatches by it.
    pub queue: Option<String>,
    /// What was found.
    pub checked: Checked,
}

impl ObjectCheck {
    /// `object`, and what was found.
    pub fn new(object: impl Into<String>, checked: Checked) -> Self {
        ObjectCheck {
            object: object.into(),
            queue: None,
            checked,
        }
    }

    /// This object holds the plan's queue `queue`.
    pub fn for_queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// Whether it is not as planned.
    pub fn is_problem(&self) -> bool {
        !matches!(self.checked, Checked::Ok(_))
    }
}

/// What [`Admin::check`] found: each object of the plan, in the plan's order, and remarks.
///
/// ```
/// use retry_core::{CheckReport, Checked, ObjectCheck};
///
/// let report = CheckReport::new(vec![
///     ObjectCheck::new("queue comments", Checked::Ok(String::new())).for_queue("comments"),
///     ObjectCheck::new("queue comments.parking", Checked::Missing).for_queue("comments.parking"),
/// ]);
/// assert_eq!(report.problems(), 1);
/// assert!(!report.is_missing("comments"));
/// assert!(report.is_missing("comments.parking"));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckReport {
    /// How far the check went, when not as far as the broker allows a check to go, for the
    /// report's heading: `over AMQP 1.0: that every object exists (...)`.
    pub scope: Option<String>,
    /// Each object of the plan.
    pub objects: Vec<ObjectCheck>,
    /// Remarks that are no mismatch (`acknowledged 1 probe(s) of an earlier run ...`).
    pub notes: Vec<String>,
}

impl CheckReport {
    /// A report of `objects`, with no scope and no notes.
    pub fn new(objects: Vec<ObjectCheck>) -> Self {
        CheckReport {
            scope: None,
            objects,
            notes: Vec::new(),
        }
    }

    /// The same report, saying how far the check went.
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// The same report, with a remark.
    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    /// How many objects are not as planned.
    pub fn problems(&self) -> usize {
        self.objects.iter().filter(|o| o.is_problem()).count()
    }

    /// Whether the object holding `queue` was found missing.
    pub fn is_missing(&self, queue: &str) -> bool {
        self.objects
            .iter()
            .any(|o| o.queue.as_deref() == Some(queue) && o.checked == Checked::Missing)
    }
}

/// What an operator asked of a plan beside the policy: the queue type, the replication
/// factor, and how long a check's probes may wait. A [`Layout`] refuses what does not apply
/// to its transport.
///
/// ```
/// use retry_core::{PlanOptions, QueueType};
/// use std::time::Duration;
///
/// let options = PlanOptions::new()
///     .with_queue_type(QueueType::Quorum)
///     .with_replication_factor(3)
///     .with_max_probe_ttl(Duration::from_secs(5));
/// assert_eq!(options.replication_factor, Some(3));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanOptions {
    /// Classic or quorum queues; the layout's default when not given.
    pub queue_type: Option<QueueType>,
    /// On how many nodes (or servers) each queue is kept.
    pub replication_factor: Option<u32>,
    /// The longest a probe of [`Admin::check`] waits in a delay queue.
    pub max_probe_ttl: Option<Duration>,
}

impl PlanOptions {
    /// No option: every default.
    pub fn new() -> Self {
        PlanOptions::default()
    }

    /// Asks for `queue_type`.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = Some(queue_type);
        self
    }

    /// Asks for each queue on `nodes` nodes.
    pub fn with_replication_factor(mut self, nodes: u32) -> Self {
        self.replication_factor = Some(nodes);
        self
    }

    /// Lets a check's probes wait `ttl` at most.
    pub fn with_max_probe_ttl(mut self, ttl: Duration) -> Self {
        self.max_probe_ttl = Some(ttl);
        self
    }
}

/// One of the [`PlanOptions`], as an error names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanOption {
    /// [`PlanOptions::queue_type`] set to quorum.
    Quorum,
    /// [`PlanOptions::queue_type`] set to classic.
    Classic,
    /// [`PlanOptions::replication_factor`].
    ReplicationFactor,
    /// [`PlanOptions::max_probe_ttl`].
    MaxProbeTtl,
}

impl fmt::Display for PlanOption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlanOption::Quorum => "a quorum queue type",
            PlanOption::Classic => "a classic queue type",
            PlanOption::ReplicationFactor => "a replication factor",
            PlanOption::MaxProbeTtl => "a probe TTL",
        })
    }
}

/// Why a [`Layout`] made no plan.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// An option that does not apply to this transport.
    #[error("{option} does not apply on {transport}: {why}")]
    Unsupported {
        /// The option.
        option: PlanOption,
        /// The transport's title.
        transport: String,
        /// Why, and what to do instead.
        why: String,
    },
    /// An option's value this transport cannot take.
    #[error("{option} of {value} on {transport}: {why}")]
    OutOfRange {
        /// The option.
        option: PlanOption,
        /// The value given.
        value: String,
        /// The transport's title.
        transport: String,
        /// The values it takes.
        why: String,
    },
    /// A plan this transport cannot lay out (a delay cascade, say): why, and what to do
    /// instead.
    #[error("no plan for queue {queue:?} on {transport}: {why}")]
    Refused {
        /// The work queue.
        queue: String,
        /// The transport's title.
        transport: String,
        /// Why, and what to do instead.
        why: String,
    },
    /// A queue of the plan has a name this transport cannot use.
    #[error("no plan for queue {queue:?} on {transport}")]
    BadName {
        /// The work queue.
        queue: String,
        /// The transport's title.
        transport: String,
        /// What is wrong with the name.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The policy and options make no plan.
    #[error("no plan for queue {queue:?}")]
    Topology {
        /// The work queue.
        queue: String,
        /// Why.
        #[source]
        source: TopologyError,
    },
}

/// A plan as a transport shows it to operators when it lays the plan out in objects of its
/// own (streams, not exchanges and queues): text, and a JSON document.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PlanView {
    /// Lines for a terminal.
    pub text: String,
    /// The same, as a JSON document.
    pub json: String,
}

impl PlanView {
    /// A view of `text` and `json`.
    pub fn new(text: impl Into<String>, json: impl Into<String>) -> Self {
        PlanView {
            text: text.into(),
            json: json.into(),
        }
    }
}

/// How a transport lays a plan out, known without connecting: `retryctl topology plan`
/// needs no broker. The default methods are RabbitMQ's layout (exchanges, queues and
/// bindings as [`TopologyPlan`] has them); a transport whose objects differ overrides them.
///
/// ```
/// use retry_core::{DefaultLayout, Layout, PlanOptions, QueueType, RetryPolicy};
///
/// let policy = RetryPolicy::default();
/// let layout = DefaultLayout;
/// let one = layout.plan("amqp://n1:5672", "comments", &policy, &PlanOptions::new())?;
/// assert_eq!(one.queue_type(), QueueType::Classic);
/// let cluster = layout.plan("amqp://n1:5672,amqp://n2:5672", "comments", &policy, &PlanOptions::new())?;
/// assert_eq!(cluster.queue_type(), QueueType::Quorum);
/// assert!(layout.view(&one, &PlanOptions::new()).is_none());
/// # Ok::<(), retry_core::PlanError>(())
/// ```
pub trait Layout: Send + Sync + 'static {
    /// The plan of work queue `queue` under `policy` for the broker at `url` (one URL, or
    /// a cluster's nodes separated by commas). The default: quorum queues when
    /// `options` ask for them, give a replication factor, or `url` lists several nodes;
    /// classic ones otherwise.
    fn plan(
        &self,
        url: &str,
        queue: &str,
        policy: &RetryPolicy,
        options: &PlanOptions,
    ) -> Result<TopologyPlan, PlanError> {
        let queue_type = match (options.queue_type, options.replication_factor) {
            (Some(t), _) => t,
            (None, Some(_)) => QueueType::Quorum,
            (None, None) if url.split(',').filter(|n| !n.trim().is_empty()).count() > 1 => {
                QueueType::Quorum
            }
            (None, None) => QueueType::Classic,
        };
        let mut builder = TopologyPlan::builder(queue, policy).with_queue_type(queue_type);
        if let Some(nodes) = options.replication_factor {
            builder = builder.with_replication_factor(nodes);
        }
        builder.build().map_err(|source| PlanError::Topology {
            queue: queue.to_owned(),
            source,
        })
    }

    /// The plan as operators read it, when this transport's objects are not the plan's
    /// exchanges, queues and bindings. The default: `None`, the plan's own form.
    fn view(&self, plan: &TopologyPlan, options: &PlanOptions) -> Option<PlanView> {
        let _ = (plan, options);
        None
    }

    /// The connection settings (`ConnectOptions::with_setting`) that `options` call for:
    /// on NATS, a replication factor is the streams' `replicas`. The default: none.
    fn settings(&self, options: &PlanOptions) -> Vec<(String, String)> {
        let _ = options;
        Vec::new()
    }
}

/// RabbitMQ's layout: [`Layout`]'s default methods.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultLayout;

impl Layout for DefaultLayout {}

/// What operators' tools ask of a broker beside the data path. `retryctl` and its console
/// call nothing else, through a [`DynTransport`](crate::DynTransport) made with
/// [`DynTransport::with_admin`](crate::DynTransport::with_admin).
///
/// ```
/// # use async_trait::async_trait;
/// # use retry_core::*;
/// # use std::time::Duration;
/// # struct Broker;
/// # #[async_trait]
/// # impl Transport for Broker {
/// #   type Tag = u64;
/// #   type Subscription = Broker;
/// #   fn capabilities(&self) -> Capabilities { Capabilities::default() }
/// #   async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
/// #   async fn consume(&self, _: &str, _: u16) -> Result<Broker, TransportError> { Ok(Broker) }
/// #   async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #   async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> { Ok(()) }
/// #   async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
/// #   async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # #[async_trait]
/// # impl Subscription for Broker {
/// #     type Tag = u64;
/// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
/// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # impl Broker { async fn queue_len(&self, _: &str) -> Option<u64> { Some(0) } }
/// #[async_trait]
/// impl Admin for Broker {
///     async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
///         Ok(self.queue_len(queue).await.map_or(Depth::Missing, Depth::Ready))
///     }
///
///     async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
///         self.provision(plan).await?;
///         Ok(plan
///             .queues()
///             .iter()
///             .map(|q| AppliedObject::new(format!("queue {}", q.name), Applied::Declared))
///             .collect())
///     }
///
///     async fn check(&self, plan: &TopologyPlan, _: &PlanOptions) -> Result<CheckReport, TransportError> {
///         let mut objects = Vec::new();
///         for q in plan.queues() {
///             let checked = match self.depth(&q.name).await? {
///                 Depth::Missing => Checked::Missing,
///                 _ => Checked::Ok(String::new()),
///             };
///             objects.push(ObjectCheck::new(format!("queue {}", q.name), checked).for_queue(&q.name));
///         }
///         Ok(CheckReport::new(objects))
///     }
/// }
///
/// let transport = DynTransport::with_admin(Broker);
/// # futures::executor::block_on(async {
/// assert_eq!(transport.depth("comments").await.unwrap(), Depth::Ready(0));
/// # });
/// ```
#[async_trait]
pub trait Admin: Transport {
    /// How many messages `queue` holds, without taking any.
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError>;

    /// Creates what `plan` needs and does not exist, and says object by object what it
    /// did. An object that exists with other settings is
    /// [`TransportError::TopologyConflict`]; a transport that cannot create its topology
    /// refuses with [`TransportError::Unsupported`], saying how to create it instead.
    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError>;

    /// Checks the broker against `plan` from outside, object by object, changing nothing
    /// the plan's consumers would see. A check that cannot be made for this plan or these
    /// `options` is [`TransportError::Unsupported`].
    async fn check(
        &self,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> Result<CheckReport, TransportError>;

    /// Whether messages read over this transport can lack headers they carry on the broker
    /// (see [`hidden_headers`](Self::hidden_headers)). The default: `false`.
    fn may_hide_headers(&self) -> bool {
        false
    }

    /// `Some(why)` when `message`, as this transport read it, may have headers on the broker
    /// that it does not show, so that a copy replayed over this transport would lose them:
    /// why, and what to do instead. The default: `None`.
    fn hidden_headers(&self, message: &Message) -> Option<String> {
        let _ = message;
        None
    }
}

/// A shared transport administers as the transport does.
#[async_trait]
impl<T: Admin> Admin for std::sync::Arc<T> {
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        (**self).depth(queue).await
    }

    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        (**self).apply(plan).await
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        (**self).check(plan, options).await
    }

    fn may_hide_headers(&self) -> bool {
        (**self).may_hide_headers()
    }

    fn hidden_headers(&self, message: &Message) -> Option<String> {
        (**self).hidden_headers(message)
    }
}
