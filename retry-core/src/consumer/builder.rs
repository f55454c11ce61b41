//! `ConsumerBuilder`: a consumer's settings, checked together before it runs.

use std::fmt;
use std::time::Duration;

use super::{Config, Consumer, Observer};
use crate::engine::{Engine, EngineError, Terminal};
use crate::handler::Handler;
use crate::message::Message;
use crate::policy::{CrashAction, RetryPolicy};
use crate::time::format_delay;
use crate::topology::{TopologyBuilder, TopologyError, TopologyPlan};
use crate::transport::Transport;

const DEFAULT_PREFETCH: u16 = 10;
const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
const DEFAULT_REQUEUE_DELAY: Duration = Duration::from_secs(1);

type Customize = Box<dyn for<'a> FnOnce(TopologyBuilder<'a>) -> TopologyBuilder<'a> + Send>;

/// Builds a [`Consumer`]. Every setting is checked in [`build`](Self::build).
///
/// | setting | default |
/// |---|---|
/// | [`queue`](Self::queue) | none: required |
/// | [`prefetch`](Self::prefetch) | 10 |
/// | [`handler_timeout`](Self::handler_timeout) | 30 s |
/// | [`consumer_timeout`](Self::consumer_timeout) | 30 min, RabbitMQ's default |
/// | [`shutdown_grace`](Self::shutdown_grace) | 30 s |
/// | [`requeue_delay`](Self::requeue_delay) | 1 s |
/// | [`topology`](Self::topology) | classic queues, one TTL queue per delay |
/// | [`provision`](Self::provision) | on |
/// | [`on_terminal`](Self::on_terminal) | none |
///
/// ```
/// # use async_trait::async_trait;
/// # use retry_core::*;
/// # struct Broker;
/// # #[async_trait]
/// # impl Transport for Broker {
/// #     type Tag = u64;
/// #     fn capabilities(&self) -> Capabilities { Capabilities::default() }
/// #     async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
/// #     async fn consume(&self, _: &str, _: u16) -> Result<(), TransportError> { Ok(()) }
/// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
/// #     async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
/// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
/// # }
/// use retry_core::{
///     Consumer, ConsumerConfigError, HandlerError, Message, QueueType, RetryPolicy, TopologyBuilder,
/// };
/// use std::time::Duration;
///
/// async fn handle(_msg: Message) -> Result<(), HandlerError> {
///     Ok(())
/// }
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let consumer = Consumer::builder(Broker, policy.clone(), handle)
///     .queue("comments")
///     .prefetch(50)
///     .handler_timeout(Duration::from_secs(60))
///     .topology(|b: TopologyBuilder| b.with_queue_type(QueueType::Quorum))
///     .build()?;
/// assert_eq!(consumer.plan().parking_queue(), "comments.parking");
///
/// // Settings that cannot work are refused, naming the field.
/// let err = Consumer::builder(Broker, policy, handle)
///     .queue("comments")
///     .prefetch(0)
///     .build()
///     .unwrap_err();
/// assert!(matches!(err, ConsumerConfigError::ZeroPrefetch));
/// assert_eq!(err.to_string(), "prefetch must be at least 1, got 0");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct ConsumerBuilder<T: Transport, H: Handler> {
    transport: T,
    policy: RetryPolicy,
    handler: H,
    queue: Option<String>,
    prefetch: u16,
    handler_timeout: Duration,
    consumer_timeout: Duration,
    shutdown_grace: Duration,
    requeue_delay: Duration,
    topology: Option<Customize>,
    provision: bool,
    observer: Option<Observer>,
}

impl<T: Transport, H: Handler> ConsumerBuilder<T, H> {
    pub(super) fn new(transport: T, policy: RetryPolicy, handler: H) -> Self {
        ConsumerBuilder {
            transport,
            policy,
            handler,
            queue: None,
            prefetch: DEFAULT_PREFETCH,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            requeue_delay: DEFAULT_REQUEUE_DELAY,
            topology: None,
            provision: true,
            observer: None,
        }
    }

    /// The work queue to consume. Required.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The most deliveries held at once: the broker's prefetch, and the most handlers running
    /// concurrently. At least 1; default 10.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How long one handler run may take; a run past it is cancelled and counts as a
    /// transient failure. Above zero; default 30 s.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// The broker's `consumer_timeout`: how long it lets a consumer hold a delivery before
    /// closing its channel (RabbitMQ's default is 30 min). The consumer refuses settings that
    /// could hold a delivery that long in-process.
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// How long in-flight work may continue after shutdown is requested before it is left to
    /// the broker. Default 30 s.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// How long a delivery is held before it is requeued because its clone's publish failed.
    /// A requeued delivery comes straight back; without a pause, a broker that keeps refusing
    /// the clone (a full delay queue) would spin it in a hot loop.
    pub fn requeue_delay(mut self, delay: Duration) -> Self {
        self.requeue_delay = delay;
        self
    }

