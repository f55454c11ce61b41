//! `Consumer`: the async driver that runs a [`Handler`] on a [`Transport`] and carries out
//! the [`Engine`]'s decisions.
//!
//! Each turn of the loop feeds the engine what happened (a delivery, a handler's outcome, a
//! publish confirm, an in-process wait ending), starts the actions it asks for in the order
//! it emits them, and waits for the next event. At most `prefetch` deliveries are held at
//! once: the driver only asks the transport for another delivery while fewer are in flight.
//! Deliveries come from two intakes that take turns: the work queue's subscription, and
//! suspects fetched one at a time from the isolation queue while nothing else runs.

mod builder;
mod config_error;
mod error;
mod lanes;
mod metrics;
mod report;
mod run;
mod storm;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::Message;
use crate::RetryPolicy;
use crate::TopologyPlan;
use crate::gate::SoloGate;
use crate::handler::Handler;
use crate::transport::Transport;
use crate::{Engine, Terminal};

pub use builder::ConsumerBuilder;
pub use config_error::ConsumerConfigError;
pub use error::ConsumerError;
pub use report::RunReport;
pub use storm::{StormControl, StormEvent};

/// A callback told where each settled delivery ended.
type Observer = Box<dyn Fn(&Message, &Terminal) + Send + Sync>;
/// A callback told every change of storm control's state.
type StormObserver = Box<dyn Fn(&StormEvent) + Send + Sync>;

/// The validated settings of a consumer.
#[derive(Clone, Debug)]
struct Config {
    queue: String,
    prefetch: u16,
    handler_timeout: Duration,
    consumer_timeout: Duration,
    shutdown_grace: Duration,
    solo_runs: u32,
    solo_time: Duration,
    suspect_poll: Duration,
    provision: bool,
    storm: Option<StormControl>,
    gate: SoloGate,
}

/// Runs a [`Handler`] on the deliveries of one queue of a [`Transport`], retrying failures as
/// a [`RetryPolicy`] says. Made with [`Consumer::builder`], started with [`Consumer::run`].
///
/// The consumer is one future. It spawns nothing: handlers, publishes and settlements run
/// concurrently inside it, and it reads time only through [`Transport::now`] and
/// [`Transport::sleep`], so any executor can drive it, and a simulated transport on a virtual
/// clock drives it deterministically. At most [`prefetch`](ConsumerBuilder::with_prefetch)
/// deliveries are held, and so at most that many handlers run, at once.
///
/// ```
/// # use std::collections::VecDeque;
/// # use std::sync::Mutex;
/// # use async_trait::async_trait;
/// # use retry_core::*;
/// # // A queue in memory: every publish is confirmed, every call is recorded.
/// # #[derive(Default)]
/// # struct VecTransport {
/// #     inbox: Mutex<VecDeque<Delivery<u64>>>,
/// #     published: Mutex<Vec<String>>,
/// #     settled: Mutex<Vec<(u64, Settlement)>>,
/// # }
/// # #[async_trait]
/// # impl Transport for VecTransport {
/// #     type Tag = u64;
/// #     type Subscription = VecTransport;
/// #     fn capabilities(&self) -> Capabilities {
/// #         Capabilities { publisher_confirms: true, ..Capabilities::default() }
/// #     }
/// #     async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
/// #     async fn consume(&self, _: &str, _: u16) -> Result<Self, TransportError> {
/// #         Ok(VecTransport {
/// #             inbox: Mutex::new(std::mem::take(&mut *self.inbox.lock().unwrap())),
/// #             ..VecTransport::default()
/// #         })
/// #     }
/// #     async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn ready(&self, _: &str, _: std::time::Duration) -> Result<(), TransportError> {
/// #         std::future::pending().await
/// #     }
/// #     async fn publish(&self, _: &Message, p: &Publish) -> PublishResult {
/// #         self.published.lock().unwrap().push(p.route.routing_key.to_string());
/// #         PublishResult::Confirmed
/// #     }
/// #     async fn settle(&self, tag: &u64, s: Settlement) -> Result<(), TransportError> {
/// #         self.settled.lock().unwrap().push((*tag, s));
/// #         Ok(())
/// #     }
/// # }
/// # #[async_trait]
/// # impl Subscription for VecTransport {
/// #     type Tag = u64;
/// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> {
/// #         Ok(self.inbox.lock().unwrap().pop_front())
/// #     }
/// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
/// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # fn delivery(tag: u64, body: &[u8]) -> Delivery<u64> {
/// #     let message = Message::new(MessageParts {
/// #         queue: "comments".into(),
/// #         routing_key: "comments".into(),
/// #         body: body.to_vec(),
/// #         ..MessageParts::default()
/// #     });
/// #     let identity = message_identity(None, message.body());
/// #     let facts = DeliveryFacts::decode(message.headers(), BrokerSignals::default(), identity);
/// #     Delivery { tag, message, facts }
/// # }
/// use retry_core::{Consumer, HandlerError, Message, RetryPolicy, Settlement};
/// use std::time::Duration;
///
/// async fn handle(msg: Message) -> Result<(), HandlerError> {
///     match msg.body() {
///         b"ok" => Ok(()),
///         _ => Err(HandlerError::transient("downstream unavailable")),
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // A transport holding two deliveries; a real one talks to a broker.
/// let transport = VecTransport::default();
/// transport.inbox.lock().unwrap().extend([delivery(1, b"ok"), delivery(2, b"fails")]);
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
/// let consumer = Consumer::builder(transport, "comments", policy, handle)
///     .with_prefetch(50)
///     .build()?;
///
/// // Runs until the transport stops delivering or the shutdown future resolves.
/// let report = consumer.run(std::future::pending()).await?;
/// assert_eq!((report.received, report.handled, report.retried), (2, 1, 1));
/// # Ok(())
/// # }
/// ```
pub struct Consumer<T: Transport, H: Handler> {
    transport: T,
    handler: H,
    engine: Engine<run::Held<T::Tag>>,
    config: Config,
    observer: Option<Observer>,
    on_storm: Option<StormObserver>,
}

