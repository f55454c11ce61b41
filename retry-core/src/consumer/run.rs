//! The run loop: one future that takes deliveries from two intakes, runs handlers, publishes
//! and settles concurrently, feeding every result back into the engine.
//!
//! The decisions are made elsewhere, without IO: the [`Engine`] decides what happens to
//! each delivery, and [`Lanes`] which intake has the turn (see `lanes.rs`). This loop owns
//! the futures: it turns their requests into receives, fetches, watches, flushes, handler
//! runs, publishes and settlements, runs them concurrently inside one future, and feeds
//! every result back.

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

use super::error::ConsumerError;
use super::lanes::{Io, LaneSettings, Lanes};
use super::metrics::{Metrics, RunOutcome, lane_label};
use super::storm::StormEvent;
use super::{Config, Consumer, Observer, RunReport, StormObserver};
use crate::HandlerError;
use crate::handler::Handler;
use crate::headers;
use crate::transport::{PublishResult, Subscription, Transport, TransportError};
use crate::{Action, DeliveryId, Engine, EngineError, Settlement, Terminal};
use crate::{Delivery, Message};
use crate::{Lane, Outcome};
use crate::{Timestamp, format_delay};

/// How long the last flush of acknowledgements may take when the consumer stops.
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

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
    Watched(Result<(), TransportError>),
    GateChanged,
}

/// What the driver keeps of a delivery, as the engine's data for it, from its receipt
/// until its settlement is done.
pub(super) struct Held<Tag> {
    tag: Tag,
    message: Message,
    span: Span,
    lane: Lane,
    /// What an excuse for it is keyed by, should its settlement fail.
    excuse_key: u64,
    /// It came from the isolation queue showing a crash the engine counts.
    evidence: bool,
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

