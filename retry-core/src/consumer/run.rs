//! The run loop: one future that takes deliveries from two intakes, runs handlers, publishes
//! and settles concurrently, feeding every result back into the engine.
//!
//! The intakes take turns ([`Phase`]):
//!
//! ```text
//!        suspects waiting                 nothing held             acks flushed
//!  Work ─────────────────────▶ Draining ─────────────▶ Flushing ───────────────▶ Solo
//!   ▲                                                                              │
//!   └──────────── isolation queue empty, or the solo limit reached ────────────────┘
//! ```
//!
//! In `Work` the subscription to the work queue feeds up to `prefetch` concurrent handlers.
//! Once the isolation queue has suspects, no new work starts; when every held delivery has
//! been settled and the subscription's acknowledgements flushed, suspects are fetched one at
//! a time, each run with nothing else running and settled before the next fetch.

use std::any::Any;
use std::error::Error;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures::future::{self, BoxFuture, Either};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tracing::field::{Empty, debug as debug_value, display as display_value};
use tracing::{Instrument, Span, debug, error, info, info_span, warn};

use super::metrics::{Metrics, RunOutcome, lane_label};
use super::storm::{Storm, StormEvent};
use super::{Config, Consumer, Observer, RunReport, StormObserver};
use crate::decision::{Lane, Outcome};
use crate::engine::{Action, DeliveryId, Engine, EngineError, Settlement, Terminal};
use crate::handler::{Handler, HandlerError};
use crate::headers;
use crate::message::{Delivery, Message};
use crate::time::{Timestamp, format_delay};
use crate::transport::{PublishResult, Subscription, Transport, TransportError};