impl<T: Transport, H: Handler> Consumer<T, H> {
    /// A builder for a consumer of the work queue `queue` that runs `handler` on `transport`
    /// under `policy`; the other settings have defaults.
    pub fn builder(
        transport: T,
        queue: impl Into<String>,
        policy: RetryPolicy,
        handler: H,
    ) -> ConsumerBuilder<T, H> {
        ConsumerBuilder::new(transport, queue.into(), policy, handler)
    }

    /// The topology the consumer needs; with [`ConsumerBuilder::with_provision`] left on, `run`
    /// declares it before consuming, and with it off `run` verifies it
    /// ([`Transport::verify`]).
    pub fn plan(&self) -> &TopologyPlan {
        self.engine.plan()
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        self.engine.policy()
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.config.queue
    }

    /// The most deliveries held at once, and so the most handlers running at once.
    pub fn prefetch(&self) -> u16 {
        self.config.prefetch
    }

    /// How long one handler run may take before it is cancelled.
    pub fn handler_timeout(&self) -> Duration {
        self.config.handler_timeout
    }

    /// The broker's `consumer_timeout` the configuration was checked against.
    pub fn consumer_timeout(&self) -> Duration {
        self.config.consumer_timeout
    }

    /// How long in-flight work may continue after shutdown is requested.
    pub fn shutdown_grace(&self) -> Duration {
        self.config.shutdown_grace
    }

    /// The most suspects, and the longest time, one solo phase takes before the work lane
    /// gets a turn.
    pub fn solo_limit(&self) -> (u32, Duration) {
        (self.config.solo_runs, self.config.solo_time)
    }

    /// How often a transport that cannot watch the isolation queue looks at it.
    pub fn suspect_poll(&self) -> Duration {
        self.config.suspect_poll
    }

    /// The gate this consumer runs suspects alone through, shared with every consumer of
    /// the same failure domain.
    pub fn solo_gate(&self) -> &SoloGate {
        &self.config.gate
    }

    /// Storm control's settings, if it is on.
    pub fn storm_control(&self) -> Option<&StormControl> {
        self.config.storm.as_ref()
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Provisions the topology (or, with provisioning off, verifies it), runs the suspects
    /// waiting in the isolation queue, starts consuming the work queue, and runs until the
    /// transport has no more deliveries and every held one is settled, or until `shutdown`
    /// resolves.
    ///
    /// On shutdown the consumer stops receiving and lets in-flight handlers, publishes and
    /// settlements continue for the [shutdown grace](ConsumerBuilder::with_shutdown_grace).
    /// A suspect whose fetch answers after shutdown began is not run: a fresh copy of it goes
    /// back to the isolation queue ([`RunReport::declined`]). Suspects this process knows
    /// went back to the isolation queue through no crash (see [`Excuses`](crate::Excuses))
    /// are fetched and put back fresh too, so that the next process does not charge them.
    /// Deliveries still unfinished when the grace ends are left unsettled: the broker
    /// redelivers them. Nothing is acknowledged that was not handled. Before `run` returns,
    /// the subscription's batched acknowledgements are sent, so every delivery the report
    /// counts as settled is settled on the broker.
    ///
    /// If `shutdown` resolves before consuming has started, `run` returns an empty report.
    ///
    /// A lost connection while receiving, subscribing or fetching is retried after a short
    /// backoff; settlement failures are logged and counted in the report, since the broker
    /// redelivers what it did not see settled.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<RunReport, ConsumerError> {
        run::run(self, shutdown).await
    }
}

impl<T: Transport, H: Handler> fmt::Debug for Consumer<T, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("config", &self.config)
            .field("plan", self.engine.plan())
            .field("observer", &self.observer.is_some())
            .field("on_storm", &self.on_storm.is_some())
            .finish_non_exhaustive()
    }
}
