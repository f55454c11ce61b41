//! [`NatsTransport`]: the [`Transport`] on NATS JetStream.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::{GetStreamError, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::Stream;
use async_nats::jetstream::{self, Context, ErrorCode};
use async_nats::{Client, Subject};
use async_trait::async_trait;
use retry_core::{
    BrokerSignals, Capabilities, Delivery, HeaderValue, Headers, Message, MessageParts,
    NativeParts, Publish, PublishResult, QueueRole, QueueSpec, QueueWalk, Route, Settlement,
    TopologyPlan, Transport, TransportError,
};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::codec::{
    COPY_ID_PREFIX, DUE, HEADER_BLOCK_HEADER, MSG_ID, UNDECODABLE_HEADER, copy_id, read_headers,
    write_headers,
};
use crate::config::NatsConfig;
use crate::connection::{self, Events, Receiver, Role};
use crate::delivery::{Origin, delivery_of, now_millis};
use crate::header_block::header_map;
use crate::mover::Mover;
use crate::names::{CONSUMER, stream_name};
use crate::provision::{self, bounded};
use crate::pull::{Pull, Pulled};
use crate::quarantine::{Quarantine, SweepTarget, Swept, Trigger};
use crate::stored::{consumer_info, next_stored};
use crate::subscription::{NatsSubscription, Pulling};
use crate::tag::{NatsTag, TagKind};

/// The oldest server this transport runs on: 2.7.1 brought the nak with a delay.
pub const MIN_SERVER_VERSION: (u64, u64, u64) = (2, 7, 1);

/// A connection to NATS JetStream that a [`Consumer`](retry_core::Consumer) runs on.
///
/// ```no_run
/// use std::time::Duration;
/// use retry_core::{Consumer, HandlerError, Message, RetryPolicy};
/// use transport_nats::{NatsConfig, NatsTransport};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// async fn handle(_: Message) -> Result<(), HandlerError> { Ok(()) }
///
/// let transport = NatsTransport::connect(NatsConfig::new("nats://127.0.0.1:4222")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
/// // Streams `comments`, `comments_retry_30s`, ... are created on the first run.
/// Consumer::builder(transport, "comments", policy, handle)
///     .build()?
///     .run(std::future::pending::<()>())
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct NatsTransport {
    inner: Arc<Inner>,
}

struct Inner {
    config: NatsConfig,
    client: Client,
    js: Context,
    routes: RwLock<Routes>,
    consumers: tokio::sync::Mutex<HashMap<String, PullConsumer>>,
    /// Movers by delay queue, and every subscription's pulling task.
    movers: Mutex<HashSet<String>>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// The connection pulls are made on; `client` is for everything else.
    receiver: Arc<Receiver>,
    /// How many times the receiving connection was (re)established.
    reconnects: tokio::sync::watch::Sender<u64>,
    /// How many times either connection was lost.
    losses: Arc<AtomicU64>,
    /// The queues this transport reads, for the sweep that parks what async-nats cannot read.
    quarantine: Quarantine,
    /// Queues a pull found a message async-nats misreads in, for a sweep.
    sweeps: tokio::sync::mpsc::UnboundedSender<String>,
    /// What [`ready`](Transport::ready) last saw of each queue whose only messages are
    /// handed out.
    looks: Mutex<HashMap<String, Look>>,
    /// Fetched deliveries whose settlement failed, by stream: see [`Owed`].
    owed: Mutex<HashMap<String, Vec<Owed>>>,
}

/// The messages a queue's consumer has handed out and not had acked, as the consumer's
/// info shows them: a change means one was delivered, acked or handed out again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HandedOut {
    delivered: u64,
    ack_floor: u64,
    count: usize,
}

/// When one of a queue's handed-out messages could next be handed out again: not before its
/// ack wait has passed since it was delivered (or last kept alive, which only its holder
/// knows), so that is when [`ready`](Transport::ready) answers, and then once per ack wait
/// while the set stays as it is.
struct Look {
    seen: HandedOut,
    next: Instant,
}

/// A fetched delivery whose settlement failed (a double ack that timed out, or lost with
/// its connection). Unless the server did take the settlement, the message is still in its
/// stream, handed out to this transport with nothing keeping it alive, and the server hands
/// it out again after the ack wait: the consumer claims it with a fetch before any work
/// runs, and that fetch must bring it back, not miss it because it is not back yet. So
/// the next fetch of its queue naks it (redelivered at once) and waits for it until `until`,
/// by which the server hands it out again even without the nak.
struct Owed {
    sequence: u64,
    reply: Subject,
    until: Instant,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Ok(tasks) = self.tasks.get_mut() {
            for task in tasks.drain(..) {
                task.abort();
            }
        }
    }
}

/// The plans this transport provisioned or verified: where a route leads, on NATS, is the
/// queue the plan binds it to.
#[derive(Default, Debug)]
struct Routes {
    plans: Vec<TopologyPlan>,
}

impl Routes {
    fn learn(&mut self, plan: &TopologyPlan) {
        if !self.plans.contains(plan) {
            self.plans.push(plan.clone());
        }
    }