/// The first wait before receiving again after a lost connection; it doubles per failure.
const MIN_RECEIVE_BACKOFF: Duration = Duration::from_millis(100);
/// Waits stay short so a recovered connection is used soon.
const MAX_RECEIVE_BACKOFF: Duration = Duration::from_secs(5);
/// How long the last flush of acknowledgements may take when the consumer stops.
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a consumer run stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Declaring the topology plan failed.
    #[error("provisioning the topology of queue {queue:?} failed")]
    Provision {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Verifying the topology plan failed, with provisioning turned off
    /// ([`ConsumerBuilder::with_provision`](crate::ConsumerBuilder::with_provision)): something the
    /// engine sends to is missing (see [`Transport::verify`]), or the broker could not be
    /// asked. Nothing was consumed.
    #[error("verifying the topology of queue {queue:?} (provisioning is off) failed")]
    Verify {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Starting to consume failed.
    #[error("starting to consume queue {queue:?} failed")]
    Consume {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Receiving failed in a way that trying again cannot fix (lost connections and
    /// timeouts are retried instead). Deliveries already held were finished first.
    #[error("receiving from queue {queue:?} failed")]
    Receive {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Taking suspects from the isolation queue failed in a way that trying again cannot
    /// fix (the queue does not exist, say). Deliveries already held were finished first.
    #[error("taking suspects from the isolation queue {queue:?} failed")]
    Isolation {
        /// The isolation queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// The engine refused an input: a bug in the driver, never a broker condition.
    #[error("the retry engine refused the consumer's input")]
    Engine(#[from] EngineError),
}

type Received<Tag> = Result<Option<Delivery<Tag>>, TransportError>;

/// How one handler run ended.
enum HandlerRun {
    Finished(Result<(), HandlerError>),
    Panicked(String),
    TimedOut,
}

/// Something that finished inside the consumer's future.
enum Event<T: Transport> {
    Handled {
        id: DeliveryId,
        run: HandlerRun,
    },
    Published {
        id: DeliveryId,
        result: PublishResult,
    },
    Settled {
        held: Held<T::Tag>,
        terminal: Terminal,
        result: Result<(), TransportError>,
    },
    Subscribed(Result<T::Subscription, TransportError>),
    Cancelled(Result<(), TransportError>),
    /// The subscription's acks were sent: before a solo phase when `ends_phase`, or at once
    /// after an isolation.
    Flushed {
        ends_phase: bool,
        result: Result<(), TransportError>,
    },
    Fetched(Received<T::Tag>),
    /// A topology probe was acknowledged, or its acknowledgement failed.
    ProbeAcked(Result<(), TransportError>),
}

/// Why the loop woke up.
enum Wake<T: Transport> {
    Shutdown,
    GraceOver,
    Event(Event<T>),
    Timer,
    Received(Received<T::Tag>),
    SuspectsWaiting(Result<(), TransportError>),
    TurnOver,
}

/// Which intake has the turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Work-queue deliveries run, up to `prefetch` at once.
    Work,
    /// Suspects wait: no new work starts until everything held is settled.
    Draining,
    /// Sending the work subscription's batched acknowledgements, so that a crash during
    /// the solo run cannot send handled work back to the queue.
    Flushing,
    /// Suspects run one at a time with nothing else running.
    Solo { started: Timestamp, runs: u32 },
}

/// What the driver keeps of a delivery, as the engine's data for it, from its receipt
/// until its settlement is done.
pub(super) struct Held<Tag> {
    tag: Tag,
    message: Message,
    span: Span,
    lane: Lane,
    identity: u64,
    /// Taken while storm control was probing.
    probe: bool,
    /// When its handler run, or its clone's publish, started.
    since: Timestamp,
}

pub(super) async fn run<T: Transport, H: Handler>(
    consumer: Consumer<T, H>,
    shutdown: impl Future<Output = ()>,
) -> Result<RunReport, ConsumerError> {
    let Consumer {
        transport,
        handler,
        engine,
        config,
        observer,
        on_storm,
    } = consumer;
    let mut shutdown = pin!(shutdown);

    // Shutdown is honoured during setup too: a broker that never answers must not keep the
    // process from stopping. Nothing is held yet, so there is nothing to leave behind.
    // Without provisioning the plan is still verified: a transport whose broker drops a
    // publish to a missing queue must not start sending clones into the void.
    let setup = if config.provision {
        transport.provision(engine.plan())
    } else {
        transport.verify(engine.plan())
    };
    match until_shutdown(setup, shutdown.as_mut()).await {
        None => return Ok(RunReport::default()),
        Some(Err(source)) => {
            let queue = config.queue.clone();
            return Err(if config.provision {
                ConsumerError::Provision { queue, source }
            } else {
                ConsumerError::Verify { queue, source }
            });
        }
        Some(Ok(())) => {}
    }

    let isolation = engine.plan().isolation_queue().to_owned();
    let driver = Driver {
        transport: &transport,
        handler: &handler,
        config: &config,
        observer: observer.as_ref(),
        on_storm: on_storm.as_ref(),
        metrics: Metrics::register(&config.queue),
        storm: config.storm.clone().map(Storm::new),
        isolation,
        engine,
        settling: 0,
        tasks: FuturesUnordered::new(),
        report: RunReport::default(),
        subscription: None,
    };
    driver.drive(shutdown).await
}

async fn until_shutdown<F: Future>(
    work: F,
    shutdown: Pin<&mut impl Future<Output = ()>>,
) -> Option<F::Output> {
    match future::select(pin!(work), shutdown).await {
        Either::Left((out, _)) => Some(out),
        Either::Right(((), _)) => None,
    }
}

struct Driver<'a, T: Transport, H: Handler> {
    transport: &'a T,
    handler: &'a H,
    config: &'a Config,
    observer: Option<&'a Observer>,
    on_storm: Option<&'a StormObserver>,
    metrics: Metrics,
    /// Storm control's state, when it is on.
    storm: Option<Storm>,
    isolation: String,
    engine: Engine<Held<T::Tag>>,
    /// Deliveries the engine is done with whose settlement is under way.
    settling: usize,
    tasks: FuturesUnordered<BoxFuture<'a, Event<T>>>,
    report: RunReport,
    subscription: Option<Arc<T::Subscription>>,
}

/// The loop's own state, apart from the deliveries.
struct Intake<'a, T: Transport> {
    phase: Phase,
    /// The isolation queue may hold suspects: drain and fetch when the work lane's turn is
    /// over.
    suspects: bool,
    /// A receive in progress, kept across turns rather than restarted: dropping one midway
    /// could lose a delivery inside the transport.
    recv: Option<BoxFuture<'a, Received<T::Tag>>>,
    /// A work delivery that arrived after the work lane's turn ended; it starts when the
    /// work lane has the turn again.
    deferred: Option<Delivery<T::Tag>>,
    /// The work queue is still being read: not shut down, and the stream has not ended.
    receiving: bool,
    subscribing: bool,
    fetching: bool,
    flushing: bool,
    backoff: Option<Duration>,
    next_backoff: Duration,
    /// Resolves when the isolation queue may have suspects.
    watch: Option<BoxFuture<'a, Result<(), TransportError>>>,
    /// Until this ends the work lane keeps its turn, after a solo phase that hit its limit.
    turn: Option<BoxFuture<'static, ()>>,
    fatal: Option<ConsumerError>,
}

impl<T: Transport> Intake<'_, T> {
    /// No more work is taken: a receive or watch under way is dropped, and a delivery
    /// received but never started goes back to the broker with the connection.
    fn stop_receiving(&mut self) {
        self.receiving = false;
        self.recv = None;
        self.watch = None;
        self.turn = None;
        self.deferred = None;
    }
}

impl<'a, T: Transport, H: Handler> Driver<'a, T, H> {
    async fn drive(
        mut self,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<RunReport, ConsumerError> {
        // A consumer starts by running the suspects left by the last one, before it takes
        // any work: a work delivery prefetched during a solo run that crashes comes back a
        // suspect itself.
        let mut intake: Intake<'a, T> = Intake {
            phase: Phase::Solo {
                started: self.transport.now(),
                runs: 0,
            },
            suspects: true,
            recv: None,
            deferred: None,
            receiving: true,
            subscribing: false,
            fetching: false,
            flushing: false,
            backoff: None,
            next_backoff: MIN_RECEIVE_BACKOFF,
            watch: None,
            turn: None,
            fatal: None,
        };
        let mut timer: Option<(Timestamp, BoxFuture<'static, ()>)> = None;
        let mut shutting_down = false;
        let mut grace: Option<BoxFuture<'static, ()>> = None;

        loop {
            let now = self.transport.now();
            if self.engine.poll_timeout().is_some_and(|due| due <= now) {
                self.engine.handle_timeout(now);
            }
            if let Some(event) = self.storm.as_mut().and_then(|s| s.handle_timeout(now)) {
                self.storm_event(event);
            }
            while let Some(action) = self.engine.poll_action() {
                self.start(action)?;
            }
            let storm_due = self.storm.as_ref().and_then(Storm::poll_timeout);
            let due = match (self.engine.poll_timeout(), storm_due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            timer = match (due, timer) {
                (None, _) => None,
                (Some(due), Some((armed, sleep))) if armed == due => Some((due, sleep)),
                (Some(due), _) => {
                    let wait = due.saturating_duration_since(now);
                    Some((due, self.transport.sleep(wait)))
                }
            };
            if let Some(fatal) = intake.fatal.as_ref()
                && intake.receiving
            {
                error!(queue = %self.config.queue, error = fatal as &dyn Error, "finishing the deliveries held, then stopping");
                intake.stop_receiving();
            }
            self.advance(&mut intake, now, shutting_down);
            self.metrics.in_flight(self.held());
            // Fetches, subscribing and flushes are tasks too: none is cut short.
            let stopping = shutting_down || !intake.receiving;
            if stopping && self.held() == 0 && self.tasks.is_empty() {
                break;
            }

            let wake = future::poll_fn(|cx| {
                if !shutting_down && shutdown.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Wake::Shutdown);
                }
                if let Some(grace) = grace.as_mut()
                    && grace.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Wake::GraceOver);
                }
                // Deliveries already waiting are taken before finished work is looked at:
                // after a crash, the redelivered ones all get isolated in one drain.
                if let Some(pending) = intake.recv.as_mut()
                    && let Poll::Ready(received) = pending.as_mut().poll(cx)
                {
                    return Poll::Ready(Wake::Received(received));
                }
                if let Poll::Ready(Some(event)) = self.tasks.poll_next_unpin(cx) {
                    return Poll::Ready(Wake::Event(event));
                }
                if let Some((_, sleep)) = timer.as_mut()
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Wake::Timer);
                }
                if let Some(watch) = intake.watch.as_mut()
                    && let Poll::Ready(result) = watch.as_mut().poll(cx)
                {
                    return Poll::Ready(Wake::SuspectsWaiting(result));
                }
                if let Some(turn) = intake.turn.as_mut()
                    && turn.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Wake::TurnOver);
                }
                Poll::Pending
            })
            .await;

            match wake {
                Wake::Shutdown => {
                    info!(
                        queue = %self.config.queue,
                        in_flight = self.held(),
                        grace = %format_delay(self.config.shutdown_grace),
                        "shutdown requested: no more deliveries, finishing the ones held",
                    );
                    shutting_down = true;
                    if let Some(subscription) = self.subscription.clone()
                        && intake.receiving
                    {
                        self.tasks.push(Box::pin(async move {
                            Event::Cancelled(subscription.cancel().await)
                        }));
                    }
                    intake.stop_receiving();
                    grace = Some(self.transport.sleep(self.config.shutdown_grace));
                }
                Wake::GraceOver => {
                    self.abandon_held();
                    break;
                }
                Wake::Event(event) => self.finish(event, &mut intake)?,
                Wake::Timer => timer = None,
                Wake::TurnOver => intake.turn = None,
                Wake::SuspectsWaiting(result) => {
                    intake.watch = None;
                    match result {
                        Ok(()) => intake.suspects = true,
                        Err(e) => self.isolation_error(&mut intake, e),
                    }
                }
                Wake::Received(received) => {
                    intake.recv = None;
                    self.received(&mut intake, received);
                }
            }
        }

        self.flush_at_exit().await;
        if let Some(fatal) = intake.fatal {
            return Err(fatal);
        }
        info!(queue = %self.config.queue, report = ?self.report, "consumer stopped");
        Ok(self.report)
    }

    /// Moves the intakes along: starts the next receive, fetch, flush or watch that the
    /// phase calls for, and changes phase when its work is done.
    fn advance(&mut self, intake: &mut Intake<'a, T>, now: Timestamp, shutting_down: bool) {
        loop {
            match intake.phase {
                Phase::Work => {
                    let turn_over = intake.turn.is_none();
                    if intake.suspects && turn_over && intake.receiving {
                        intake.phase = Phase::Draining;
                        debug!(queue = %self.config.queue, held = self.held(), "suspects waiting: draining the work lane");
                        continue;
                    }
                    if !intake.receiving {
                        return;
                    }
                    let Some(subscription) = self.subscription.clone() else {
                        if !intake.subscribing && !shutting_down {
                            intake.subscribing = true;
                            let transport = self.transport;
                            let (queue, prefetch) = (&self.config.queue, self.config.prefetch);
                            self.tasks.push(Box::pin(async move {
                                Event::Subscribed(transport.consume(queue, prefetch).await)
                            }));
                        }
                        return;
                    };
                    if intake.watch.is_none() && !intake.suspects {
                        let (transport, queue) = (self.transport, self.isolation.clone());
                        let poll = self.config.suspect_poll;
                        intake.watch =
                            Some(Box::pin(async move { transport.ready(&queue, poll).await }));
                    }
                    if self.held() >= self.work_limit() {
                        return;
                    }
                    if let Some(delivery) = intake.deferred.take() {
                        self.admit(delivery, Lane::Work);
                        continue;
                    }
                    if intake.recv.is_none() {
                        intake.recv = Some(self.receive(subscription, intake.backoff.take()));
                    }
                    return;
                }
                Phase::Draining => {
                    if self.held() > 0 {
                        // Redelivered deliveries still arriving are isolated meanwhile: after
                        // a crash they come first, and a handler never runs for them.
                        if let Some(subscription) = self.subscription.clone()
                            && intake.receiving
                            && intake.recv.is_none()
                            && intake.deferred.is_none()
                            && self.held() < usize::from(self.config.prefetch)
                        {
                            intake.recv = Some(self.receive(subscription, intake.backoff.take()));
                        }
                        return;
                    }
                    intake.phase = Phase::Flushing;
                    let Some(subscription) = self.subscription.clone() else {
                        continue;
                    };
                    intake.flushing = true;
                    self.tasks.push(Box::pin(async move {
                        Event::Flushed {
                            ends_phase: true,
                            result: subscription.flush().await,
                        }
                    }));
                    return;
                }
                Phase::Flushing => {
                    if intake.flushing {
                        return;
                    }
                    info!(queue = %self.config.queue, "running suspects alone");
                    intake.phase = Phase::Solo {
                        started: now,
                        runs: 0,
                    };
                }
                Phase::Solo { started, runs } => {
                    if self.held() > 0 || intake.fetching {
                        return;
                    }
                    let spent = now.saturating_duration_since(started);
                    let limit_reached =
                        runs >= self.config.solo_runs || spent >= self.config.solo_time;
                    if intake.suspects && !limit_reached && !shutting_down && intake.fatal.is_none()
                    {
                        intake.fetching = true;
                        let (transport, queue) = (self.transport, self.isolation.clone());
                        self.tasks.push(Box::pin(async move {
                            Event::Fetched(transport.fetch(&queue).await)
                        }));
                        return;
                    }
                    if intake.suspects && limit_reached {
                        // The work lane gets a turn as long as the solo phase took (at
                        // least the poll interval), so a stream of suspects cannot starve it.
                        let turn = spent.max(self.config.suspect_poll);
                        debug!(queue = %self.config.queue, runs, spent = %format_delay(spent), "solo limit reached: the work lane takes a turn");
                        intake.turn = Some(self.transport.sleep(turn));
                    }
                    intake.phase = Phase::Work;
                }
            }
        }
    }

    fn receive(
        &self,
        subscription: Arc<T::Subscription>,
        backoff: Option<Duration>,
    ) -> BoxFuture<'a, Received<T::Tag>> {
        let sleep = backoff.map(|wait| self.transport.sleep(wait));
        Box::pin(async move {
            if let Some(sleep) = sleep {
                sleep.await;
            }
            subscription.recv().await
        })
    }

    fn received(&mut self, intake: &mut Intake<'a, T>, received: Received<T::Tag>) {
        match received {
            Ok(Some(delivery)) => {
                intake.next_backoff = MIN_RECEIVE_BACKOFF;
                let isolating = intake.phase == Phase::Draining
                    && self.held() > 0
                    && delivery.facts.crash_evidence() > 0;
                if intake.phase == Phase::Work || isolating {
                    self.admit(delivery, Lane::Work);
                } else {
                    intake.deferred = Some(delivery);
                }
            }
            Ok(None) => {
                info!(queue = %self.config.queue, "the transport has no more deliveries");
                intake.receiving = false;
                intake.watch = None;
            }
            Err(TransportError::Closed) => {
                info!(queue = %self.config.queue, "the transport was closed");
                intake.receiving = false;
                intake.watch = None;
            }
            Err(e @ (TransportError::Connection { .. } | TransportError::Timeout { .. })) => {
                self.report.receive_errors += 1;
                warn!(
                    queue = %self.config.queue,
                    error = &e as &dyn Error,
                    retry_in = %format_delay(intake.next_backoff),
                    "receive failed; trying again",
                );
                intake.backoff = Some(intake.next_backoff);
                intake.next_backoff = (intake.next_backoff * 2).min(MAX_RECEIVE_BACKOFF);
            }
            Err(source) => {
                intake.fatal = Some(ConsumerError::Receive {
                    queue: self.config.queue.clone(),
                    source,
                });
            }
        }
    }

    /// A fetch or watch of the isolation queue failed. A lost connection ends the solo phase
    /// and tries again after the poll interval; anything else stops the consumer.
    fn isolation_error(&mut self, intake: &mut Intake<'a, T>, e: TransportError) {
        match e {
            TransportError::Connection { .. } | TransportError::Timeout { .. } => {
                self.report.receive_errors += 1;
                warn!(
                    queue = %self.isolation,
                    error = &e as &dyn Error,
                    retry_in = %format_delay(self.config.suspect_poll),
                    "taking suspects failed; trying again",
                );
                intake.suspects = true;
                intake.turn = Some(self.transport.sleep(self.config.suspect_poll));
                if matches!(intake.phase, Phase::Solo { .. }) {
                    intake.phase = Phase::Work;
                }
            }
            source => {
                intake.fatal = Some(ConsumerError::Isolation {
                    queue: self.isolation.clone(),
                    source,
                });
            }
        }
    }

    fn admit(&mut self, delivery: Delivery<T::Tag>, lane: Lane) {
        if delivery.message.headers().get(headers::PROBE).is_some() {
            self.ack_probe(delivery, lane);
            return;
        }
        let Delivery {
            tag,
            message,
            facts,
        } = delivery;
        self.report.received += 1;
        self.metrics.delivered(lane);
        if lane == Lane::Isolation {
            self.report.suspects += 1;
        }
        // The run number the engine admits it at, so a delivery that never reaches a handler
        // (an isolation or a crash diversion) still reports where it stood.
        let message = message.with_attempt(facts.attempts.saturating_add(1));
        let span = info_span!(
            "delivery",
            queue = %self.config.queue,
            lane = lane_label(lane),
            message_id = Empty,
            delivery = Empty,
            attempt = Empty,
            crashes = facts.crashes,
            outcome = Empty,
            terminal = Empty,
        );
        if let Some(id) = &message.properties().message_id {
            span.record("message_id", id.as_str());
        }
        let now = self.transport.now();
        let held = Held {
            tag,
            message,
            span: span.clone(),
            lane,
            identity: facts.identity,
            probe: lane == Lane::Work && self.storm.as_ref().is_some_and(Storm::probing),
            since: now,
        };
        let id = self.engine.handle_delivery(now, lane, facts, held);
        span.record("delivery", display_value(&id));
        if !facts.malformed.is_empty() {
            warn!(
                parent: &span,
                malformed = ?facts.malformed,
                "malformed retry headers were read as absent",
            );
        }
        if facts.crash_evidence() > 0 {
            debug!(
                parent: &span,
                redelivered = facts.redelivered,
                delivery_count = facts.delivery_count,
                crashes = facts.crashes,
                "delivery was held by a consumer that went away",
            );
        }
    }

    /// Acknowledges a topology probe without a handler run or an engine decision: it only
    /// checked that the broker routes a delayed copy back here (`retryctl topology verify`).
    fn ack_probe(&mut self, delivery: Delivery<T::Tag>, lane: Lane) {
        debug!(
            queue = %self.config.queue,
            lane = lane_label(lane),
            probe = ?delivery.message.headers().get(headers::PROBE),
            "acknowledging a topology probe without running the handler",
        );
        let transport = self.transport;
        self.settling += 1;
        self.tasks.push(Box::pin(async move {
            Event::ProbeAcked(transport.settle(&delivery.tag, Settlement::Ack).await)
        }));
    }

    /// Starts an action. Actions start in the engine's order and then run concurrently; the
    /// engine only asks to settle a delivery after its clone's confirm came back.
    fn start(&mut self, action: Action<Held<T::Tag>>) -> Result<(), ConsumerError> {
        let (transport, handler, config) = (self.transport, self.handler, self.config);
        let now = transport.now();
        match action {
            Action::RunHandler { delivery, attempt } => {
                let held = self.held_mut(delivery)?;
                held.since = now;
                held.message = held.message.with_attempt(attempt);
                held.span.record("attempt", attempt);
                if attempt > 1 {
                    debug!(parent: &held.span, attempt, "running the handler");
                }
                let run = run_handler(
                    transport,
                    handler,
                    held.message.clone(),
                    config.handler_timeout,
                );
                let span = held.span.clone();
                self.tasks.push(Box::pin(
                    async move {
                        Event::Handled {
                            id: delivery,
                            run: run.await,
                        }
                    }
                    .instrument(span),
                ));
            }
            Action::Publish { delivery, publish } => {
                let held = self.held_mut(delivery)?;
                held.since = now;
                let original = held.message.clone();
                let span = held.span.clone();
                debug!(
                    parent: &span,
                    exchange = %publish.route.exchange,
                    routing_key = %publish.route.routing_key,
                    "publishing the clone",
                );
                self.tasks.push(Box::pin(
                    async move {
                        let result = transport.publish(&original, &publish).await;
                        Event::Published {
                            id: delivery,
                            result,
                        }
                    }
                    .instrument(span),
                ));
            }
            Action::Settle {
                settlement,
                terminal,
                data: held,
                ..
            } => {
                held.span.record("terminal", debug_value(&terminal));
                log_terminal(&held.span, &terminal, settlement);
                let span = held.span.clone();
                self.settling += 1;
                self.tasks.push(Box::pin(
                    async move {
                        let result = transport.settle(&held.tag, settlement).await;
                        Event::Settled {
                            held,
                            terminal,
                            result,
                        }
                    }
                    .instrument(span),
                ));
            }
        }
        Ok(())
    }

    fn finish(&mut self, event: Event<T>, intake: &mut Intake<'a, T>) -> Result<(), ConsumerError> {
        let now = self.transport.now();
        match event {
            Event::Handled { id, run } => {
                let (outcome, label) = self.outcome(id, run);
                let held = self.held_mut(id)?;
                let (lane, probe, took) = (
                    held.lane,
                    held.probe,
                    now.saturating_duration_since(held.since),
                );
                held.span.record("outcome", label.as_str());
                self.metrics.handler_ran(lane, label, took);
                let failed = match label {
                    RunOutcome::Success => Some(false),
                    RunOutcome::Permanent => None,
                    _ => Some(true),
                };
                if lane == Lane::Work
                    && let Some(event) = self
                        .storm
                        .as_mut()
                        .and_then(|s| s.run_ended(now, probe, failed))
                {
                    self.storm_event(event);
                }
                self.engine.handle_outcome(now, id, outcome)?;
            }
            Event::Published { id, result } => {
                let held = self.held_mut(id)?;
                let (lane, took) = (held.lane, now.saturating_duration_since(held.since));
                self.metrics.confirmed(lane, took);
                if let PublishResult::Failed(e) = &result {
                    warn!(parent: &self.span(id), error = e as &dyn Error, "publishing the clone failed");
                }
                self.engine.handle_confirm(now, id, result.confirm())?;
            }
            Event::Settled {
                held,
                terminal,
                result,
            } => self.settled(held, terminal, result, intake),
            Event::Subscribed(result) => {
                intake.subscribing = false;
                match result {
                    Ok(subscription) => {
                        let subscription = Arc::new(subscription);
                        if intake.receiving {
                            info!(queue = %self.config.queue, prefetch = self.config.prefetch, "consuming");
                        } else {
                            // Shut down while it was being made.
                            let cancel = Arc::clone(&subscription);
                            self.tasks.push(Box::pin(async move {
                                Event::Cancelled(cancel.cancel().await)
                            }));
                        }
                        self.subscription = Some(subscription);
                    }
                    Err(source) => {
                        intake.fatal = Some(ConsumerError::Consume {
                            queue: self.config.queue.clone(),
                            source,
                        });
                    }
                }
            }
            Event::Cancelled(Err(e)) => {
                warn!(queue = %self.config.queue, error = &e as &dyn Error, "stopping the consumer failed");
            }
            Event::Cancelled(Ok(())) => {}
            Event::Flushed { ends_phase, result } => {
                intake.flushing &= !ends_phase;
                if let Err(e) = result {
                    warn!(queue = %self.config.queue, error = &e as &dyn Error, "sending acknowledgements failed; the broker redelivers what it did not see settled");
                }
            }
            Event::Fetched(result) => {
                intake.fetching = false;
                match result {
                    Ok(Some(delivery)) => {
                        if let Phase::Solo { runs, .. } = &mut intake.phase {
                            *runs += 1;
                        }
                        self.admit(delivery, Lane::Isolation);
                    }
                    Ok(None) => intake.suspects = false,
                    Err(e) => self.isolation_error(intake, e),
                }
            }
            Event::ProbeAcked(result) => {
                self.settling -= 1;
                match result {
                    Ok(()) => self.report.probes += 1,
                    Err(e) => {
                        warn!(queue = %self.config.queue, error = &e as &dyn Error, "acknowledging a topology probe failed; the broker will redeliver it");
                    }
                }
            }
        }
        Ok(())
    }

    fn settled(
        &mut self,
        held: Held<T::Tag>,
        terminal: Terminal,
        result: Result<(), TransportError>,
        intake: &mut Intake<'a, T>,
    ) {
        self.settling -= 1;
        match result {
            Ok(()) => {
                // A clone just went into the isolation queue: it waits for a solo run.
                let into_isolation = match terminal {
                    Terminal::Isolated => true,
                    Terminal::Diverted { delay, .. } => delay.is_zero(),
                    Terminal::Requeued { .. } => held.lane == Lane::Isolation,
                    _ => false,
                };
                intake.suspects |= into_isolation;
                if terminal == Terminal::Isolated
                    && let Some(subscription) = self.subscription.clone()
                {
                    // Its ack goes out now: a crash before a batched ack would be sent
                    // leaves the original to come back and be isolated a second time.
                    self.tasks.push(Box::pin(async move {
                        Event::Flushed {
                            ends_phase: false,
                            result: subscription.flush().await,
                        }
                    }));
                }
                self.report.count(&terminal);
                self.metrics.settled(held.lane, &terminal);
                if let Some(observer) = self.observer {
                    observer(&held.message, &terminal);
                }
            }
            Err(e) => {
                self.report.settle_errors += 1;
                if held.lane == Lane::Isolation {
                    // The broker puts it back in the isolation queue redelivered, and this
                    // process knows why: not a crash.
                    self.engine.excuse(held.identity);
                    intake.suspects = true;
                }
                warn!(
                    parent: &held.span,
                    error = &e as &dyn Error,
                    "settling failed; the broker will redeliver",
                );
            }
        }
    }

    /// The engine's outcome of a handler run, and its metrics label.
    fn outcome(&mut self, id: DeliveryId, run: HandlerRun) -> (Outcome, RunOutcome) {
        let span = self.span(id);
        let outcome = match run {
            HandlerRun::Finished(Ok(())) => Outcome::Success,
            HandlerRun::Finished(Err(e)) => {
                debug!(parent: &span, error = &e as &dyn Error, kind = ?e.kind(), "handler failed");
                e.to_outcome()
            }
            HandlerRun::Panicked(cause) => {
                self.report.handler_panics += 1;
                warn!(parent: &span, cause = %cause, "handler panicked");
                return (Outcome::Transient(cause), RunOutcome::Panic);
            }
            HandlerRun::TimedOut => {
                self.report.handler_timeouts += 1;
                let cause = format!(
                    "handler timed out after {}",
                    format_delay(self.config.handler_timeout)
                );
                warn!(parent: &span, "{cause}; it was cancelled");
                return (Outcome::Transient(cause), RunOutcome::Timeout);
            }
        };
        let label = match outcome {
            Outcome::Success => RunOutcome::Success,
            Outcome::Transient(_) => RunOutcome::Transient,
            Outcome::Permanent(_) => RunOutcome::Permanent,
            Outcome::RetryAfter(..) => RunOutcome::RetryAfter,
        };
        (outcome, label)
    }

    /// How many deliveries may be held while the work lane takes deliveries: `prefetch`,
    /// unless storm control holds it back.
    fn work_limit(&self) -> usize {
        let prefetch = self.config.prefetch;
        self.storm
            .as_ref()
            .map_or(usize::from(prefetch), |s| s.limit(prefetch))
    }

    fn storm_event(&mut self, event: StormEvent) {
        let queue = &self.config.queue;
        match event {
            StormEvent::Paused { cool_down } => {
                self.report.storm_pauses += 1;
                self.metrics.storm_paused(true);
                warn!(%queue, cool_down = %format_delay(cool_down), held = self.held(), "storm control: handlers keep failing; no new work until a probe succeeds");
            }
            StormEvent::Probing => {
                info!(%queue, "storm control: probing with one delivery at a time");
            }
            StormEvent::Resumed { paused_for } => {
                self.metrics.storm_paused(false);
                info!(%queue, paused_for = %format_delay(paused_for), "storm control: probes succeeded; full concurrency again");
            }
        }
        if let Some(observer) = self.on_storm {
            observer(&event);
        }
    }

    /// The shutdown grace is over: whatever is still held goes back to the broker unsettled,
    /// and the work still running for it is dropped with the loop.
    fn abandon_held(&mut self) {
        for (_, held) in self.engine.forget_all() {
            self.report.left_unsettled += 1;
            warn!(
                parent: &held.span,
                "shutdown grace over: left unsettled for the broker to redeliver",
            );
        }
        if self.settling > 0 {
            // Their settlements are cut short with the loop: the broker may redeliver them.
            self.report.left_unsettled += self.settling as u64;
            warn!(
                queue = %self.config.queue,
                settling = self.settling,
                "shutdown grace over: settlements under way were cut short",
            );
        }
    }

    /// Sends the acknowledgements still batched, so that everything the report counts as
    /// settled is settled on the broker when `run` returns.
    async fn flush_at_exit(&mut self) {
        let Some(subscription) = self.subscription.take() else {
            return;
        };
        let flushed = subscription.flush();
        let deadline = self.transport.sleep(FINAL_FLUSH_TIMEOUT);
        match future::select(flushed, deadline).await {
            Either::Left((Ok(()), _)) => {}
            Either::Left((Err(e), _)) => {
                error!(queue = %self.config.queue, error = &e as &dyn Error, "the last acknowledgements were not sent; the broker redelivers those deliveries");
            }
            Either::Right(((), _)) => {
                error!(queue = %self.config.queue, after = %format_delay(FINAL_FLUSH_TIMEOUT), "sending the last acknowledgements timed out; the broker may redeliver those deliveries");
            }
        }
    }

    /// Deliveries held: in the engine, or settling.
    fn held(&self) -> usize {
        self.engine.in_flight() + self.settling
    }

    fn held_mut(&mut self, id: DeliveryId) -> Result<&mut Held<T::Tag>, EngineError> {
        self.engine
            .data_mut(id)
            .ok_or(EngineError::UnknownDelivery(id))
    }

    fn span(&self, id: DeliveryId) -> Span {
        self.engine
            .data(id)
            .map_or_else(Span::none, |held| held.span.clone())
    }
}

