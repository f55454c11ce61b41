//! `ConsumerBuilder`: a consumer's settings, checked together before it runs.

use std::fmt;
use std::time::Duration;

use super::config_error::ConsumerConfigError;
use super::storm::StormControl;
use super::{Config, Consumer, Observer, StormObserver};
use crate::Message;
use crate::RetryPolicy;
use crate::gate::SoloGate;
use crate::handler::Handler;
use crate::transport::Transport;
use crate::{Engine, Terminal};
use crate::{TopologyBuilder, TopologyPlan};

const DEFAULT_PREFETCH: u16 = 10;
const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
const DEFAULT_SOLO_RUNS: u32 = 32;
const DEFAULT_SOLO_TIME: Duration = Duration::from_secs(5);
const DEFAULT_SUSPECT_POLL: Duration = Duration::from_secs(5);

type Customize = Box<dyn for<'a> FnOnce(TopologyBuilder<'a>) -> TopologyBuilder<'a> + Send>;

/// Builds a [`Consumer`] of the work queue given to [`Consumer::builder`]. Every setting is
/// checked in [`build`](Self::build).
///
/// | setting | default |
/// |---|---|
/// | [`with_prefetch`](Self::with_prefetch) | 10 |
/// | [`with_handler_timeout`](Self::with_handler_timeout) | 30 s |
/// | [`with_consumer_timeout`](Self::with_consumer_timeout) | 30 min, RabbitMQ's default |
/// | [`with_shutdown_grace`](Self::with_shutdown_grace) | 30 s |
/// | [`with_solo_limit`](Self::with_solo_limit) | 32 suspects or 5 s per solo phase |
/// | [`with_suspect_poll`](Self::with_suspect_poll) | 5 s |
/// | [`with_topology`](Self::with_topology) | classic queues, one TTL queue per delay |
/// | [`with_provision`](Self::with_provision) | on (off: the plan is only verified) |
/// | [`with_on_terminal`](Self::with_on_terminal) | none |
/// | [`with_storm_control`](Self::with_storm_control) | off |
/// | [`with_on_storm`](Self::with_on_storm) | none |
/// | [`with_solo_gate`](Self::with_solo_gate) | the transport's [`solo_gate`](Transport::solo_gate): for a broker client [`SoloGate::process`], every consumer of the process |
/// | [`with_token_seed`](Self::with_token_seed) | random |
///
/// ```
/// # use async_trait::async_trait;
/// # use retry_core::*;
/// # struct Broker;
/// # #[async_trait]
/// # impl Transport for Broker {
/// #     type Tag = u64;
/// #     type Subscription = Broker;
/// #     fn capabilities(&self) -> Capabilities { Capabilities::default() }
/// #     async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
/// #     async fn consume(&self, _: &str, _: u16) -> Result<Broker, TransportError> { Ok(Broker) }
/// #     async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn ready(&self, _: &str, _: std::time::Duration) -> Result<(), TransportError> { Ok(()) }
/// #     async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
/// #     async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # #[async_trait]
/// # impl Subscription for Broker {
/// #     type Tag = u64;
/// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
/// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
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
/// let consumer = Consumer::builder(Broker, "comments", policy.clone(), handle)
///     .with_prefetch(50)
///     .with_handler_timeout(Duration::from_secs(60))
///     .with_topology(|b: TopologyBuilder| b.with_queue_type(QueueType::Quorum))
///     .build()?;
/// assert_eq!(consumer.plan().parking_queue(), "comments.parking");
///
/// // Settings that cannot work are refused, naming the field.
/// let err = Consumer::builder(Broker, "comments", policy, handle)
///     .with_prefetch(0)
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
    queue: String,
    prefetch: u16,
    handler_timeout: Duration,
    consumer_timeout: Duration,
    shutdown_grace: Duration,
    solo_runs: u32,
    solo_time: Duration,
    suspect_poll: Duration,
    topology: Option<Customize>,
    provision: bool,
    observer: Option<Observer>,
    storm: Option<StormControl>,
    on_storm: Option<StormObserver>,
    gate: Option<SoloGate>,
    token_seed: Option<u64>,
}

impl<T: Transport, H: Handler> ConsumerBuilder<T, H> {
    pub(super) fn new(transport: T, queue: String, policy: RetryPolicy, handler: H) -> Self {
        ConsumerBuilder {
            transport,
            policy,
            handler,
            queue,
            prefetch: DEFAULT_PREFETCH,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            solo_runs: DEFAULT_SOLO_RUNS,
            solo_time: DEFAULT_SOLO_TIME,
            suspect_poll: DEFAULT_SUSPECT_POLL,
            topology: None,
            provision: true,
            observer: None,
            storm: None,
            on_storm: None,
            gate: None,
            token_seed: None,
        }
    }