    /// The parking queue of the plan `queue` belongs to.
    fn parking_of(&self, queue: &str) -> Option<String> {
        self.plans
            .iter()
            .find(|p| {
                p.queues()
                    .iter()
                    .any(|q| q.name == queue && !matches!(q.role, QueueRole::Parking))
            })
            .map(|p| p.parking_queue().to_owned())
    }

    /// The queue `route` leads to, and its level if it is a delay queue.
    fn target(&self, route: &Route) -> Option<(String, Option<Duration>)> {
        if route.exchange.is_empty() {
            // The default exchange: the queue it names, delayed if a plan says so.
            let level = self
                .plans
                .iter()
                .find_map(|p| p.queue_behind(route))
                .and_then(level);
            return Some((route.routing_key.to_string(), level));
        }
        let queue = self.plans.iter().find_map(|p| p.queue_behind(route))?;
        Some((queue.name.clone(), level(queue)))
    }
}

/// A delay queue's level.
fn level(queue: &QueueSpec) -> Option<Duration> {
    match queue.role {
        QueueRole::Delay { ttl } | QueueRole::CrashDelay { ttl } => Some(ttl),
        _ => None,
    }
}

/// An id no other publish of this process (or, by its time, of another) has.
fn unique_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{started}-{n}", std::process::id())
}

