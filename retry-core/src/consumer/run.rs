//! The run loop: one future that receives, runs handlers, publishes and settles concurrently,
//! feeding every result back into the engine.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{Pin, pin};
use std::task::Poll;
use std::time::Duration;

use futures::future::{self, BoxFuture, Either};
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tracing::field::{Empty, debug as debug_value};
use tracing::{Instrument, Span, debug, error, info, info_span, warn};

use super::{Config, Consumer, Observer, RunReport};
use crate::decision::Outcome;
use crate::engine::{Action, DeliveryId, Engine, EngineError, Settlement, Terminal};
use crate::handler::{Handler, HandlerError};
use crate::message::{Delivery, Message};
use crate::time::{Timestamp, format_delay};
use crate::transport::{PublishResult, Transport, TransportError};

/// The first wait before receiving again after a lost connection; it doubles per failure.
const MIN_RECEIVE_BACKOFF: Duration = Duration::from_millis(100);
/// Waits stay short so a recovered connection is used soon.
const MAX_RECEIVE_BACKOFF: Duration = Duration::from_secs(5);

/// Why a consumer run stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Declaring the topology plan failed.
    #[error("provisioning the topology of queue {queue:?} failed: {source}")]
    Provision {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Starting to consume failed.
    #[error("starting to consume queue {queue:?} failed: {source}")]
    Consume {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Receiving failed in a way that trying again cannot fix (lost connections and
    /// timeouts are retried instead). Deliveries already held were finished first.
    #[error("receiving from queue {queue:?} failed: {source}")]
    Receive {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// The engine refused an input: a bug in the driver, never a broker condition.
    #[error("the retry engine refused the consumer's input: {0}")]
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
enum Event {
    Handled {
        id: DeliveryId,
        run: HandlerRun,
    },
    Published {
        id: DeliveryId,
        result: PublishResult,
    },
    Settled {
        id: DeliveryId,
        result: Result<(), TransportError>,
    },
    Cancelled(Result<(), TransportError>),
}

/// Why the loop woke up.
enum Wake<Tag> {
    Shutdown,
    GraceOver,
    Event(Event),
    Timer,
    Received(Received<Tag>),
}

/// A delivery between its receipt and the end of its settlement.
struct Held<Tag> {
    tag: Tag,
    message: Message,
    span: Span,
    terminal: Option<Terminal>,
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
    } = consumer;
    let mut shutdown = pin!(shutdown);

    // Shutdown is honoured during setup too: a broker that never answers must not keep the
    // process from stopping. Nothing is held yet, so there is nothing to leave behind.
    if config.provision {
        let provisioned = transport.provision(engine.plan());
        match until_shutdown(provisioned, shutdown.as_mut()).await {
            None => return Ok(RunReport::default()),
            Some(Err(source)) => {
                return Err(ConsumerError::Provision {
                    queue: config.queue.clone(),
                    source,
                });
            }
            Some(Ok(())) => {}
        }
    }
    let consuming = transport.consume(&config.queue, config.prefetch);
    match until_shutdown(consuming, shutdown.as_mut()).await {
        None => return Ok(RunReport::default()),
        Some(Err(source)) => {
            return Err(ConsumerError::Consume {
                queue: config.queue.clone(),
                source,
            });
        }
        Some(Ok(())) => {}
    }
    info!(queue = %config.queue, prefetch = config.prefetch, "consuming");

    let driver = Driver {
        transport: &transport,
        handler: &handler,
        config: &config,
        observer: observer.as_ref(),
        engine,
        held: HashMap::with_capacity(usize::from(config.prefetch)),
        tasks: FuturesUnordered::new(),
        report: RunReport::default(),
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
    engine: Engine,
    held: HashMap<DeliveryId, Held<T::Tag>>,
    tasks: FuturesUnordered<BoxFuture<'a, Event>>,
    report: RunReport,
}

impl<'a, T: Transport, H: Handler> Driver<'a, T, H> {
    async fn drive(
        mut self,
        mut shutdown: Pin<&mut impl Future<Output = ()>>,
    ) -> Result<RunReport, ConsumerError> {
        // A receive in progress is kept across turns rather than restarted: dropping one
        // midway could lose a delivery inside the transport.
        let mut recv: Option<BoxFuture<'a, Received<T::Tag>>> = None;
        let mut receiving = true;
        let mut backoff: Option<Duration> = None;
        let mut next_backoff = MIN_RECEIVE_BACKOFF;
        let mut fatal: Option<TransportError> = None;
        let mut timer: Option<(Timestamp, BoxFuture<'static, ()>)> = None;
        let mut shutting_down = false;
        let mut grace: Option<BoxFuture<'static, ()>> = None;

        loop {
            let now = self.transport.now();
            while let Some(action) = self.engine.poll_action(now) {
                self.start(action)?;
            }
            timer = match (self.engine.poll_timeout(now), timer) {
                (None, _) => None,
                (Some(wait), Some((due, sleep))) if due == now + wait => Some((due, sleep)),
                (Some(wait), _) => Some((now + wait, self.transport.sleep(wait))),
            };
            if receiving && recv.is_none() && self.held.len() < usize::from(self.config.prefetch) {
                recv = Some(self.receive(backoff.take()));
            }
            if !receiving && self.held.is_empty() && self.tasks.is_empty() {
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
                if let Poll::Ready(Some(event)) = self.tasks.poll_next_unpin(cx) {
                    return Poll::Ready(Wake::Event(event));
                }
                if let Some((_, sleep)) = timer.as_mut()
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Wake::Timer);
                }
                if let Some(pending) = recv.as_mut()
                    && let Poll::Ready(received) = pending.as_mut().poll(cx)
                {
                    return Poll::Ready(Wake::Received(received));
                }
                Poll::Pending
            })
            .await;

            match wake {
                Wake::Shutdown => {
                    info!(
                        queue = %self.config.queue,
                        in_flight = self.held.len(),
                        grace = %format_delay(self.config.shutdown_grace),
                        "shutdown requested: no more deliveries, finishing the ones held",
                    );
                    shutting_down = true;
                    recv = None;
                    // A transport that already ended the stream has nothing to cancel.
                    if receiving {
                        let cancel = self.transport.cancel();
                        self.tasks.push(Box::pin(cancel.map(Event::Cancelled)));
                    }
                    receiving = false;
                    grace = Some(self.transport.sleep(self.config.shutdown_grace));
                }
                Wake::GraceOver => {
                    self.abandon_held();
                    break;
                }
                Wake::Event(event) => self.finish(event)?,
                Wake::Timer => timer = None,
                Wake::Received(received) => {
                    recv = None;
                    match received {
                        Ok(Some(delivery)) => {
                            next_backoff = MIN_RECEIVE_BACKOFF;
                            self.admit(delivery);
                        }
                        Ok(None) => {
                            info!(queue = %self.config.queue, "the transport has no more deliveries");
                            receiving = false;
                        }
                        Err(TransportError::Closed) => {
                            info!(queue = %self.config.queue, "the transport was closed");
                            receiving = false;
                        }
                        Err(
                            e @ (TransportError::Connection(_) | TransportError::Timeout { .. }),
                        ) => {
                            self.report.receive_errors += 1;
                            warn!(
                                queue = %self.config.queue,
                                error = %e,
                                retry_in = %format_delay(next_backoff),
                                "receive failed; trying again",
                            );
                            backoff = Some(next_backoff);
                            next_backoff = (next_backoff * 2).min(MAX_RECEIVE_BACKOFF);
                        }
                        Err(e) => {
                            error!(
                                queue = %self.config.queue,
                                error = %e,
                                "receive failed; finishing the deliveries held, then stopping",
                            );
                            receiving = false;
                            fatal = Some(e);
                        }
                    }
                }
            }
        }

        if let Some(source) = fatal {
            return Err(ConsumerError::Receive {
                queue: self.config.queue.clone(),
                source,
            });
        }
        info!(queue = %self.config.queue, report = ?self.report, "consumer stopped");
        Ok(self.report)
    }

    fn receive(&self, backoff: Option<Duration>) -> BoxFuture<'a, Received<T::Tag>> {
        let transport = self.transport;
        match backoff {
            None => transport.recv(),
            Some(wait) => {
                let sleep = transport.sleep(wait);
                Box::pin(async move {
                    sleep.await;
                    transport.recv().await
                })
            }
        }
    }

    fn admit(&mut self, delivery: Delivery<T::Tag>) {
        let Delivery {
            tag,
            message,
            facts,
        } = delivery;
        self.report.received += 1;
        // The run number the engine admits it at, so a delivery that never reaches a handler
        // (a crash diversion) still reports where it stood.
        let message = message.with_attempt(facts.attempts.saturating_add(1));
        let id = self.engine.handle_delivery(self.transport.now(), facts);
        let span = info_span!(
            "delivery",
            queue = %self.config.queue,
            delivery = %id,
            attempt = Empty,
            terminal = Empty,
        );
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
        self.held.insert(
            id,
            Held {
                tag,
                message,
                span,
                terminal: None,
            },
        );
    }

    /// Starts an action. Actions start in the engine's order and then run concurrently; the
    /// engine only asks to settle a delivery after its clone's confirm came back.
    fn start(&mut self, action: Action) -> Result<(), ConsumerError> {
        let (transport, handler, config) = (self.transport, self.handler, self.config);
        match action {
            Action::RunHandler { delivery, attempt } => {
                let held = self.held_mut(delivery)?;
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
                delivery,
                settlement,
                terminal,
            } => {
                let held = self.held_mut(delivery)?;
                held.terminal = Some(terminal);
                held.span.record("terminal", debug_value(&terminal));
                log_terminal(&held.span, &terminal, settlement);
                let tag = held.tag.clone();
                let span = held.span.clone();
                let pause = match terminal {
                    Terminal::Requeued { .. } if !self.config.requeue_delay.is_zero() => {
                        Some(transport.sleep(self.config.requeue_delay))
                    }
                    _ => None,
                };
                self.tasks.push(Box::pin(
                    async move {
                        if let Some(pause) = pause {
                            pause.await;
                        }
                        let result = transport.settle(&tag, settlement).await;
                        Event::Settled {
                            id: delivery,
                            result,
                        }
                    }
                    .instrument(span),
                ));
            }
        }
        Ok(())
    }

    fn finish(&mut self, event: Event) -> Result<(), ConsumerError> {
        let now = self.transport.now();
        match event {
            Event::Handled { id, run } => {
                let outcome = self.outcome(id, run);
                self.engine.handle_outcome(now, id, outcome)?;
            }
            Event::Published { id, result } => {
                if let PublishResult::Failed(e) = &result {
                    warn!(parent: &self.span(id), error = %e, "publishing the clone failed");
                }
                self.engine.handle_confirm(now, id, result.confirm())?;
            }
            Event::Settled { id, result } => {
                let held = self
                    .held
                    .remove(&id)
                    .ok_or(EngineError::UnknownDelivery(id))?;
                match (result, held.terminal) {
                    (Ok(()), Some(terminal)) => {
                        self.report.count(&terminal);
                        if let Some(observer) = self.observer {
                            observer(&held.message, &terminal);
                        }
                    }
                    (Ok(()), None) => {}
                    (Err(e), _) => {
                        self.report.settle_errors += 1;
                        warn!(
                            parent: &held.span,
                            error = %e,
                            "settling failed; the broker will redeliver",
                        );
                    }
                }
            }
            Event::Cancelled(Err(e)) => {
                warn!(queue = %self.config.queue, error = %e, "stopping the consumer failed");
            }
            Event::Cancelled(Ok(())) => {}
        }
        Ok(())
    }

    fn outcome(&mut self, id: DeliveryId, run: HandlerRun) -> Outcome {
        let span = self.span(id);
        match run {
            HandlerRun::Finished(Ok(())) => Outcome::Success,
            HandlerRun::Finished(Err(e)) => {
                debug!(parent: &span, error = %e, kind = ?e.kind(), "handler failed");
                e.to_outcome()
            }
            HandlerRun::Panicked(cause) => {
                self.report.handler_panics += 1;
                warn!(parent: &span, cause = %cause, "handler panicked");
                Outcome::Transient(cause)
            }
            HandlerRun::TimedOut => {
                self.report.handler_timeouts += 1;
                let cause = format!(
                    "handler timed out after {}",
                    format_delay(self.config.handler_timeout)
                );
                warn!(parent: &span, "{cause}; it was cancelled");
                Outcome::Transient(cause)
            }
        }
    }

    /// The shutdown grace is over: whatever is still held goes back to the broker unsettled,
    /// and the work still running for it is dropped with the loop.
    fn abandon_held(&mut self) {
        for (id, held) in self.held.drain() {
            self.engine.forget(id);
            self.report.left_unsettled += 1;
            warn!(
                parent: &held.span,
                "shutdown grace over: left unsettled for the broker to redeliver",
            );
        }
    }

    fn held_mut(&mut self, id: DeliveryId) -> Result<&mut Held<T::Tag>, EngineError> {
        self.held
            .get_mut(&id)
            .ok_or(EngineError::UnknownDelivery(id))
    }

    fn span(&self, id: DeliveryId) -> Span {
        self.held
            .get(&id)
            .map_or_else(Span::none, |held| held.span.clone())
    }
}

/// Runs the handler once, catching a panic and cancelling it at the timeout. The call itself
/// happens inside the caught future, so a handler that panics before its first await is
/// caught too.
async fn run_handler<T: Transport, H: Handler>(
    transport: &T,
    handler: &H,
    msg: Message,
    timeout: Duration,
) -> HandlerRun {
    let run = AssertUnwindSafe(async { handler.handle(&msg).await }).catch_unwind();
    let expired = transport.sleep(timeout);
    match future::select(pin!(run), expired).await {
        Either::Left((Ok(result), _)) => HandlerRun::Finished(result),
        Either::Left((Err(payload), _)) => HandlerRun::Panicked(panic_message(payload.as_ref())),
        Either::Right(((), _)) => HandlerRun::TimedOut,
    }
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
        Terminal::Diverted { crashes, delay } => {
            warn!(
                parent: span,
                crashes,
                delay = %format_delay(delay),
                "crashed delivery diverted through a delay without running the handler",
            );
        }
        Terminal::DeadLettered { reason } => {
            warn!(parent: span, reason = %reason, "parked in the dead-letter queue");
        }
        Terminal::Dropped { reason } => {
            warn!(parent: span, reason = %reason, "dropped, as the policy allows");
        }
        Terminal::Requeued { cause } => {
            warn!(parent: span, ?cause, "the clone was not confirmed; requeueing the original");
        }
    }
}