    /// The most deliveries held at once: the broker's prefetch, and the most handlers running
    /// concurrently. At least 1; default 10.
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How long one handler run may take; a run past it is cancelled and counts as a
    /// transient failure. Above zero; default 30 s.
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }

    /// The broker's `consumer_timeout`: how long it lets a consumer hold a delivery before
    /// closing its channel (RabbitMQ's default is 30 min). The consumer refuses settings that
    /// could hold a delivery that long: the in-process time of one delivery (its handler
    /// runs, immediate-retry waits and publish-retry waits) three times over (the deliveries
    /// being drained, the last suspect of a solo phase, its own runs) plus the solo phase's
    /// time limit.
    pub fn with_consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// How long in-flight work may continue after shutdown is requested before it is left to
    /// the broker. Default 30 s.
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Bounds one solo phase: at most `runs` suspects (at least 1), or `time`, whichever
    /// comes first, before the work lane gets a turn as long as the solo phase took. Work
    /// deliveries prefetched meanwhile wait unstarted, so `time` counts towards the
    /// [`consumer_timeout`](Self::with_consumer_timeout) check. Default 32 suspects or 5 s.
    pub fn with_solo_limit(mut self, runs: u32, time: Duration) -> Self {
        self.solo_runs = runs;
        self.solo_time = time;
        self
    }

    /// How often a transport that cannot watch the isolation queue looks at it for suspects
    /// (AMQP 0-9-1 counts its ready messages; AMQP 1.0 on RabbitMQ 3.x cannot count, so the
    /// work lane pauses for a fetch at this interval). The in-memory broker watches exactly.
    /// Above zero; default 5 s.
    pub fn with_suspect_poll(mut self, every: Duration) -> Self {
        self.suspect_poll = every;
        self
    }

    /// Customises the topology plan, for instance for quorum queues.
    pub fn with_topology<F>(mut self, customize: F) -> Self
    where
        F: for<'a> FnOnce(TopologyBuilder<'a>) -> TopologyBuilder<'a> + Send + 'static,
    {
        self.topology = Some(Box::new(customize));
        self
    }

    /// Whether `run` declares the topology plan before consuming
    /// ([`Transport::provision`]). Default on; turn it off when the topology is managed
    /// elsewhere. Off, `run` still checks the plan with [`Transport::verify`] and stops with
    /// [`ConsumerError::Verify`](crate::ConsumerError::Verify) if something the engine sends
    /// to is missing (a no-op on transports whose broker reports an unroutable publish).
    pub fn with_provision(mut self, provision: bool) -> Self {
        self.provision = provision;
        self
    }

    /// Calls `observer` once for every delivery settled on the broker, with how it ended.
    /// Deliveries left unsettled at shutdown, or whose settlement failed, are not reported:
    /// the broker still has them. The observer runs inside the consumer's loop, so it should
    /// be quick.
    pub fn with_on_terminal<F>(mut self, observer: F) -> Self
    where
        F: Fn(&Message, &Terminal) + Send + Sync + 'static,
    {
        self.observer = Some(Box::new(observer));
        self
    }

    /// Turns storm control on: after the failures `storm` describes, the work lane stops
    /// taking deliveries, and probes one at a time after a cool-down (see
    /// [`StormControl`]). Off by default.
    ///
    /// While paused, the deliveries the broker already pushed wait unstarted, each for up
    /// to `prefetch` probe cycles; `build` refuses settings where that can reach the
    /// [`consumer_timeout`](Self::with_consumer_timeout).
    ///
    /// ```
    /// # use async_trait::async_trait;
    /// # use retry_core::*;
    /// # struct Broker;
    /// # #[async_trait]
    /// # impl Transport for Broker {
    /// #     type Tag = u64;
    /// #     type Subscription = Broker;
    /// #     fn capabilities(&self) -> Capabilities { Capabilities::default() }
    /// #     async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn consume(&self, _: &str, _: u16) -> Result<Broker, TransportError> { Ok(Broker) }
    /// #     async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn ready(&self, _: &str, _: std::time::Duration) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
    /// #     async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
    /// # }
    /// # #[async_trait]
    /// # impl Subscription for Broker {
    /// #     type Tag = u64;
    /// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
    /// # }
    /// use retry_core::{Consumer, HandlerError, Message, RetryPolicy, StormControl, StormEvent};
    /// use std::time::Duration;
    ///
    /// async fn handle(_msg: Message) -> Result<(), HandlerError> {
    ///     Err(HandlerError::transient("payments API unavailable"))
    /// }
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let consumer = Consumer::builder(Broker, "orders", policy, handle)
    ///     .with_storm_control(StormControl::consecutive_failures(20))
    ///     .with_on_storm(|event: &StormEvent| eprintln!("storm control: {event:?}"))
    ///     .build()?;
    /// # drop(consumer);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_storm_control(mut self, storm: StormControl) -> Self {
        self.storm = Some(storm);
        self
    }

    /// Calls `observer` on every change of storm control's state: paused, probing,
    /// resumed. It runs inside the consumer's loop, so it should be quick.
    pub fn with_on_storm<F>(mut self, observer: F) -> Self
    where
        F: Fn(&super::StormEvent) + Send + Sync + 'static,
    {
        self.on_storm = Some(Box::new(observer));
        self
    }

    /// The gate this consumer runs suspects alone through (default: the transport's
    /// [`solo_gate`](Transport::solo_gate), which for a broker client is
    /// [`SoloGate::process`]).
    ///
    /// A crash takes down the whole process, so "alone" must hold for the process: while
    /// one consumer runs a suspect, every other consumer sharing its gate starts no work
    /// and holds nothing, and a suspect that then comes back redelivered can only have been
    /// killed by itself. Give a consumer a gate of its own only when nothing else shares its
    /// fate: a simulated process in a test, or consumers that stand for separate processes.
    ///
    /// ```
    /// # use async_trait::async_trait;
    /// # use retry_core::*;
    /// # struct Broker;
    /// # #[async_trait]
    /// # impl Transport for Broker {
    /// #     type Tag = u64;
    /// #     type Subscription = Broker;
    /// #     fn capabilities(&self) -> Capabilities { Capabilities::default() }
    /// #     async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn consume(&self, _: &str, _: u16) -> Result<Broker, TransportError> { Ok(Broker) }
    /// #     async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn ready(&self, _: &str, _: std::time::Duration) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
    /// #     async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
    /// # }
    /// # #[async_trait]
    /// # impl Subscription for Broker {
    /// #     type Tag = u64;
    /// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
    /// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
    /// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
    /// # }
    /// use retry_core::{Consumer, HandlerError, Message, RetryPolicy, SoloGate};
    /// use std::time::Duration;
    ///
    /// async fn handle(_msg: Message) -> Result<(), HandlerError> { Ok(()) }
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    ///
    /// // Two consumers of one process share its gate, as they do by default.
    /// let orders = Consumer::builder(Broker, "orders", policy.clone(), handle).build()?;
    /// let invoices = Consumer::builder(Broker, "invoices", policy.clone(), handle).build()?;
    /// assert!(orders.solo_gate().same_as(invoices.solo_gate()));
    ///
    /// // A test that stands for another process gives it a gate of its own.
    /// let elsewhere = Consumer::builder(Broker, "orders", policy, handle)
    ///     .with_solo_gate(SoloGate::new())
    ///     .build()?;
    /// assert!(!elsewhere.solo_gate().same_as(orders.solo_gate()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_solo_gate(mut self, gate: SoloGate) -> Self {
        self.gate = Some(gate);
        self
    }

    /// Seeds the tokens the consumer writes on the suspects it puts in the isolation queue
    /// (see [`Engine::with_token_seed`]), for runs that must replay exactly, such as a
    /// simulation. By default the seed is drawn at random.
    pub fn with_token_seed(mut self, seed: u64) -> Self {
        self.token_seed = Some(seed);
        self
    }

    /// Checks the settings together and computes the topology plan.
    pub fn build(self) -> Result<Consumer<T, H>, ConsumerConfigError> {
        let queue = self.queue;
        if self.prefetch == 0 {
            return Err(ConsumerConfigError::ZeroPrefetch);
        }
        if self.handler_timeout.is_zero() {
            return Err(ConsumerConfigError::ZeroHandlerTimeout);
        }
        if self.solo_runs == 0 {
            return Err(ConsumerConfigError::ZeroSoloRuns);
        }
        if self.suspect_poll.is_zero() {
            return Err(ConsumerConfigError::ZeroSuspectPoll);
        }
        let in_process = in_process(&self.policy, self.handler_timeout);
        check_consumer_timeout(
            &self.policy,
            self.handler_timeout,
            in_process,
            self.solo_time,
            self.consumer_timeout,
        )?;
        if let Some(storm) = &self.storm {
            storm.check()?;
            check_storm_hold(storm, self.prefetch, in_process, self.consumer_timeout)?;
        }

        let mut topology = TopologyPlan::builder(&queue, &self.policy);
        if let Some(customize) = self.topology {
            topology = customize(topology);
        }
        let plan = topology.build()?;
        let gate = self
            .gate
            .or_else(|| self.transport.solo_gate())
            .unwrap_or_else(SoloGate::process);
        let mut engine = Engine::new(self.policy, &plan)?.with_excuses(gate.excuses().clone());
        if let Some(seed) = self.token_seed {
            engine = engine.with_token_seed(seed);
        }
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
                solo_runs: self.solo_runs,
                solo_time: self.solo_time,
                suspect_poll: self.suspect_poll,
                provision: self.provision,
                storm: self.storm,
                gate,
            },
            observer: self.observer,
            on_storm: self.on_storm,
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
            .field("solo_runs", &self.solo_runs)
            .field("solo_time", &self.solo_time)
            .field("suspect_poll", &self.suspect_poll)
            .field("provision", &self.provision)
            .field("storm", &self.storm)
            .finish_non_exhaustive()
    }
}

