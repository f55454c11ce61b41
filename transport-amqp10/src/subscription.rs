//! `Amqp10Subscription`: one consuming link, made by
//! [`Transport::consume`](retry_core::Transport::consume).

use std::sync::Arc;

use async_trait::async_trait;
use retry_core::{Delivery, Subscription, TransportError};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio::time::timeout;
use tracing::info;

use crate::receiver::{self, Amqp10Tag, Command, Incoming, Link};
use crate::shared::Shared;

/// A subscription to one queue over AMQP 1.0, made by
/// [`consume`](retry_core::Transport::consume) on an
/// [`Amqp10Transport`](crate::Amqp10Transport).
///
/// It owns its link: a connection of its own with one receiver in manual credit, never more
/// than `prefetch` deliveries unsettled. Subscriptions of one transport share nothing but the
/// transport's publisher: each has its own credit, and settling a delivery of one never
/// touches another's. Deliveries are settled with
/// [`Transport::settle`](retry_core::Transport::settle), which the delivery's
/// [`Amqp10Tag`] routes to this link.
///
/// A lost link is reported once by [`recv`](Subscription::recv) as
/// [`TransportError::Connection`]; the next `recv` attaches a new link (deliveries held on the
/// lost one are back in the queue, redelivered). [`cancel`](Subscription::cancel) stops the
/// flow and keeps the link so that held deliveries can still be settled;
/// [`Amqp10Transport::close`](crate::Amqp10Transport::close) detaches it.
///
/// ```no_run
/// use retry_core::{Settlement, Subscription, Transport};
/// use transport_amqp10::{Amqp10Config, Amqp10Transport};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
/// let comments = transport.consume("comments", 20).await?;
/// let audit = transport.consume("audit", 1).await?;
/// if let Some(delivery) = comments.recv().await? {
///     // Reaches the link of `comments` only.
///     transport.settle(&delivery.tag, Settlement::Ack).await?;
/// }
/// audit.cancel().await?;
/// comments.cancel().await?;
/// transport.close().await;
/// # Ok(())
/// # }
/// ```
pub struct Amqp10Subscription {
    shared: Arc<Shared>,
    queue: String,
    prefetch: u16,
    state: std::sync::Mutex<State>,
    incoming: Mutex<Option<mpsc::Receiver<Incoming>>>,
}

#[derive(Default)]
struct State {
    /// The current link's task.
    commands: Option<mpsc::Sender<Command>>,
    /// The next link's generation.
    generation: u64,
    cancelled: bool,
    /// Every delivery the link handed over before the cancel has been received.
    drained: bool,
}

impl Amqp10Subscription {
    /// Attaches the first link, so that a missing queue is reported by `consume`.
    pub(crate) async fn start(
        shared: Arc<Shared>,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self, TransportError> {
        let subscription = Amqp10Subscription {
            shared,
            queue: queue.to_owned(),
            prefetch,
            state: std::sync::Mutex::new(State::default()),
            incoming: Mutex::new(None),
        };
        let incoming = subscription.attach().await?;
        *subscription.incoming.lock().await = Some(incoming);
        Ok(subscription)
    }

    /// The queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The most deliveries held unsettled at once.
    pub fn prefetch(&self) -> u16 {
        self.prefetch
    }

    async fn attach(&self) -> Result<mpsc::Receiver<Incoming>, TransportError> {
        let generation = {
            let mut state = self.lock_state()?;
            let generation = state.generation;
            state.generation += 1;
            generation
        };
        let Link { commands, incoming } = receiver::start(
            &self.shared.nodes,
            &self.shared.config,
            &self.queue,
            self.prefetch,
            generation,
            self.shared.take_ahead(&self.queue),
        )
        .await?;
        if !self.shared.register(&commands) {
            // Closed while attaching.
            let (done, closed) = oneshot::channel();
            if commands.send(Command::Close { done }).await.is_ok() {
                let _ = timeout(self.shared.config.operation_timeout(), closed).await;
            }
            return Err(TransportError::Closed);
        }
        self.lock_state()?.commands = Some(commands);
        info!(queue = %self.queue, prefetch = self.prefetch, generation, "consuming");
        Ok(incoming)
    }

    fn lock_state(&self) -> Result<std::sync::MutexGuard<'_, State>, TransportError> {
        self.state
            .lock()
            .map_err(|_| TransportError::Other("subscription state poisoned".into()))
    }

