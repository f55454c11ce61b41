//! `AmqpTransport`: retry-core's `Transport` over one lapin connection.

use std::collections::HashSet;
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use retry_core::{
    Capabilities, CascadePlan, Delivery, Message, Publish, PublishResult, QueueWalk, Settlement,
    TopologyPlan, Transport, TransportError,
};
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::acks::Acks;
use crate::config::AmqpConfig;
use crate::convert::received;
use crate::error::{closes_only_a_channel, connection_error, queue_error, short};
use crate::link::Link;
use crate::provision::{self, ProvisionReport};
use crate::publisher::{Publisher, PublisherSlot};
use crate::subscription::{self, AmqpSubscription};
use crate::tag::AmqpTag;
use crate::undecodable;
use crate::walk::ChannelWalk;
use crate::{RAW_PROPERTIES_HEADER, UNDECODABLE_HEADER};

/// A RabbitMQ (AMQP 0-9-1) transport: one connection, a publishing channel in confirm mode,
/// a channel per subscription, one for fetching and one for looking at queues.
///
/// * Each [`consume`](Transport::consume) opens a channel of its own with its prefetch and
///   acknowledgement batching: an [`AmqpSubscription`]. Two subscriptions never share a
///   channel, so a `multiple` ack of one can never cover the other's deliveries.
/// * [`fetch`](Transport::fetch) is `basic.get` on a channel used only for it, and its
///   deliveries are settled at once, never batched. A get with no answer in time closes
///   that channel, so a message on its way goes back to the queue redelivered, and fails
///   with [`TransportError::FetchLost`]. [`ready`](Transport::ready) counts a
///   queue's ready messages with a passive declare, on a channel used only for that (a
///   missing queue closes the channel it is asked on).
/// * Clones are published `mandatory`, and only a plain positive confirm counts: a returned
///   (unroutable) or nacked publish, a channel error or a confirm timeout is a failure.
/// * Acknowledgements are batched with `multiple` where that is safe (see the `acks`
///   module); requeues and rejects are sent at once. [`close`](Self::close) sends every
///   batched ack first.
/// * With automatic recovery on, a dropped connection is re-established; deliveries held
///   across the drop come back redelivered, and settling one of their old tags fails with
///   [`TransportError::Connection`] instead of reaching the new channel.
///
/// ```no_run
/// use retry_core::{RetryPolicy, TopologyPlan, Transport};
/// use transport_amqp091::{AmqpConfig, AmqpTransport};
/// use std::time::Duration;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// transport.provision(&plan).await?;
/// # Ok(()) }
/// ```
pub struct AmqpTransport {
    config: AmqpConfig,
    link: Arc<Link>,
    /// The publishing channel and the matcher of its returns (see the `publisher` module).
    publisher: PublisherSlot,
    get_channel: Mutex<Option<Arc<Channel>>>,
    inspect_channel: Mutex<Option<Arc<Channel>>>,
    /// The batchers of the subscriptions still alive, for `close` and `flush_acks`.
    subscriptions: StdMutex<Vec<Weak<Acks>>>,
    last_report: StdMutex<Option<ProvisionReport>>,
    /// The work and isolation queues of the plans provisioned or verified: they dead-letter
    /// into their parking queue, so a delivery the tap kept from lapin is rejected there.
    dead_lettering: StdMutex<HashSet<String>>,
}

impl std::fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpTransport")
            .field("config", &self.config)
            .field("recoveries", &self.recoveries())
            .field("node", &self.node())
            .finish_non_exhaustive()
    }
}

impl AmqpTransport {
    /// Connects to the first node that answers and opens the publishing channel in confirm
    /// mode.
    ///
    /// Every node of a list of several is asked for its cluster name first: a list whose
    /// nodes answer with different names is refused
    /// ([`NodeListError::DifferentClusters`](crate::NodeListError::DifferentClusters), inside
    /// [`TransportError::Other`]), as is a list that cannot be used at all. When no node
    /// answers, it fails at once with an error naming every node, with why each did not
    /// answer as its source; when one refuses the login, the error names that node.
    /// Passwords are never shown.
    pub async fn connect(config: AmqpConfig) -> Result<Self, TransportError> {
        let link = Link::open(config.clone()).await?;
        let publisher = Publisher::open(&link.get(), link.recoveries()).await?;
        info!(
            node = link
                .nodes()
                .current()
                .map_or("", |i| link.nodes().address(i)),
            nodes = link.nodes().len(),
            "connected"
        );
        Ok(AmqpTransport {
            config,
            link,
            publisher: PublisherSlot::with(publisher),
            get_channel: Mutex::new(None),
            inspect_channel: Mutex::new(None),
            subscriptions: StdMutex::new(Vec::new()),
            last_report: StdMutex::new(None),
            dead_lettering: StdMutex::new(HashSet::new()),
        })
    }