/// Runs the handler once, catching a panic and cancelling it at the timeout. The call itself
/// happens inside the caught future, so a handler that panics before its first await is
/// caught too.
///
/// The timeout's timer is only made once the handler has to wait: most handlers on a
/// simulated clock finish on their first poll, and a timer each would cost more than the
/// handler. Its deadline is the same, counted from that first poll.
async fn run_handler<T: Transport, H: Handler>(
    transport: &T,
    handler: &H,
    msg: Message,
    timeout: Duration,
) -> HandlerRun {
    let mut run = pin!(AssertUnwindSafe(async { handler.handle(&msg).await }).catch_unwind());
    let mut expired: Option<BoxFuture<'static, ()>> = None;
    future::poll_fn(|cx| {
        if let Poll::Ready(result) = run.as_mut().poll(cx) {
            return Poll::Ready(match result {
                Ok(result) => HandlerRun::Finished(result),
                Err(payload) => HandlerRun::Panicked(panic_message(payload.as_ref())),
            });
        }
        let expired = expired.get_or_insert_with(|| transport.sleep(timeout));
        match expired.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(HandlerRun::TimedOut),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}

fn log_terminal(span: &Span, terminal: &Terminal, settlement: Settlement) {
    match *terminal {
        Terminal::Handled { attempt } => {
            debug!(parent: span, attempt, ?settlement, "handled");
        }
        Terminal::Retried { attempts, delay } => {
            info!(
                parent: span,
                attempts,
                delay = %format_delay(delay),
                "retry scheduled through the broker",
            );
        }
        Terminal::Isolated => {
            info!(
                parent: span,
                "redelivered: isolated as a suspect, to run alone; no crash counted",
            );
        }
        Terminal::Diverted { crashes, delay } => {
            warn!(
                parent: span,
                crashes,
                delay = %format_delay(delay),
                "running alone, it took its consumer down: crash counted, back to the isolation queue",
            );
        }
        Terminal::DeadLettered { reason } => {
            warn!(parent: span, reason = %reason, "parked in the dead-letter queue");
        }
        Terminal::Dropped { reason } => {
            warn!(parent: span, reason = %reason, "dropped, as the policy allows");
        }
        Terminal::Requeued { cause } => {
            warn!(parent: span, ?cause, "the clone was not confirmed after its retries; requeueing the original");
        }
    }
}