    /// Cancelled, or its transport closed: no more deliveries, and no new link.
    fn stopped(&self) -> bool {
        self.shared.is_closed() || self.state.lock().map(|s| s.cancelled).unwrap_or(true)
    }

    fn commands(&self) -> Option<mpsc::Sender<Command>> {
        self.state.lock().ok().and_then(|s| s.commands.clone())
    }
}

impl std::fmt::Debug for Amqp10Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp10Subscription")
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Subscription for Amqp10Subscription {
    type Tag = Amqp10Tag;

    /// After a cancel, the deliveries the link handed over before it still come, and those
    /// the broker's last flow said it would still send on the credit it had, then
    /// `Ok(None)`: a consumer that stops can run what it was given rather than send it back
    /// redelivered.
    async fn recv(&self) -> Result<Option<Delivery<Amqp10Tag>>, TransportError> {
        if self.shared.is_closed() {
            return Ok(None);
        }
        // Held across the attachment, so that concurrent calls attach one link, not two.
        let mut incoming = self.incoming.lock().await;
        {
            let state = self.lock_state()?;
            if state.cancelled && (state.drained || incoming.is_none()) {
                return Ok(None);
            }
        }
        if incoming.is_none() {
            // Boxed, as a rare path: the future of every receive would carry it otherwise.
            *incoming = Some(Box::pin(self.attach()).await?);
        }
        let Some(rx) = incoming.as_mut() else {
            return Err(TransportError::Closed);
        };
        match rx.recv().await {
            Some(Incoming::Delivery(d)) => Ok(Some(*d)),
            Some(Incoming::Cancelled) => {
                // The link stays attached: what was received can still be settled.
                self.lock_state()?.drained = true;
                Ok(None)
            }
            Some(Incoming::Lost(e)) => {
                *incoming = None;
                Err(e)
            }
            None if self.stopped() => Ok(None),
            None => {
                *incoming = None;
                Err(TransportError::connection_lost(format!(
                    "the link consuming {} stopped",
                    self.queue
                )))
            }
        }
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        let commands = {
            let mut state = self.lock_state()?;
            state.cancelled = true;
            state.commands.clone()
        };
        if let Some(commands) = commands {
            let (done, cancelled) = oneshot::channel();
            if commands.send(Command::Cancel { done }).await.is_ok() {
                let _ = timeout(self.shared.config.operation_timeout(), cancelled).await;
            }
        }
        Ok(())
    }

    /// AMQP 1.0 settles each delivery when asked, so there is nothing batched: this returns
    /// once every settle sent before it has been handed to the link.
    async fn flush(&self) -> Result<(), TransportError> {
        let after = self.shared.config.operation_timeout();
        let gone = || {
            TransportError::connection_lost(format!(
                "the link consuming {} is gone; the broker puts back what it did not see settled",
                self.queue
            ))
        };
        let Some(commands) = self.commands() else {
            return Err(gone());
        };
        let (done, flushed) = oneshot::channel();
        if commands.send(Command::Flush { done }).await.is_err() {
            // Closed by the transport after every settle it was sent.
            return if self.shared.is_closed() {
                Ok(())
            } else {
                Err(gone())
            };
        }
        match timeout(after, flushed).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) if self.shared.is_closed() => Ok(()),
            Ok(Err(_)) => Err(gone()),
            Err(_) => Err(TransportError::Timeout {
                operation: "flushing settlements",
                after,
            }),
        }
    }
}