    let settings = LaneSettings {
        queue: config.queue.clone(),
        isolation: engine.plan().isolation_queue().to_owned(),
        prefetch: config.prefetch,
        solo_runs: config.solo_runs,
        solo_time: config.solo_time,
        suspect_poll: config.suspect_poll,
    };
    let lanes = Lanes::new(settings, config.storm.clone(), config.gate.join());
    let driver = Driver {
        transport: &transport,
        handler: &handler,
        config: &config,
        observer: observer.as_ref(),
        on_storm: on_storm.as_ref(),
        metrics: Metrics::register(&config.queue),
        engine,
        lanes,
        settling: 0,
        tasks: FuturesUnordered::new(),
        report: RunReport::default(),
        subscription: None,
        recv: None,
        watch: None,
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
    engine: Engine<Held<T::Tag>>,
    lanes: Lanes<T::Tag>,
    /// Deliveries the engine is done with whose settlement is under way.
    settling: usize,
    tasks: FuturesUnordered<BoxFuture<'a, Event<T>>>,
    report: RunReport,
    subscription: Option<Arc<T::Subscription>>,
    /// A receive in progress, kept across turns rather than restarted: dropping one midway
    /// could lose a delivery inside the transport.
    recv: Option<BoxFuture<'a, Received<T::Tag>>>,
    /// Resolves when the isolation queue may have suspects.
    watch: Option<BoxFuture<'a, Result<(), TransportError>>>,
}

impl<'a, T: Transport, H: Handler> Driver<'a, T, H> {
    async fn drive(
        mut self,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<RunReport, ConsumerError> {
        let mut timer: Option<(Timestamp, BoxFuture<'static, ()>)> = None;
        let mut shutting_down = false;
        let mut grace: Option<BoxFuture<'static, ()>> = None;

        loop {
            let now = self.transport.now();
            if self.engine.poll_timeout().is_some_and(|due| due <= now) {
                self.engine.handle_timeout(now);
            }
            self.lanes.handle_timeout(now);
            self.pump(now)?;
            let due = [self.engine.poll_timeout(), self.lanes.poll_timeout()]
                .into_iter()
                .flatten()
                .min();
            timer = match (due, timer) {
                (None, _) => None,
                (Some(due), Some((armed, sleep))) if armed == due => Some((due, sleep)),
                (Some(due), _) => {
                    let wait = due.saturating_duration_since(now);
                    Some((due, self.transport.sleep(wait)))
                }
            };
            self.metrics.in_flight(self.lanes.held());
            // Fetches, subscribing and flushes are tasks too: none is cut short.
            if self.lanes.finished() && self.tasks.is_empty() {
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
                if let Some(pending) = self.recv.as_mut()
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
                if let Some(watch) = self.watch.as_mut()
                    && let Poll::Ready(result) = watch.as_mut().poll(cx)
                {
                    return Poll::Ready(Wake::Watched(result));
                }
                if self.lanes.gate().poll_changed(cx).is_ready() {
                    return Poll::Ready(Wake::GateChanged);
                }
                Poll::Pending
            })
            .await;

            let now = self.transport.now();
            match wake {
                Wake::Shutdown => {
                    info!(
                        queue = %self.config.queue,
                        in_flight = self.lanes.held(),
                        grace = %format_delay(self.config.shutdown_grace),
                        "shutdown requested: no more deliveries, finishing the ones held",
                    );
                    shutting_down = true;
                    self.lanes.handle_shutdown();
                    grace = Some(self.transport.sleep(self.config.shutdown_grace));
                }
                Wake::GraceOver => {
                    self.abandon_held();
                    break;
                }
                Wake::Event(event) => self.finish(event)?,
                Wake::Timer => timer = None,
                Wake::GateChanged => {}
                Wake::Watched(result) => {
                    self.watch = None;
                    self.lanes.handle_watch(now, result);
                }
                Wake::Received(received) => {
                    self.recv = None;
                    self.lanes.handle_received(received);
                }
            }
        }

        self.flush_at_exit().await;
        self.report.receive_errors = self.lanes.receive_errors();
        if let Some(fatal) = self.lanes.take_fatal() {
            return Err(fatal);
        }
        info!(queue = %self.config.queue, report = ?self.report, "consumer stopped");
        Ok(self.report)
    }

    /// Carries out what the scheduler and the engine ask for, until neither asks for more.
    fn pump(&mut self, now: Timestamp) -> Result<(), ConsumerError> {
        loop {
            let mut moved = false;
            while let Some(io) = self.lanes.poll_io(now) {
                moved = true;
                self.perform(io);
            }
            while let Some(action) = self.engine.poll_action() {
                moved = true;
                self.start(action)?;
            }
            while let Some(event) = self.lanes.poll_event() {
                self.storm_event(event);
            }
            if !moved {
                return Ok(());
            }
        }
    }

    /// Turns one of the scheduler's requests into a future, or hands a delivery to the
    /// engine.
    fn perform(&mut self, io: Io<T::Tag>) {
        let transport = self.transport;
        match io {
            Io::Subscribe { after } => {
                let sleep = after.map(|wait| transport.sleep(wait));
                let (queue, prefetch) = (&self.config.queue, self.config.prefetch);
                self.tasks.push(Box::pin(async move {
                    if let Some(sleep) = sleep {
                        sleep.await;
                    }
                    Event::Subscribed(transport.consume(queue, prefetch).await)
                }));
            }
            Io::Receive { after } => {
                let Some(subscription) = self.subscription.clone() else {
                    return;
                };
                let sleep = after.map(|wait| transport.sleep(wait));
                self.recv = Some(Box::pin(async move {
                    if let Some(sleep) = sleep {
                        sleep.await;
                    }
                    subscription.recv().await
                }));
            }
            Io::Watch => {
                let queue = self.engine.plan().isolation_queue().to_owned();
                let poll = self.config.suspect_poll;
                self.watch = Some(Box::pin(async move { transport.ready(&queue, poll).await }));
            }
            Io::Fetch => {
                let queue = self.engine.plan().isolation_queue().to_owned();
                self.tasks.push(Box::pin(async move {
                    Event::Fetched(transport.fetch(&queue).await)
                }));
            }
            Io::Flush => match self.subscription.clone() {
                Some(subscription) => self.tasks.push(Box::pin(async move {
                    Event::Flushed {
                        ends_phase: true,
                        result: subscription.flush().await,
                    }
                })),
                None => self.lanes.handle_flushed(),
            },
            Io::Admit {
                delivery,
                lane,
                probe,
            } => self.admit(delivery, lane, probe, false),
            Io::Decline { delivery } => self.admit(delivery, Lane::Isolation, false, true),
            Io::Cancel => {
                if let Some(subscription) = self.subscription.clone() {
                    self.tasks.push(Box::pin(async move {
                        Event::Cancelled(subscription.cancel().await)
                    }));
                }
            }
            Io::StopReceiving => {
                self.recv = None;
                self.watch = None;
            }
            Io::StopWatch => self.watch = None,
        }
    }

    /// Hands a delivery to the engine: to run, or, `declined`, to be put back in the
    /// isolation queue without running.
    fn admit(&mut self, delivery: Delivery<T::Tag>, lane: Lane, probe: bool, declined: bool) {
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
            excuse_key: facts.excuse_key(),
            evidence: false,
            probe,
            since: now,
        };
        let id = if declined {
            self.report.declined += 1;
            info!(parent: &span, "shutting down: the suspect goes back to the isolation queue unrun");
            self.engine.handle_declined(now, facts, held)
        } else {
            self.engine.handle_delivery(now, lane, facts, held)
        };
        let evidence = self.engine.counts_crash(id).unwrap_or(false);
        if let Some(held) = self.engine.data_mut(id) {
            held.evidence = evidence;
        }
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

    fn finish(&mut self, event: Event<T>) -> Result<(), ConsumerError> {
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
                self.lanes.handle_run_ended(now, lane, probe, failed);
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
            } => self.settled(held, terminal, result),
            Event::Subscribed(Ok(subscription)) => {
                self.subscription = Some(Arc::new(subscription));
                self.lanes.handle_subscribed(Ok(()));
            }
            Event::Subscribed(Err(e)) => self.lanes.handle_subscribed(Err(e)),
            Event::Cancelled(Err(e)) => {
                warn!(queue = %self.config.queue, error = &e as &dyn Error, "stopping the consumer failed");
            }
            Event::Cancelled(Ok(())) => {}
            Event::Flushed { ends_phase, result } => {
                if ends_phase {
                    self.lanes.handle_flushed();
                }
                if let Err(e) = result {
                    warn!(queue = %self.config.queue, error = &e as &dyn Error, "sending acknowledgements failed; the broker redelivers what it did not see settled");
                }
            }
            Event::Fetched(result) => {
                if let Err(TransportError::FetchLost { .. }) = &result {
                    self.engine.excuse_lost_fetch();
                }
                self.lanes.handle_fetched(now, result);
            }
            Event::ProbeAcked(result) => {
                self.settling -= 1;
                self.lanes.handle_released(false, false);
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
    ) {
        self.settling -= 1;
        let (back_in_isolation, excused) = match result {
            Ok(()) => {
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
                // A clone just went into the isolation queue: it waits for a solo run. A
                // suspect requeued there was excused by the engine.
                match terminal {
                    Terminal::Isolated => (true, false),
                    Terminal::Diverted { delay, .. } => (delay.is_zero(), false),
                    Terminal::Requeued { .. } => {
                        let isolation = held.lane == Lane::Isolation;
                        (isolation, isolation && !held.evidence)
                    }
                    _ => (false, false),
                }
            }
            Err(e) => {
                self.report.settle_errors += 1;
                warn!(
                    parent: &held.span,
                    error = &e as &dyn Error,
                    "settling failed; the broker will redeliver",
                );
                // The broker puts it back in the isolation queue redelivered, and this
                // process knows why: not a crash. Unless it showed a crash that its clone
                // records, or that a requeue leaves on it; and a requeue the engine decided
                // was excused by the engine already.
                let isolation = held.lane == Lane::Isolation;
                let requeued = matches!(terminal, Terminal::Requeued { .. });
                let excused = isolation && !held.evidence;
                if excused && !requeued {
                    self.engine.excuse(held.excuse_key);
                }
                (isolation, excused)
            }
        };
        self.lanes.handle_released(back_in_isolation, excused);
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

    fn storm_event(&mut self, event: StormEvent) {
        let queue = &self.config.queue;
        match event {
            StormEvent::Paused { cool_down } => {
                self.report.storm_pauses += 1;
                self.metrics.storm_paused(true);
                warn!(%queue, cool_down = %format_delay(cool_down), held = self.lanes.held(), "storm control: handlers keep failing; no new work until a probe succeeds");
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