    /// Customises the topology plan, for instance for quorum queues.
    pub fn topology<F>(mut self, customize: F) -> Self
    where
        F: for<'a> FnOnce(TopologyBuilder<'a>) -> TopologyBuilder<'a> + Send + 'static,
    {
        self.topology = Some(Box::new(customize));
        self
    }

    /// Whether `run` declares the topology plan before consuming. Default on; turn it off
    /// when the topology is managed elsewhere.
    pub fn provision(mut self, provision: bool) -> Self {
        self.provision = provision;
        self
    }

    /// Calls `observer` once for every delivery settled on the broker, with how it ended.
    /// Deliveries left unsettled at shutdown, or whose settlement failed, are not reported:
    /// the broker still has them. The observer runs inside the consumer's loop, so it should
    /// be quick.
    pub fn on_terminal<F>(mut self, observer: F) -> Self
    where
        F: Fn(&Message, &Terminal) + Send + Sync + 'static,
    {
        self.observer = Some(Box::new(observer));
        self
    }

    /// Checks the settings together and computes the topology plan.
    pub fn build(self) -> Result<Consumer<T, H>, ConsumerConfigError> {
        let queue = self.queue.ok_or(ConsumerConfigError::MissingQueue)?;
        if self.prefetch == 0 {
            return Err(ConsumerConfigError::ZeroPrefetch);
        }
        if self.handler_timeout.is_zero() {
            return Err(ConsumerConfigError::ZeroHandlerTimeout);
        }
        check_consumer_timeout(&self.policy, self.handler_timeout, self.consumer_timeout)?;

        let mut topology = TopologyPlan::builder(&queue, &self.policy);
        if let Some(customize) = self.topology {
            topology = customize(topology);
        }
        let plan = topology.build()?;
        if self.policy.on_crash() == CrashAction::RunHandler
            && !self.transport.capabilities().delivery_count
        {
            return Err(ConsumerConfigError::NoDeliveryCount);
        }
        let engine = Engine::new(self.policy, &plan)?;
        Ok(Consumer {
            transport: self.transport,
            handler: self.handler,
            engine,
            config: Config {
                queue,
                prefetch: self.prefetch,
                handler_timeout: self.handler_timeout,
                consumer_timeout: self.consumer_timeout,
                shutdown_grace: self.shutdown_grace,
                requeue_delay: self.requeue_delay,
                provision: self.provision,
            },
            observer: self.observer,
        })
    }
}

impl<T: Transport, H: Handler> fmt::Debug for ConsumerBuilder<T, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("handler_timeout", &self.handler_timeout)
            .field("consumer_timeout", &self.consumer_timeout)
            .field("shutdown_grace", &self.shutdown_grace)
            .field("requeue_delay", &self.requeue_delay)
            .field("provision", &self.provision)
            .finish_non_exhaustive()
    }
}

/// A delivery stays with the consumer through all its in-process runs and the waits between
/// them; if that can reach the broker's `consumer_timeout`, the broker closes the channel and
/// every delivery on it comes back redelivered, counted as a crash.
fn check_consumer_timeout(
    policy: &RetryPolicy,
    handler_timeout: Duration,
    consumer_timeout: Duration,
) -> Result<(), ConsumerConfigError> {
    let immediate_retries = policy.immediate_retries();
    let immediate_wait = policy.immediate_wait();
    let runs = immediate_retries.saturating_add(1);
    let worst_case = handler_timeout
        .checked_mul(runs)
        .and_then(|t| t.checked_add(immediate_wait.checked_mul(immediate_retries)?))
        .unwrap_or(Duration::MAX);
    if worst_case >= consumer_timeout {
        return Err(ConsumerConfigError::ExceedsConsumerTimeout {
            handler_timeout,
            runs,
            immediate_retries,
            immediate_wait,
            worst_case,
            consumer_timeout,
        });
    }
    Ok(())
}

fn human(d: &Duration) -> String {
    if *d == Duration::MAX {
        return "forever".to_owned();
    }
    format_delay(*d)
}

/// Why a consumer could not be built. Each variant names the setting at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerConfigError {
    /// No queue was given.
    #[error("queue is not set: call .queue(name) with the work queue to consume")]
    MissingQueue,
    /// `prefetch` was 0, which would never receive anything.
    #[error("prefetch must be at least 1, got 0")]
    ZeroPrefetch,
    /// `handler_timeout` was zero, which would cancel every handler run.
    #[error("handler_timeout must be above zero")]
    ZeroHandlerTimeout,
    /// The longest a delivery can be held in-process reaches the broker's `consumer_timeout`.
    #[error(
        "worst-case in-process time reaches consumer_timeout ({}): handler_timeout ({}) × {runs} runs (immediate_retries {immediate_retries} + 1) + immediate_wait ({}) × {immediate_retries} = {}; lower handler_timeout, immediate_retries or immediate_wait, or raise consumer_timeout",
        human(.consumer_timeout),
        human(.handler_timeout),
        human(.immediate_wait),
        human(.worst_case)
    )]
    ExceedsConsumerTimeout {
        /// The handler timeout.
        handler_timeout: Duration,
        /// Handler runs a delivery can get in-process: the immediate retries plus one.
        runs: u32,
        /// The policy's immediate retries.
        immediate_retries: u32,
        /// The policy's wait before each immediate retry.
        immediate_wait: Duration,
        /// `handler_timeout × runs + immediate_wait × immediate_retries`.
        worst_case: Duration,
        /// The broker's consumer timeout.
        consumer_timeout: Duration,
    },
    /// The policy runs the handler on redelivered deliveries, which needs the broker's
    /// delivery count to enforce the crash limit, and this transport has none.
    #[error(
        "on_crash = run-handler needs a broker delivery count to enforce the crash limit, and this transport reports none: use CrashAction::Divert"
    )]
    NoDeliveryCount,
    /// The topology plan could not be made for the queue.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The engine refused the plan (a topology customisation dropped a delay level).
    #[error(transparent)]
    Engine(#[from] EngineError),
}