/// A delivery stays with the consumer through all its in-process runs, the waits between
/// them and its clone's publish retries: at most `in_process`. A work delivery prefetched
/// just as the work lane starts draining waits for the drain (the deliveries running then,
/// each at most `in_process`), a solo phase (`solo_time`, overrun by at most one suspect's
/// `in_process`) and then its own runs: three times `in_process`, plus `solo_time`. If
/// that can reach the broker's `consumer_timeout`, the broker closes the channel and every
/// delivery on it comes back redelivered.
fn check_consumer_timeout(
    policy: &RetryPolicy,
    handler_timeout: Duration,
    in_process: Duration,
    solo_time: Duration,
    consumer_timeout: Duration,
) -> Result<(), ConsumerConfigError> {
    let worst_case = in_process
        .checked_mul(3)
        .and_then(|t| t.checked_add(solo_time))
        .unwrap_or(Duration::MAX);
    if worst_case >= consumer_timeout {
        let immediate_retries = policy.immediate_retries();
        return Err(ConsumerConfigError::ExceedsConsumerTimeout {
            handler_timeout,
            runs: immediate_retries.saturating_add(1),
            immediate_retries,
            immediate_wait: policy.immediate_wait(),
            publish_retry_waits: policy.publish_retry_budget(),
            in_process,
            solo_time,
            worst_case,
            consumer_timeout,
        });
    }
    Ok(())
}