    /// The node the connection is on (or is being recovered to), password redacted.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use transport_amqp091::{AmqpConfig, AmqpTransport};
    ///
    /// let config = AmqpConfig::new("amqp://guest:guest@127.0.0.1:5681/%2f,amqp://guest:guest@127.0.0.1:5682/%2f");
    /// let transport = AmqpTransport::connect(config).await?;
    /// println!("on {}", transport.node().unwrap_or_default());
    /// # Ok(()) }
    /// ```
    pub fn node(&self) -> Option<String> {
        let nodes = self.link.nodes();
        nodes.current().map(|i| nodes.address(i).to_owned())
    }

    /// The settings.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// The underlying lapin connection, for whatever this transport does not cover. After a
    /// stalled recovery was rebuilt (see [`recoveries`](Self::recoveries)) this is a new
    /// connection: take it again rather than keeping it.
    pub fn connection(&self) -> Arc<Connection> {
        self.link.get()
    }

    /// Declares `plan` as [`provision`](Transport::provision) does, but asks the broker
    /// first which objects exist, to report them as created or verified. On RabbitMQ each
    /// missing object is a channel the broker closes with `NOT_FOUND`, which lapin logs at
    /// ERROR (target `lapin::channel`): for tools, not for a consumer's start.
    ///
    /// With a delay cascade ([`TopologyPlan::cascade`]) the report lists the cascade's
    /// exchanges and queues first: created by the first work queue that uses it, verified
    /// for the others (except levels a plan with longer delays adds on top).
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use retry_core::{RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    /// use transport_amqp091::{AmqpConfig, AmqpTransport};
    ///
    /// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://127.0.0.1:5672/%2f")).await?;
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let report = transport.provision_inspected(&TopologyPlan::new("comments", &policy)?).await?;
    /// println!("created {:?}, verified {:?}", report.created, report.verified);
    /// # Ok(()) }
    /// ```
    pub async fn provision_inspected(
        &self,
        plan: &TopologyPlan,
    ) -> Result<ProvisionReport, TransportError> {
        self.provision_reported(plan, true).await
    }

    /// Provisions `plan` (asking first which objects exist, with `inspect`) and keeps the
    /// report for [`last_provision_report`](Self::last_provision_report).
    async fn provision_reported(
        &self,
        plan: &TopologyPlan,
        inspect: bool,
    ) -> Result<ProvisionReport, TransportError> {
        let report = provision::provision(&self.link.get(), plan, inspect).await?;
        *self.last_report.lock().unwrap_or_else(|e| e.into_inner()) = Some(report.clone());
        self.learn(plan);
        Ok(report)
    }

    /// Remembers which of `plan`'s queues dead-letter into its parking queue.
    fn learn(&self, plan: &TopologyPlan) {
        let mut known = self
            .dead_lettering
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for queue in [plan.work_queue(), plan.isolation_queue()] {
            let spec = plan.queues().iter().find(|q| q.name == queue);
            if spec.is_some_and(|q| q.arguments.dead_letter_exchange.is_some()) {
                known.insert(queue.to_owned());
            }
        }
    }

    /// Whether `queue` dead-letters into a parking queue, as far as this transport knows.
    fn dead_letters(&self, queue: &str) -> bool {
        self.dead_lettering
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue)
    }