fn version(text: &str) -> Option<(u64, u64, u64)> {
    let core = text.trim_start_matches('v').split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

impl NatsTransport {
    /// Connects, and checks that the server has JetStream and is recent enough (2.7.1 or
    /// later). A server without JetStream, an older one, or a configuration that cannot be
    /// used fails here, with an error that says which, before anything is consumed.
    pub async fn connect(config: NatsConfig) -> Result<Self, TransportError> {
        let nodes = config
            .check()
            .map_err(|e| TransportError::Other(Box::new(e)))?;
        let events = Events {
            reconnects: tokio::sync::watch::channel(0u64).0,
            losses: Arc::new(AtomicU64::new(0)),
        };
        let url = config.url();
        let client = connection::connect(&config, nodes.clone(), Role::Control, &events).await?;
        let server = client.server_info();
        let found = version(&server.version);
        if found.is_none_or(|v| v < MIN_SERVER_VERSION) {
            return Err(TransportError::Unsupported {
                what: format!("NATS server {} at {url}", server.version),
                why: "this transport needs 2.7.1 or later: it delays retries with a nak that carries a delay".into(),
            });
        }
        let js = jetstream::ContextBuilder::new()
            .timeout(config.publish_timeout())
            .build(client.clone());
        // The account's JetStream information: a server without JetStream has no responder,
        // or answers with an error.
        let asked = bounded(
            config.operation_timeout(),
            "asking for JetStream",
            client.request("$JS.API.INFO", bytes::Bytes::new()),
        )
        .await?;
        let answer: Result<serde_json::Value, String> = match asked {
            Ok(m) => serde_json::from_slice(&m.payload).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let refusal = match &answer {
            Ok(v) => v.get("error").map(ToString::to_string),
            Err(e) => Some(e.clone()),
        };
        if let Some(why) = refusal {
            return Err(TransportError::Unsupported {
                what: format!("JetStream on the NATS server at {url}"),
                why: format!(
                    "the server does not answer JetStream requests ({why}): start it with JetStream on (`nats-server -js`, or a `jetstream {{}}` block in its configuration)"
                ),
            });
        }
        let receiver = Arc::new(Receiver::connect(&config, nodes, events.clone()).await?);
        info!(url = %url, version = %server.version, "connected to NATS JetStream");
        let (sweeps, sweep_requests) = tokio::sync::mpsc::unbounded_channel();
        let transport = NatsTransport {
            inner: Arc::new(Inner {
                config,
                client,
                js,
                routes: RwLock::new(Routes::default()),
                consumers: tokio::sync::Mutex::new(HashMap::new()),
                movers: Mutex::new(HashSet::new()),
                tasks: Mutex::new(Vec::new()),
                receiver,
                reconnects: events.reconnects,
                losses: events.losses,
                quarantine: Quarantine::default(),
                sweeps,
                looks: Mutex::new(HashMap::new()),
                owed: Mutex::new(HashMap::new()),
            }),
        };
        let sweeper = tokio::spawn(sweep_when_asked(
            Arc::downgrade(&transport.inner),
            transport.inner.reconnects.subscribe(),
            sweep_requests,
        ));
        transport.spawned(sweeper.abort_handle());
        Ok(transport)
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &NatsConfig {
        &self.inner.config
    }

    /// How many times one of this transport's two connections (the one its pulls are made
    /// on, and the one for everything else) was lost since it connected: the client
    /// reconnects after each, and a pulling connection whose client died is replaced.
    /// Counted when async-nats reports the loss, a moment after it.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), retry_core::TransportError> {
    /// use transport_nats::{NatsConfig, NatsTransport};
    ///
    /// let transport = NatsTransport::connect(NatsConfig::new("nats://127.0.0.1:4222")).await?;
    /// assert_eq!(transport.connection_losses(), 0);
    /// # Ok(()) }
    /// ```
    pub fn connection_losses(&self) -> u64 {
        self.inner.losses.load(Ordering::Relaxed)
    }

    /// The async-nats client, for what this transport does not do itself.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The plan's missing streams and consumers, by name; a stream or consumer that exists
    /// with other settings is an error that names it and the field.
    pub async fn missing(&self, plan: &TopologyPlan) -> Result<Vec<String>, TransportError> {
        let wanted = provision::wanted(plan, &self.inner.config)?;
        provision::apply(
            &self.inner.js,
            &wanted,
            false,
            self.inner.config.operation_timeout(),
        )
        .await
    }

    /// Stops every pull and mover of this transport and closes its connection. What its
    /// subscriptions held unsettled the server hands out again after the ack wait, marked
    /// redelivered.
    pub async fn close(&self) {
        if let Ok(mut tasks) = self.inner.tasks.lock() {
            for task in tasks.drain(..) {
                task.abort();
            }
        }
        self.inner.receiver.close().await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.inner.client.drain()).await;
    }

    /// Messages stored in `queue`'s stream: waiting, being handled, or (on a delay queue)
    /// waiting for their time. Copies of messages the queue's consumer has acked that the
    /// stream kept (at or below the consumer's ack floor: a server killed with SIGKILL
    /// before it wrote their deletes leaves them) are never delivered again: they are
    /// purged first, so the count is what consumers will be handed. A purge that fails is
    /// logged, and they are counted.
    pub async fn count(&self, queue: &str) -> Result<u64, TransportError> {
        let (first, stored) = self.stored(queue).await?;
        match self.clear_acked_copies(queue, first).await {
            Ok(0) => Ok(stored),
            Ok(_) => Ok(self.stored(queue).await?.1),
            Err(e) => {
                warn!(queue = %queue, error = &e as &dyn std::error::Error, "purging the acked copies below the consumer's ack floor failed; counting them");
                Ok(stored)
            }
        }
    }

    /// The first sequence of `queue`'s stream, and how many messages it stores.
    async fn stored(&self, queue: &str) -> Result<(u64, u64), TransportError> {
        // The lookup is the stream's info request: its state comes with it.
        let stream = bounded(
            self.inner.config.operation_timeout(),
            "looking up a stream",
            self.inner.js.get_stream(stream_name(queue)),
        )
        .await?
        .map_err(|e| missing_or_failed(queue, e))?;
        let state = &stream.cached_info().state;
        Ok((state.first_sequence, state.messages))
    }

    /// Purges the messages of `queue`'s stream at or below its consumer's ack floor, given
    /// the stream's `first` sequence, and answers how many went. Every message at or below
    /// the floor has been acked, and a work-queue stream deletes a message once acked; but
    /// after a server is killed (SIGKILL) its store can come back with deletes it had not
    /// written while the consumer's saved state has the acks, and such a copy sits in the
    /// stream for good: never delivered, yet counted. A queue without the transport's
    /// consumer (a parking queue) has no floor, and nothing is purged.
    async fn clear_acked_copies(&self, queue: &str, first: u64) -> Result<u64, TransportError> {
        let timeout = self.inner.config.operation_timeout();
        let info = match consumer_info(&self.inner.client, timeout, queue).await {
            Ok(info) => info,
            Err(e) if no_consumer(&e) => return Ok(0),
            Err(e) => return Err(e),
        };
        let floor = info.ack_floor.stream_sequence;
        if floor == 0 || first > floor {
            return Ok(0);
        }
        let stream = self.stream(queue).await?;
        // `seq`: everything below it goes; the floor only rises, so all of it is acked.
        let purged = bounded(
            timeout,
            "purging acked copies",
            stream
                .purge()
                .sequence(floor.saturating_add(1))
                .into_future(),
        )
        .await?
        .map_err(|e| {
            TransportError::connection_failed(format!("purging the acked copies in {queue}"), e)
        })?
        .purged;
        if purged > 0 {
            warn!(queue = %queue, purged, ack_floor = floor, "purged copies of acked messages the stream kept below its consumer's ack floor (a server killed before it wrote their deletes)");
        }
        Ok(purged)
    }

    /// [`clear_acked_copies`](Self::clear_acked_copies) of every queue this transport reads,
    /// after the pulling connection comes back: a server that was killed left them.
    async fn clear_acked_copies_everywhere(&self, queues: &[String]) {
        for queue in queues {
            let cleared = match self.stored(queue).await {
                Ok((first, _)) => self.clear_acked_copies(queue, first).await,
                Err(e) => Err(e),
            };
            if let Err(e) = cleared {
                debug!(queue = %queue, error = &e as &dyn std::error::Error, "looking for acked copies after a reconnection failed; the next count looks again");
            }
        }
    }

    fn spawned(&self, task: AbortHandle) {
        if let Ok(mut tasks) = self.inner.tasks.lock() {
            tasks.retain(|t| !t.is_finished());
            tasks.push(task);
        }
    }

    async fn consumer(&self, queue: &str) -> Result<PullConsumer, TransportError> {
        let mut consumers = self.inner.consumers.lock().await;
        if let Some(c) = consumers.get(queue) {
            return Ok(c.clone());
        }
        let name = stream_name(queue);
        let timeout = self.inner.config.operation_timeout();
        let stream = bounded(
            timeout,
            "looking up a stream",
            self.inner.js.get_stream(&name),
        )
        .await?
        .map_err(|e| missing_or_failed(queue, e))?;
        let consumer: PullConsumer = bounded(
            timeout,
            "looking up a consumer",
            stream.get_consumer(CONSUMER),
        )
        .await?
        .map_err(|e| TransportError::MissingAddress {
            address: format!("consumer {CONSUMER} on stream {name} (queue {queue})"),
            hint: format!("{e}; provision the plan first"),
        })?;
        consumers.insert(queue.to_owned(), consumer.clone());
        Ok(consumer)
    }

    /// Remembers `plan`'s routes and starts a mover for each of its delay queues.
    async fn learn(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let delays: Vec<(String, String, Duration)> = {
            let mut routes = self
                .inner
                .routes
                .write()
                .map_err(|_| TransportError::Other("route table poisoned".into()))?;
            routes.learn(plan);
            plan.delayed_destinations()
                .filter_map(|(level, route, destination)| {
                    Some((
                        plan.queue_behind(route)?.name.clone(),
                        destination.to_owned(),
                        level,
                    ))
                })
                .collect()
        };
        for (queue, destination, level) in delays {
            let fresh = self
                .inner
                .movers
                .lock()
                .map(|mut m| m.insert(queue.clone()))
                .unwrap_or(false);
            if !fresh {
                continue;
            }
            // The delay queue's consumer must be there before its mover pulls.
            if let Err(e) = self.consumer(&queue).await {
                if let Ok(mut m) = self.inner.movers.lock() {
                    m.remove(&queue);
                }
                return Err(e);
            }
            // In the background: a delay stream's handed-out range holds every clone waiting
            // for its time, and the mover need not wait for them all to be read.
            let first = self.clone();
            let sweep_queue = queue.clone();
            let sweep = tokio::spawn(async move { first.sweep_first_read(&sweep_queue).await });
            self.spawned(sweep.abort_handle());
            let mover = Mover {
                receiver: Arc::clone(&self.inner.receiver),
                js: self.inner.js.clone(),
                queue,
                destination,
                level,
                pull_wait: self.inner.config.pull_wait(),
                ack_wait: self.inner.config.ack_wait(),
                operation_timeout: self.inner.config.operation_timeout(),
                reconnects: self.inner.reconnects.subscribe(),
                sweeps: self.inner.sweeps.clone(),
            };
            let task = tokio::spawn(mover.run());
            self.spawned(task.abort_handle());
        }
        Ok(())
    }

    /// The server's view of `queue`'s consumer: what it has pending and handed out.
    async fn consumer_info(
        &self,
        consumer: &PullConsumer,
        queue: &str,
    ) -> Result<async_nats::jetstream::consumer::Info, TransportError> {
        bounded(
            self.inner.config.operation_timeout(),
            "reading a consumer",
            consumer.get_info(),
        )
        .await?
        .map_err(|e| {
            TransportError::connection_failed(format!("reading the consumer of {queue}"), e)
        })
    }

    /// How long until one of the messages `queue`'s consumer has handed out (`info`) could
    /// be handed out again, or zero when it could be now; in that case the next answer for
    /// the same set comes an ack wait later. See [`Look`].
    fn until_handed_out_again(
        &self,
        queue: &str,
        info: &async_nats::jetstream::consumer::Info,
    ) -> Duration {
        let seen = HandedOut {
            delivered: info.delivered.stream_sequence,
            ack_floor: info.ack_floor.stream_sequence,
            count: info.num_ack_pending,
        };
        let ack_wait = info.config.ack_wait;
        let now = Instant::now();
        // The last delivery's time is the server's clock; a message delivered then is not
        // handed out again before an ack wait has passed since.
        let since_delivery = info
            .delivered
            .last_active
            .and_then(|at| Duration::try_from(time::OffsetDateTime::now_utc() - at).ok())
            .unwrap_or(Duration::ZERO);
        let estimate = now + ack_wait.saturating_sub(since_delivery);
        let Ok(mut looks) = self.inner.looks.lock() else {
            return Duration::ZERO;
        };
        let look = looks.entry(queue.to_owned()).or_insert(Look {
            seen,
            next: estimate,
        });
        if look.seen != seen {
            // Those handed out before keep their time; one handed out since comes later.
            look.seen = seen;
            look.next = look.next.min(estimate);
        }
        if now >= look.next {
            look.next = now + ack_wait;
            return Duration::ZERO;
        }
        look.next - now
    }

    fn forget_look(&self, queue: &str) {
        if let Ok(mut looks) = self.inner.looks.lock() {
            looks.remove(queue);
        }
    }

    /// Remembers a fetched delivery whose settlement failed (see [`Owed`]).
    fn owe(&self, tag: &NatsTag) {
        let Some((stream, sequence, reply)) = tag.fetched() else {
            return;
        };
        let config = &self.inner.config;
        let until =
            Instant::now() + config.ack_wait() + config.fetch_wait() + Duration::from_secs(1);
        if let Ok(mut owed) = self.inner.owed.lock() {
            owed.entry(stream.to_owned()).or_default().push(Owed {
                sequence,
                reply: reply.clone(),
                until,
            });
        }
    }

    /// The fetched deliveries of `queue` whose settlement failed that are still in its
    /// stream and not yet past their time; the others are forgotten.
    async fn still_owed(
        &self,
        queue: &str,
    ) -> Result<Vec<(u64, Subject, Instant)>, TransportError> {
        let stream = stream_name(queue);
        let now = Instant::now();
        let candidates: Vec<(u64, Subject, Instant)> = match self.inner.owed.lock() {
            Ok(mut owed) => {
                let Some(list) = owed.get_mut(&stream) else {
                    return Ok(Vec::new());
                };
                list.retain(|o| o.until > now);
                let found = list
                    .iter()
                    .map(|o| (o.sequence, o.reply.clone(), o.until))
                    .collect();
                if list.is_empty() {
                    owed.remove(&stream);
                }
                found
            }
            Err(_) => return Ok(Vec::new()),
        };
        let mut kept = Vec::new();
        for (sequence, reply, until) in candidates {
            let stored = next_stored(
                &self.inner.client,
                self.inner.config.operation_timeout(),
                queue,
                sequence,
            )
            .await?;
            if stored.is_some_and(|m| m.sequence == sequence) {
                kept.push((sequence, reply, until));
            } else {
                // The server took the settlement after all: acked, it is gone.
                self.forget_owed(&stream, sequence);
            }
        }
        Ok(kept)
    }

    fn forget_owed(&self, stream: &str, sequence: u64) {
        if let Ok(mut owed) = self.inner.owed.lock()
            && let Some(list) = owed.get_mut(stream)
        {
            list.retain(|o| o.sequence != sequence);
            if list.is_empty() {
                owed.remove(stream);
            }
        }
    }

    /// A fetch of `queue` while deliveries it handed out are `owed`: each is naked, so the
    /// server hands it out again at once, and pulls go on until a message comes or the
    /// last of them is past its time.
    async fn reclaim(
        &self,
        queue: &str,
        owed: &[(u64, Subject, Instant)],
    ) -> Result<Option<async_nats::jetstream::Message>, TransportError> {
        for (_, reply, _) in owed {
            // A nak the server does not get costs only the wait for the ack wait.
            let _ = self
                .inner
                .client
                .publish(reply.clone(), bytes::Bytes::from_static(b"-NAK"))
                .await;
        }
        let until = owed.iter().map(|o| o.2).max().unwrap_or_else(Instant::now);
        loop {
            if let Some(message) = self.pull_one(queue).await? {
                if let Ok(info) = message.info() {
                    self.forget_owed(info.stream, info.stream_sequence);
                }
                return Ok(Some(message));
            }
            if Instant::now() >= until {
                return Ok(None);
            }
        }
    }

    /// One pull of one message from `queue`, waiting at most the fetch wait.
    async fn pull_one(
        &self,
        queue: &str,
    ) -> Result<Option<async_nats::jetstream::Message>, TransportError> {
        let config = &self.inner.config;
        let (generation, receiver) = self.inner.receiver.client();
        let pulled = Pull::start(
            &receiver,
            &self.inner.js,
            queue,
            1,
            config.fetch_wait(),
            config.operation_timeout(),
        )
        .await;
        let mut pull = match pulled {
            Ok(pull) => pull,
            Err(e) => {
                self.inner.receiver.revive(generation).await;
                return Err(e);
            }
        };
        match pull.next().await {
            Pulled::Message(m) => Ok(Some(m)),
            Pulled::End => Ok(None),
            Pulled::Misread => {
                let _ = self.inner.sweeps.send(queue.to_owned());
                Ok(None)
            }
            Pulled::Failed(why) => Err(why),
            // The message the server handed this pull, if any, comes back redelivered
            // through no crash: the consumer must not charge it one.
            Pulled::Unanswered => Err(TransportError::FetchLost {
                queue: queue.to_owned(),
                context: "the pull's expiry passed without the server's word that it ended".into(),
            }),
            Pulled::Lost => {
                self.inner.receiver.revive(generation).await;
                Err(TransportError::FetchLost {
                    queue: queue.to_owned(),
                    context: "the pull's subscription ended with its connection".into(),
                })
            }
        }
    }

    /// Whether `queue` has no message to hand out and none handed out unacknowledged
    /// (which the server hands out again once its ack wait has passed).
    async fn idle(&self, consumer: &PullConsumer, queue: &str) -> Result<bool, TransportError> {
        let info = self.consumer_info(consumer, queue).await?;
        Ok(info.num_pending == 0 && info.num_ack_pending == 0)
    }

    /// Parks every message of `queue` that async-nats cannot read among those its consumer
    /// has handed out and not had acked (see the `quarantine` module).
    async fn sweep(&self, queue: &str, trigger: Trigger) -> Result<Swept, TransportError> {
        let parking = self
            .inner
            .routes
            .read()
            .map_err(|_| TransportError::Other("route table poisoned".into()))?
            .parking_of(queue);
        let config = &self.inner.config;
        let target = SweepTarget {
            client: &self.inner.client,
            js: &self.inner.js,
            queue,
            parking,
            timeout: config.operation_timeout(),
            publish_timeout: config.publish_timeout(),
        };
        self.inner.quarantine.sweep(target, trigger).await
    }

    /// The sweep of a queue about to be read for the first time: a message that killed the
    /// connection of a process before this one is handed out still, and is parked before
    /// it comes back. A sweep that fails is logged, and reading goes on: the sweep after
    /// the next reconnection catches what this one missed.
    async fn sweep_first_read(&self, queue: &str) {
        if let Err(e) = self.sweep(queue, Trigger::FirstRead).await {
            warn!(queue = %queue, error = &e as &dyn std::error::Error, "quarantine sweep before the first read failed; reading anyway");
        }
    }

    /// A publish to `queue` that no stream answered: see [`unanswered_publish`].
    async fn unanswered(&self, queue: &str, e: PublishError) -> PublishResult {
        let lookup = bounded(
            self.inner.config.operation_timeout(),
            "looking up a stream",
            self.inner.js.get_stream(stream_name(queue)),
        )
        .await
        .map(|found| found.map(|_| ()));
        unanswered_publish(queue, lookup, e)
    }

    /// A handle on `queue`'s stream, without reading its info.
    async fn stream(&self, queue: &str) -> Result<Stream<()>, TransportError> {
        bounded(
            self.inner.config.operation_timeout(),
            "looking up a stream",
            self.inner.js.get_stream_no_info(stream_name(queue)),
        )
        .await?
        .map_err(|e| missing_or_failed(queue, e))
    }
}

/// Sweeps every queue the transport reads after each reconnection, all at once (a message
/// that failed the connection is handed out still, and comes back and fails the next
/// connection once its ack wait has passed), and a queue a pull found a misread message in.
async fn sweep_when_asked(
    inner: Weak<Inner>,
    mut reconnects: tokio::sync::watch::Receiver<u64>,
    mut requests: tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    loop {
        let (queues, trigger) = tokio::select! {
            changed = reconnects.changed() => {
                if changed.is_err() {
                    return;
                }
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                (inner.quarantine.queues(), Trigger::Reconnected)
            }
            queue = requests.recv() => match queue {
                Some(queue) => {
                    // Every request made meanwhile is served by the same sweeps.
                    let mut queues = vec![queue];
                    while let Ok(more) = requests.try_recv() {
                        if !queues.contains(&more) {
                            queues.push(more);
                        }
                    }
                    (queues, Trigger::Misread)
                }
                None => return,
            },
        };
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let transport = NatsTransport { inner };
        let sweeps = queues.iter().map(|queue| {
            let transport = &transport;
            async move {
                if let Err(e) = transport.sweep(queue, trigger).await {
                    error!(queue = %queue, ?trigger, error = &e as &dyn std::error::Error, "quarantine sweep failed; a message async-nats cannot read may come back");
                }
            }
        });
        futures::future::join_all(sweeps).await;
        if matches!(trigger, Trigger::Reconnected) {
            transport.clear_acked_copies_everywhere(&queues).await;
        }
    }
}

fn missing_or_failed(queue: &str, e: GetStreamError) -> TransportError {
    if provision::stream_missing(&e) {
        TransportError::MissingAddress {
            address: format!("stream {} (queue {queue})", stream_name(queue)),
            hint: "provision the plan first (`provision`, a Consumer with provisioning on, or `retryctl topology apply`)".into(),
        }
    } else {
        TransportError::connection_failed(format!("looking up the stream of {queue}"), e)
    }
}

impl std::fmt::Debug for NatsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsTransport")
            .field("url", &self.inner.config.url())
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for NatsTransport {
    type Tag = NatsTag;
    type Subscription = NatsSubscription;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            publisher_confirms: true,
            // `num_delivered` counts a nak's redelivery as much as a crash's: it is read as
            // a redelivered flag, never as a count of crashes.
            delivery_count: false,
            // Delays are held by the server: a nak with the time left.
            native_delays: true,
            dead_letter_exchange: false,
            declares_topology: true,
        }
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let wanted = provision::wanted(plan, &self.inner.config)?;
        provision::apply(
            &self.inner.js,
            &wanted,
            true,
            self.inner.config.operation_timeout(),
        )
        .await?;
        self.learn(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let missing = self.missing(plan).await?;
        if !missing.is_empty() {
            return Err(TransportError::MissingAddress {
                address: missing.join(", "),
                hint: "provision the plan first (`NatsTransport::provision`, a Consumer with provisioning on, or `retryctl topology apply`)".into(),
            });
        }
        self.learn(plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<NatsSubscription, TransportError> {
        // Fail now, by name, on a queue without its consumer.
        self.consumer(queue).await?;
        self.sweep_first_read(queue).await;
        let config = &self.inner.config;
        let (subscription, task) = NatsSubscription::start(Pulling {
            receiver: Arc::clone(&self.inner.receiver),
            js: self.inner.js.clone(),
            queue: queue.to_owned(),
            prefetch,
            pull_wait: config.pull_wait(),
            ack_wait: config.ack_wait(),
            operation_timeout: config.operation_timeout(),
            reconnects: self.inner.reconnects.subscribe(),
            sweeps: self.inner.sweeps.clone(),
        });
        self.spawned(task);
        Ok(subscription)
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<NatsTag>>, TransportError> {
        let consumer = self.consumer(queue).await?;
        self.sweep_first_read(queue).await;
        let config = &self.inner.config;
        let owed = self.still_owed(queue).await?;
        let message = if owed.is_empty() {
            // A queue with nothing to hand out and nothing handed out answers at once,
            // rather than after the fetch wait: the consumer's first look at its isolation
            // queue, which is empty nearly always, waits for this before its work queue is
            // consumed.
            if self.idle(&consumer, queue).await? {
                return Ok(None);
            }
            self.pull_one(queue).await?
        } else {
            self.reclaim(queue, &owed).await?
        };
        let Some(message) = message else {
            return Ok(None);
        };
        let delivery = delivery_of(
            &self.inner.client,
            message,
            queue,
            true,
            config.operation_timeout(),
            None,
        )?;
        delivery.tag.keep_alive(config.ack_wait() / 3);
        Ok(Some(delivery))
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        let consumer = self.consumer(queue).await?;
        loop {
            let info = self.consumer_info(&consumer, queue).await?;
            if info.num_pending > 0 {
                return Ok(());
            }
            // A message handed out and not acked is not pending: its holder may have died
            // with it, and then the server hands it out again once its ack wait has passed
            // without a keep-alive; only a fetch can tell. The answer comes when that could
            // have happened, not every `poll`: a long suspect another process runs, kept
            // alive, would otherwise have every consumer drain its work and fetch nothing,
            // every `poll`, for as long as it runs.
            let wait = if info.num_ack_pending > 0 {
                match self.until_handed_out_again(queue, &info) {
                    Duration::ZERO => return Ok(()),
                    wait => wait.min(poll),
                }
            } else {
                self.forget_look(queue);
                poll
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Publishes the clone to the queue its route leads to and waits for the stream's
    /// acknowledgement. A clone for a delay queue carries when it is due. Its
    /// `Nats-Msg-Id` names the delivery it is a clone of and where it goes, so publishing
    /// it again (after a lost acknowledgement) stores it once.
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let (queue, level) = {
            let Ok(routes) = self.inner.routes.read() else {
                return PublishResult::Failed(TransportError::Other("route table poisoned".into()));
            };
            match routes.target(&publish.route) {
                Some(target) => target,
                None => {
                    return PublishResult::Failed(TransportError::MissingAddress {
                        address: format!(
                            "the queue behind exchange {:?} with routing key {:?}",
                            publish.route.exchange, publish.route.routing_key
                        ),
                        hint: "no plan this transport provisioned or verified routes it".into(),
                    });
                }
            }
        };
        let headers = publish.clone_headers(original);
        let mut map = match write_headers(original.properties(), &headers) {
            Ok(m) => m,
            Err(e) => return PublishResult::Failed(e),
        };
        if let Some(level) = level {
            let delay = publish.expiration.unwrap_or(level);
            let due =
                now_millis().saturating_add(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
            map.insert(DUE, due.to_string().as_str());
        }
        let id = match original.parts().native.get::<Origin>() {
            Some(o) => copy_id(&o.stream, o.sequence, o.stored_ns, &queue),
            // Not read from NATS: nothing names it, so no publish of it can be repeated.
            None => format!("{COPY_ID_PREFIX}{}:{queue}", unique_id()),
        };
        map.insert(MSG_ID, id.as_str());
        let message = PublishMessage::build()
            .payload(original.body().to_vec().into())
            .headers(map)
            .expected_stream(stream_name(&queue));
        let sent = match self.inner.js.send_publish(queue.clone(), message).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => PublishResult::Confirmed,
            Err(e) => match e.kind() {
                PublishErrorKind::StreamNotFound => self.unanswered(&queue, e).await,
                PublishErrorKind::TimedOut => PublishResult::Failed(TransportError::Timeout {
                    operation: "a publish acknowledgement",
                    after: self.inner.config.publish_timeout(),
                }),
                _ if refused(&e) => PublishResult::Refused,
                _ => PublishResult::Failed(TransportError::connection_failed(
                    format!("publishing to {queue}"),
                    e,
                )),
            },
        }
    }

    async fn settle(&self, tag: &NatsTag, settlement: Settlement) -> Result<(), TransportError> {
        match tag.stored() {
            None => {
                let settled = tag.settle_delivery(settlement).await;
                if settled.is_err() {
                    self.owe(tag);
                }
                settled
            }
            Some((queue, sequence)) if settlement == Settlement::Ack => {
                let stream = self.stream(queue).await?;
                bounded(
                    self.inner.config.operation_timeout(),
                    "deleting a stored message",
                    stream.delete_message(sequence),
                )
                .await?
                .map(|_| ())
                .map_err(|e| TransportError::connection_failed(format!("deleting {tag:?}"), e))
            }
            Some(_) => Ok(()),
        }
    }

    /// Reads the stream's stored messages in order without consuming them: a message the
    /// walk leaves stays where it is, untouched (no redelivery is counted), and one it
    /// acks is deleted.
    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<NatsTag> + 'a>, TransportError> {
        // Fail now, by name, on a queue with no stream.
        self.count(queue).await?;
        Ok(Box::new(StoredWalk {
            transport: self,
            queue: queue.to_owned(),
            next: 1,
        }))
    }

    /// [`NatsTransport::close`]: stops every pull and mover and drains the connection.
    async fn close(&self) {
        // The inherent method, not this one.
        NatsTransport::close(self).await
    }
}

/// What a publish no stream answered is, given the lookup of its `queue`'s stream:
/// nats-server answers "no responders" (async-nats reports it as a missing stream) when no
/// stream captures the subject, and also while a restarted server restores its streams.
/// Only a stream the server says does not exist makes the publish
/// [`Returned`](PublishResult::Returned) (unroutable); otherwise it failed, and is tried
/// again.
fn unanswered_publish(
    queue: &str,
    lookup: Result<Result<(), GetStreamError>, TransportError>,
    e: PublishError,
) -> PublishResult {
    let stream = stream_name(queue);
    let why = match lookup {
        Ok(Err(missing)) if provision::stream_missing(&missing) => return PublishResult::Returned,
        Ok(Ok(())) => format!(
            "publishing to {queue}: no stream answered, yet stream {stream} exists (a server still restoring its streams answers so)"
        ),
        Ok(Err(other)) => format!(
            "publishing to {queue}: no stream answered, and looking up stream {stream} failed ({other})"
        ),
        Err(lookup) => format!(
            "publishing to {queue}: no stream answered, and looking up stream {stream} failed ({lookup})"
        ),
    };
    PublishResult::Failed(TransportError::connection_failed(why, e))
}

/// Whether `e`, from reading a queue's consumer, says the stream has no such consumer (a
/// parking queue's stream has none).
fn no_consumer(e: &TransportError) -> bool {
    match e {
        TransportError::MissingAddress { .. } => true,
        TransportError::Connection {
            source: Some(source),
            ..
        } => source
            .downcast_ref::<async_nats::jetstream::Error>()
            .is_some_and(|server| server.error_code() == ErrorCode::CONSUMER_NOT_FOUND),
        _ => false,
    }
}

/// A publish the stream refused for its limits: a message larger than it takes, or a full
/// stream that discards new messages, or storage the account or server has no more of.
fn refused(e: &PublishError) -> bool {
    let Some(server) =
        std::error::Error::source(e).and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
    else {
        return false;
    };
    let code = server.error_code();
    code == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
        || code == ErrorCode::STORAGE_RESOURCES_EXCEEDED
        || code == ErrorCode::ACCOUNT_RESOURCES_EXCEEDED
        // "maximum messages exceeded", "maximum bytes exceeded": a store failure that
        // names a limit.
        || (code == ErrorCode(10077) && server.to_string().contains("maximum"))
}

/// [`NatsTransport::walk`]: stored messages by sequence.
struct StoredWalk<'a> {
    transport: &'a NatsTransport,
    queue: String,
    next: u64,
}

#[async_trait]
impl QueueWalk<NatsTag> for StoredWalk<'_> {
    /// Reads the next stored message by hand (see the `stored` module): one whose header
    /// block async-nats cannot read is handed out with why ([`UNDECODABLE_HEADER`]) and its
    /// block ([`HEADER_BLOCK_HEADER`]) as its only headers, rather than failing the walk.
    async fn next(&mut self) -> Result<Option<Delivery<NatsTag>>, TransportError> {
        let Some(message) = next_stored(
            &self.transport.inner.client,
            self.transport.inner.config.operation_timeout(),
            &self.queue,
            self.next,
        )
        .await?
        else {
            return Ok(None);
        };
        self.next = message.sequence + 1;
        let (properties, headers) = match message.header_block.as_deref().map(header_map) {
            None => read_headers(None),
            Some(Ok(map)) => read_headers(Some(&map)),
            Some(Err(why)) => {
                let mut headers = Headers::new();
                headers.insert(UNDECODABLE_HEADER, why.to_string());
                headers.insert(
                    HEADER_BLOCK_HEADER,
                    HeaderValue::Bytes(message.header_block.clone().unwrap_or_default()),
                );
                (read_headers(None).0, headers)
            }
        };
        let stream = stream_name(&self.queue);
        let parts = MessageParts {
            queue: self.queue.clone(),
            exchange: String::new(),
            routing_key: message.subject,
            body: message.payload,
            properties,
            headers,
            native: NativeParts::new(Origin {
                stream: stream.clone(),
                sequence: message.sequence,
                stored_ns: message.stored_ns,
            }),
        };
        let tag = NatsTag::delivered(
            TagKind::Stored {
                queue: self.queue.clone(),
                sequence: message.sequence,
            },
            None,
        );
        Ok(Some(Delivery::new(tag, parts, BrokerSignals::default())))
    }

    fn leave(&mut self, _tag: NatsTag) {}

    async fn ack(&mut self, tag: NatsTag) -> Result<(), TransportError> {
        self.transport.settle(&tag, Settlement::Ack).await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_compared_as_numbers() {
        assert_eq!(version("2.9.10"), Some((2, 9, 10)));
        assert_eq!(version("v2.10.0-beta.1"), Some((2, 10, 0)));
        assert!(version("2.9.10").unwrap() >= MIN_SERVER_VERSION);
        assert!(version("2.7.0").unwrap() < MIN_SERVER_VERSION);
        assert_eq!(version("garbage"), None);
    }
}