/// The longest one delivery is worked on in-process: its handler runs, the immediate-retry
/// waits between them and its clone's publish-retry waits.
fn in_process(policy: &RetryPolicy, handler_timeout: Duration) -> Duration {
    let immediate_retries = policy.immediate_retries();
    handler_timeout
        .checked_mul(immediate_retries.saturating_add(1))
        .and_then(|t| t.checked_add(policy.immediate_wait().checked_mul(immediate_retries)?))
        .and_then(|t| t.checked_add(policy.publish_retry_budget()))
        .unwrap_or(Duration::MAX)
}

/// While storm control holds the work lane back, the deliveries already pushed by the
/// broker (at most `prefetch`) wait, oldest first, for one probe each: the last waits for
/// the runs under way when the pause began, then `prefetch` probe cycles of at most the
/// longest cool-down plus one delivery's in-process time.
fn check_storm_hold(
    storm: &StormControl,
    prefetch: u16,
    in_process: Duration,
    consumer_timeout: Duration,
) -> Result<(), ConsumerConfigError> {
    let max_cool_down = storm.max_cool_down();
    let worst_case = max_cool_down
        .checked_add(in_process)
        .and_then(|cycle| cycle.checked_mul(u32::from(prefetch)))
        .and_then(|t| t.checked_add(in_process))
        .unwrap_or(Duration::MAX);
    if worst_case >= consumer_timeout {
        return Err(ConsumerConfigError::StormExceedsConsumerTimeout {
            prefetch,
            max_cool_down,
            in_process,
            worst_case,
            consumer_timeout,
        });
    }
    Ok(())
}