    /// What the latest [`provision`](Transport::provision) or
    /// [`provision_inspected`](Self::provision_inspected) did.
    pub fn last_provision_report(&self) -> Option<ProvisionReport> {
        self.last_report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Deletes every queue and exchange of `plan`, with their messages. For tests and
    /// decommissioning.
    ///
    /// A plan's delay cascade ([`TopologyPlan::cascade`]) is left alone: every work queue
    /// of the same cascade shares it. Only the plan's bindings to the cascade's delivery
    /// exchange go, with the plan's queues. Delete the cascade itself with
    /// [`teardown_cascade`](Self::teardown_cascade).
    pub async fn teardown(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        provision::teardown(&self.link.get(), plan).await
    }

    /// Deletes every queue and exchange of a delay cascade: its level queues with the clones
    /// waiting in them, its level exchanges, its delivery exchange, and so every binding into
    /// and out of them.
    ///
    /// **Every work queue that uses this cascade (same prefix, unit and queue type) shares
    /// these objects**, whichever plan `cascade` came from: afterwards their delayed retries
    /// are lost until one of them provisions again, and clones already waiting are gone. For
    /// tests with a cascade of their own ([`Cascade::with_prefix`](retry_core::Cascade::with_prefix))
    /// and for decommissioning the last work queue of a cascade.
    ///
    /// Only the levels `cascade` has are deleted: levels that a plan with longer delays
    /// added on top stay. Pass the cascade of the plan with the most levels.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use retry_core::{Cascade, DelayStrategy, RetryPolicy, TopologyPlan};
    /// use std::time::Duration;
    /// use transport_amqp091::{AmqpConfig, AmqpTransport};
    ///
    /// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://127.0.0.1:5672/%2f")).await?;
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::builder("comments", &policy)
    ///     .with_strategy(DelayStrategy::Cascade(Cascade::new().with_prefix("test.cascade")))
    ///     .build()?;
    /// // The work queue's own objects, then the cascade no other work queue uses.
    /// transport.teardown(&plan).await?;
    /// transport.teardown_cascade(plan.cascade().unwrap()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn teardown_cascade(&self, cascade: &CascadePlan) -> Result<(), TransportError> {
        provision::teardown_cascade(&self.link.get(), cascade).await
    }

    /// Sends every subscription's batched acknowledgements, then closes the connection.
    /// Deliveries left unsettled (a consumer stopped past its shutdown grace, or prefetched
    /// and never received) go back to their queue now; while the connection stays open the
    /// broker keeps them as unacknowledged.
    pub async fn close(&self) -> Result<(), TransportError> {
        let flushed = self.flush_acks().await;
        self.link.close().await?;
        flushed
    }

    /// How many times the connection has been recovered, by lapin or, when lapin's recovery
    /// stalled, by opening a new one.
    pub fn recoveries(&self) -> u64 {
        self.link.recoveries()
    }

    /// For tests: the next `n` `basic.get-ok`s from the broker never reach lapin, as if each
    /// came after its fetch gave up; the broker holds each one's message unacknowledged on
    /// its get channel until that channel closes. Not an API.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn lose_get_oks(&self, n: u32) {
        self.link.refusals().lose_get_oks(n);
    }

    /// Sends every subscription's batched acknowledgements now.
    pub async fn flush_acks(&self) -> Result<(), TransportError> {
        let live: Vec<Arc<Acks>> = {
            let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
            subscriptions.retain(|w| w.strong_count() > 0);
            subscriptions.iter().filter_map(Weak::upgrade).collect()
        };
        let mut result = Ok(());
        for acks in live {
            if let Err(e) = acks.flush().await {
                result = Err(e);
            }
        }
        result
    }

    /// Gives up on the get channel `channel`, whose `basic.get` from `queue` has no answer:
    /// it leaves the slot (the next fetch opens another) and is closed, waiting at most
    /// `timeout` for the broker to confirm, so that a message it was handed is back in the
    /// queue, redelivered, before the next fetch asks. Returns the fetch's error.
    async fn lose_get_channel(
        &self,
        channel: &Arc<Channel>,
        queue: &str,
        why: String,
        timeout: Duration,
    ) -> TransportError {
        {
            let mut slot = self.get_channel.lock().await;
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, channel)) {
                *slot = None;
            }
        }
        let closing = channel.close(200, "basic.get abandoned".into());
        let closed = matches!(tokio::time::timeout(timeout, closing).await, Ok(Ok(())));
        warn!(
            queue,
            channel = channel.id(),
            closed,
            "a fetch was lost in flight ({why}); its channel was closed, so the message it may have carried is back in the queue, redelivered"
        );
        TransportError::FetchLost {
            queue: queue.to_owned(),
            context: format!("{why}; the get channel was closed"),
        }
    }

    /// The channel in `slot`, opened when there is none yet or a channel error closed it (a
    /// missing queue) while the connection is fine; a lost connection is left to automatic
    /// recovery.
    async fn channel_in(
        &self,
        slot: &Mutex<Option<Arc<Channel>>>,
    ) -> Result<Arc<Channel>, TransportError> {
        let mut slot = slot.lock().await;
        let connection = self.link.get();
        if let Some(channel) = slot.as_ref()
            && (channel.status().connected() || !connection.status().connected())
        {
            return Ok(Arc::clone(channel));
        }
        let channel = connection
            .create_channel()
            .await
            .map_err(connection_error)?;
        debug!(channel = channel.id(), "channel opened");
        let channel = Arc::new(channel);
        *slot = Some(Arc::clone(&channel));
        Ok(channel)
    }
}

/// Flushes batched acks on a timer, so a quiet consumer never sits on finished deliveries.
/// Stops when the batcher is dropped.
pub(crate) fn spawn_flusher(acks: Weak<Acks>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(acks) = acks.upgrade() else { break };
            if acks.has_done() {
                // A failure is logged by the batcher; the broker redelivers those.
                let _ = acks.flush().await;
            }
        }
    });
}

#[async_trait]
impl Transport for AmqpTransport {
    type Tag = AmqpTag;
    type Subscription = AmqpSubscription;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            publisher_confirms: true,
            // Quorum queues add `x-delivery-count`; classic queues only the flag.
            delivery_count: true,
            native_delays: false,
            dead_letter_exchange: true,
            declares_topology: true,
        }
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.provision_reported(plan, false).await.map(drop)
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<AmqpSubscription, TransportError> {
        let timeout = self.config.request_timeout();
        let (channel, consumer_tag, consumer) =
            subscription::open(&self.link.get(), queue, prefetch, timeout).await?;
        let acks = Arc::new(Acks::new(timeout));
        acks.set_window(usize::from(prefetch));
        spawn_flusher(Arc::downgrade(&acks), self.config.ack_flush_interval());
        {
            let mut subscriptions = self.subscriptions.lock().unwrap_or_else(|e| e.into_inner());
            subscriptions.retain(|w| w.strong_count() > 0);
            subscriptions.push(Arc::downgrade(&acks));
        }
        info!(queue, prefetch, channel = channel.id(), "consuming");
        Ok(AmqpSubscription::new(
            queue.to_owned(),
            prefetch,
            (channel, consumer_tag, consumer),
            acks,
            Arc::clone(&self.link),
            self.dead_letters(queue),
        ))
    }

    /// `basic.get` on a channel used only for it; opening the channel and the get each take
    /// at most the request timeout. A message that cannot be read as it came is rejected,
    /// from a queue that dead-letters into its parking queue, and the next one is fetched.
    ///
    /// A get that has no answer within the request timeout, or whose channel or connection
    /// fails before its answer, may have a message on its way that lapin would take
    /// unacknowledged on that channel, out of reach. So the channel is closed at once (its
    /// `get-ok`, if one was sent, goes back to the queue at its place, redelivered) and the
    /// fetch fails with [`TransportError::FetchLost`], for the consumer to excuse the crash
    /// that redelivery would otherwise show. The next fetch opens a new channel.
    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<AmqpTag>>, TransportError> {
        let timeout = self.config.request_timeout();
        let name = short(queue)?;
        loop {
            let channel = tokio::time::timeout(timeout, self.channel_in(&self.get_channel))
                .await
                .map_err(|_| TransportError::Timeout {
                    operation: "channel.open (for basic.get)",
                    after: timeout,
                })??;
            if !channel.status().connected() {
                // Nothing is sent on a channel that is not open: no message can be on its
                // way. Recovery reopens it.
                return Err(TransportError::connection_lost(format!(
                    "basic.get from {queue}: the get channel is not open"
                )));
            }
            let getting = channel.basic_get(name.clone(), BasicGetOptions { no_ack: false });
            let got = match tokio::time::timeout(timeout, getting).await {
                Ok(Ok(got)) => got,
                // The broker refused the get itself (a missing queue): it sent nothing.
                Ok(Err(e)) if closes_only_a_channel(&e) => return Err(queue_error(queue, e)),
                Ok(Err(e)) => {
                    let why = format!("its channel or connection failed before the get-ok: {e}");
                    return Err(self.lose_get_channel(&channel, queue, why, timeout).await);
                }
                Err(_) => {
                    let why = format!("no get-ok within {timeout:?}");
                    return Err(self.lose_get_channel(&channel, queue, why, timeout).await);
                }
            };
            let Some(got) = got else { return Ok(None) };
            let delivery = received(
                got.delivery,
                queue,
                Some(self.link.refusals()),
                |delivery_tag, acker| AmqpTag::fetched(acker, delivery_tag, timeout),
            );
            if let Some(delivery) =
                undecodable::unless_parked(queue, delivery, self.dead_letters(queue)).await
            {
                return Ok(Some(delivery));
            }
        }
    }

    /// Remembers which of `plan`'s queues dead-letter into its parking queue; checks
    /// nothing on the broker, since an unroutable publish comes back `Returned`.
    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.learn(plan);
        Ok(())
    }

    /// Counts `queue`'s ready messages with a passive declare every `poll`, until there is
    /// one. Each declare (opening its channel included) takes at most the request timeout.
    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        let name = short(queue)?;
        let timeout = self.config.request_timeout();
        loop {
            let declaring = async {
                let channel = self.channel_in(&self.inspect_channel).await?;
                channel
                    .queue_declare(
                        name.clone(),
                        QueueDeclareOptions {
                            passive: true,
                            ..QueueDeclareOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| queue_error(queue, e))
            };
            let declared = tokio::time::timeout(timeout, declaring)
                .await
                .map_err(|_| TransportError::Timeout {
                    operation: "queue.declare (passive)",
                    after: timeout,
                })??;
            if declared.message_count() > 0 {
                return Ok(());
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Publishes `mandatory` on the transport's publishing channel, with the publish's stamp
    /// in its [`PUBLISH_ID`](retry_core::headers::PUBLISH_ID) header: the result is paired
    /// with the broker's `basic.return`s by that stamp, never by lapin (see
    /// [`ReturnMatcher`](retry_core::ReturnMatcher)). A confirm that does not come within
    /// the confirm timeout fails every publish in flight on the channel, which is closed
    /// and replaced by the next publish.
    ///
    /// A copy of a message that could not be read as it came (marked
    /// [`UNDECODABLE_HEADER`](crate::UNDECODABLE_HEADER)) is refused with
    /// [`TransportError::Unsupported`]: its properties are known only as bytes, which lapin
    /// cannot write.
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        if let Some(why) = original.headers().get(UNDECODABLE_HEADER) {
            return PublishResult::Failed(TransportError::Unsupported {
                what: "a copy of a message that could not be read as it came".to_owned(),
                why: format!(
                    "{}; its properties are known only as bytes ({RAW_PROPERTIES_HEADER}): purge it, or publish a repaired one",
                    why.as_str().unwrap_or("no reason given")
                ),
            });
        }
        let connection = self.link.get();
        let timeout = self.config.confirm_timeout();
        self.publisher
            .publish(
                &connection,
                self.link.recoveries(),
                original,
                publish,
                timeout,
            )
            .await
    }

    async fn settle(&self, tag: &AmqpTag, settlement: Settlement) -> Result<(), TransportError> {
        tag.settle(settlement).await
    }

    /// A walk on a channel of its own: a delivery left costs nothing, and the end closes the
    /// channel, which puts back every one left at once (RabbitMQ does that in linear time,
    /// where a `basic.nack` with `multiple` takes quadratic time). A running consumer's
    /// fetches from the isolation queue never share the walk's channel, so the end cannot
    /// put back a suspect. A reconnection
    /// during the walk ends it with [`TransportError::Connection`]: the broker put back what
    /// the walk held, and reading on would see those messages twice.
    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<AmqpTag> + 'a>, TransportError> {
        let walk = ChannelWalk::open(&self.link, queue).await?;
        Ok(Box::new(walk))
    }

    /// tokio's timer wheel: far cheaper per handler run than the default's timer thread.
    fn sleep(&self, duration: Duration) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }

    /// [`AmqpTransport::close`]: every subscription's batched acknowledgements are sent,
    /// then the connection is closed. A failure (the connection already lost) is logged at
    /// DEBUG: the broker has put back what it held either way.
    async fn close(&self) {
        if let Err(e) = AmqpTransport::close(self).await {
            debug!(error = %e, "closing the transport failed");
        }
    }
}
