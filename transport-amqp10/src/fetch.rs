//! The fetch link of one queue: takes at most one message per fetch, for
//! [`Transport::fetch`](retry_core::Transport::fetch) and for a walk of the queue
//! ([`Transport::walk`](retry_core::Transport::walk)), which holds every message it leaves
//! unsettled on the link until it closes it.
//!
//! A task owns a connection of its own and, on it, a session with one receiver in manual
//! credit. A fetch grants a credit of exactly 1 and waits for the transfer. If none comes
//! within the fetch wait, the credit is taken back by detaching the link and ending its
//! session; the next fetch attaches a new one. After a fetch that got a message the link
//! stays attached, with no credit left, so a run of suspects costs one grant each.
//!
//! Why not a drain: measured on RabbitMQ 3.10.8, a `flow` with `drain = true` that finds a
//! classic queue empty ends the session with `amqp:internal-error` (a `function_clause` in
//! `rabbit_classic_queue:handle_event` on `send_drained`, 3 to 8 ms after the flow, every
//! time); on a quorum queue the drain is answered within 3 ms, but a later grant on that
//! link delivered nothing within 3 s. fe2o3 0.18 does not surface the peer's `flow` to the application either,
//! so an answered drain could not be told from one still under way.
//!
//! Why not a flow with credit 0: sent while a transfer is on its way or unread, it carries a
//! delivery count that misses that transfer, and RabbitMQ 3.10 computes the new credit as
//! 0 − 1 (its answer said 255). The crossing transfer is refused by fe2o3 once the local
//! credit is 0 (`TransferLimitExceeded`), with no way left to settle it. And the broker
//! echoes every `flow` with its delivery count, which fe2o3 writes over the link's even while
//! a transfer it includes waits unread, then counts that transfer again when it is read: the
//! next grant is then one too many. Detaching takes the credit back without any of this: a
//! message that crosses the detach stays unsettled on the session, ending the session puts
//! it back, and it comes back with `first-acquirer = false`.
//! That is the one cost: a message dispatched in the last few milliseconds before the broker
//! handles the detach, too late for the last look, is counted as redelivered once. Measured
//! with fetches back to back and a message every 23 ms on average: 22 of 177 empty fetches
//! did that, a window of about 3 ms per empty fetch (a consumer makes one per suspect poll).
//! The detach is awaited before the fetch answers: a message published after `Ok(None)` is
//! never caught. Granting only on a link with no credit and nothing on the way is what keeps
//! the echo harmless everywhere else.

use std::collections::BTreeSet;
use std::time::Duration;

use fe2o3_amqp::Receiver;
use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::Body;
use fe2o3_amqp::types::primitives::Value;
use futures::FutureExt;
use retry_core::{Delivery, DeliveryFacts, Message, Settlement, TransportError};
use tokio::sync::{mpsc, oneshot};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::codec::read_message;
use crate::config::{Amqp10Config, Nodes};
use crate::connection::{self, end_session};
use crate::profile::BrokerProfile;
use crate::receiver::{
    Amqp10Tag, Command, Fetched, already_settled, attach_receiver, dispose, stale,
};

/// Starts the task of a fetch link on `queue`. Nothing is opened until the first fetch.
pub(crate) fn spawn(nodes: &Nodes, config: &Amqp10Config, queue: &str) -> mpsc::Sender<Command> {
    let (commands, command_rx) = mpsc::channel(16);
    let task = FetchTask {
        nodes: nodes.clone(),
        config: config.clone(),
        profile: config.profile(),
        queue: queue.to_owned(),
        connection: None,
        link: None,
        held: BTreeSet::new(),
        unclaimed: None,
        generation: 0,
        attachments: 0,
        own: commands.downgrade(),
    };
    tokio::spawn(task.run(command_rx));
    commands
}

struct FetchTask {
    nodes: Nodes,
    config: Amqp10Config,
    profile: BrokerProfile,
    queue: String,
    connection: Option<ConnectionHandle<()>>,
    /// The attached link. Its credit is 0 on both ends whenever it is kept between fetches.
    link: Option<(SessionHandle<()>, Receiver)>,
    /// The delivery ids handed out and not yet settled on the attached link. A consumer
    /// holds at most one; a walk of a parking queue holds every message it leaves, until
    /// it puts them back.
    held: BTreeSet<u32>,
    /// The held delivery, when the fetch that took it was abandoned before the answer. Kept
    /// without its tag, whose sender would keep this task alive.
    unclaimed: Option<(DeliveryInfo, Message, DeliveryFacts)>,
    /// The attachment `link` is, counted from 0.
    generation: u64,
    attachments: u64,
    /// For tags; weak, so that the task ends once the transport and every tag are gone.
    own: mpsc::WeakSender<Command>,
}

impl FetchTask {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        let mut close_done = None;
        while let Some(command) = commands.recv().await {
            match command {
                Command::Fetch { done } => {
                    let fetched = self.fetch().await;
                    if let Err(Ok(Some(delivery))) = done.send(fetched) {
                        // The caller gave up waiting. Releasing it would mark it
                        // redelivered, which would count a crash: the next fetch gets it.
                        let Delivery {
                            tag,
                            message,
                            facts,
                        } = delivery;
                        self.unclaimed = Some((tag.info, message, facts));
                    }
                }
                Command::Settle {
                    info,
                    generation,
                    settlement,
                    done,
                } => {
                    let result = self.settle(&info, generation, settlement).await;
                    let _ = done.send(result);
                }
                // Nothing is batched and nothing flows unasked.
                Command::Flush { done } | Command::Cancel { done } => {
                    let _ = done.send(());
                }
                Command::Close { done } => {
                    close_done = Some(done);
                    break;
                }
            }
        }
        self.shut_down().await;
        if let Some(done) = close_done {
            let _ = done.send(());
        }
    }

    async fn fetch(&mut self) -> Fetched {
        if let Some((info, message, facts)) = self.unclaimed.take() {
            let Some(link) = self.own.upgrade() else {
                return Err(TransportError::Closed);
            };
            let tag = Amqp10Tag {
                link,
                info,
                generation: self.generation,
            };
            return Ok(Some(Delivery {
                tag,
                message,
                facts,
            }));
        }
        let after = self.config.operation_timeout();
        let wait = self.config.fetch_wait().min(after);
        self.grant().await?;
        let Some((_, receiver)) = self.link.as_mut() else {
            return Err(TransportError::Closed);
        };
        match timeout(wait, receiver.recv::<Body<Value>>()).await {
            Ok(Ok(delivery)) => self.hand_out(delivery),
            Ok(Err(e)) => Err(self.lost(e)),
            Err(_) => {
                // A transfer that arrived just as the wait ended is still within the credit.
                match receiver.recv::<Body<Value>>().now_or_never() {
                    Some(Ok(delivery)) => self.hand_out(delivery),
                    Some(Err(e)) => Err(self.lost(e)),
                    None => {
                        self.take_back().await;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Grants a credit of 1 on a link that has none. A link that died while idle had nothing
    /// granted and holds nothing: it is replaced, once, without an error.
    async fn grant(&mut self) -> Result<(), TransportError> {
        let after = self.config.operation_timeout();
        let mut replaced = false;
        loop {
            self.attach().await?;
            let Some((_, receiver)) = self.link.as_mut() else {
                return Err(TransportError::Closed);
            };
            let failure = match timeout(after, receiver.set_credit(1)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => TransportError::connection_failed(
                    format!("granting credit on {}", self.queue),
                    e,
                ),
                Err(_) => TransportError::Timeout {
                    operation: "granting credit",
                    after,
                },
            };
            self.discard();
            if replaced {
                return Err(failure);
            }
            debug!(queue = %self.queue, error = %failure, "the idle fetch link is gone; attaching a new one");
            replaced = true;
        }
    }

    /// Makes sure a link is attached, on a new connection if the last one is gone.
    async fn attach(&mut self) -> Result<(), TransportError> {
        if self
            .link
            .as_ref()
            .is_some_and(|(session, _)| !session.is_ended())
        {
            return Ok(());
        }
        self.discard();
        if self.connection.as_ref().is_none_or(|c| c.is_closed()) {
            self.connection = None;
            self.connection = Some(connection::open(&self.nodes, &self.config, "fetcher").await?);
        }
        let Some(connection) = self.connection.as_mut() else {
            return Err(TransportError::Closed);
        };
        let after = self.config.operation_timeout();
        let attached = timeout(
            after,
            attach_receiver(connection, "fetcher", &self.queue, &self.profile),
        )
        .await;
        match attached {
            Ok(Ok(link)) => {
                self.generation = self.attachments;
                self.attachments += 1;
                self.link = Some(link);
                debug!(queue = %self.queue, generation = self.generation, "fetch link attached");
                Ok(())
            }
            // The refusal ended only that session: the connection stays for the next try.
            Ok(Err(e @ TransportError::MissingAddress { .. })) => Err(e),
            Ok(Err(e)) => {
                self.close_connection().await;
                Err(e)
            }
            Err(_) => {
                self.close_connection().await;
                Err(TransportError::Timeout {
                    operation: "attaching a fetch link",
                    after,
                })
            }
        }
    }

    fn hand_out(&mut self, delivery: fe2o3_amqp::link::delivery::Delivery<Body<Value>>) -> Fetched {
        let Some(link) = self.own.upgrade() else {
            // Nobody can settle it: the link ends with the task and the broker takes it back.
            return Err(TransportError::Closed);
        };
        let (info, message) = delivery.into_parts();
        self.held.insert(info.delivery_id());
        let tag = Amqp10Tag {
            link,
            info,
            generation: self.generation,
        };
        Ok(Some(read_message(message, &self.queue, &self.profile, tag)))
    }

    /// Settles one delivery held, at once.
    async fn settle(
        &mut self,
        info: &DeliveryInfo,
        generation: u64,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        if generation != self.generation || self.link.is_none() {
            return Err(stale(info));
        }
        if !self.held.remove(&info.delivery_id()) {
            return Err(already_settled(info));
        }
        let Some((_, receiver)) = self.link.as_ref() else {
            return Err(stale(info));
        };
        let after = self.config.operation_timeout();
        let settled = match timeout(
            after,
            dispose(receiver, &self.profile, info.clone(), settlement),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(TransportError::Timeout {
                operation: "settling a fetched delivery",
                after,
            }),
        };
        if let Err(e) = &settled {
            // Whether the broker saw it is unknown; a new link starts clean.
            warn!(queue = %self.queue, error = %e, "settling a fetched delivery failed; dropping the fetch link");
            self.discard();
        }
        settled
    }

    /// The link broke while fetching: whatever it held goes back to the queue with it.
    fn lost(&mut self, e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
        warn!(queue = %self.queue, error = &e as &dyn std::error::Error, "fetch link lost");
        self.discard();
        TransportError::connection_failed(format!("fetching from {}", self.queue), e)
    }

    /// Takes the credit of an unanswered grant back: detach, and wait for the broker's
    /// answer, after which it sends nothing more on the link. Then end the session, so that
    /// a message that crossed the detach goes back to the queue instead of staying unsettled
    /// on a live session; that part runs in the background, as nothing waits on it and
    /// RabbitMQ 3.10 now and then never answers an `end`.
    async fn take_back(&mut self) {
        // Deliveries still held go back with the session.
        self.held.clear();
        if let Some((mut session, receiver)) = self.link.take() {
            let after = self.config.operation_timeout();
            let _ = timeout(after, receiver.detach()).await;
            tokio::spawn(async move { end_session(&mut session).await });
        }
    }

    /// Drops a link that failed, with its session, in the background; the next fetch
    /// attaches a new one.
    fn discard(&mut self) {
        self.held.clear();
        self.unclaimed = None;
        if let Some((mut session, receiver)) = self.link.take() {
            let after = self.config.operation_timeout();
            tokio::spawn(async move {
                let _ = timeout(after, receiver.detach()).await;
                end_session(&mut session).await;
            });
        }
    }

    async fn close_connection(&mut self) {
        if let Some(mut connection) = self.connection.take() {
            let _ = timeout(self.config.operation_timeout(), connection.close()).await;
        }
    }

    /// Detach, never close: closing a link misbehaves on RabbitMQ 3.10. A delivery still held
    /// goes back to the queue, redelivered.
    async fn shut_down(mut self) {
        let after = self.config.operation_timeout();
        if let Some((mut session, receiver)) = self.link.take() {
            let _ = timeout(after, async {
                let _ = receiver.detach().await;
                end_session(&mut session).await;
            })
            .await;
        }
        self.close_connection().await;
        info!(queue = %self.queue, "fetch link closed");
    }
}

/// Asks the fetch link task `link` for one message, and waits for its answer.
pub(crate) async fn ask(link: &mpsc::Sender<Command>, config: &Amqp10Config) -> Fetched {
    let (done, answer) = oneshot::channel();
    link.send(Command::Fetch { done })
        .await
        .map_err(|_| TransportError::Closed)?;
    let after = answer_within(config);
    match timeout(after, answer).await {
        Ok(Ok(fetched)) => fetched,
        Ok(Err(_)) => Err(TransportError::Closed),
        Err(_) => Err(TransportError::Timeout {
            operation: "fetching a message",
            after,
        }),
    }
}

/// Closes the fetch link task `link`: detaches its link and closes its connection, which
/// puts back every delivery it still holds. Waits at most `after` for it.
pub(crate) async fn close(link: &mpsc::Sender<Command>, after: Duration) {
    let (done, closed) = oneshot::channel();
    if link.send(Command::Close { done }).await.is_ok() {
        let _ = timeout(after, closed).await;
    }
}

/// How long the transport waits for a fetch link to answer: every step the task takes is
/// bounded already (two attachments at most, each a connection and a session, the grant and
/// the wait); this only guards against a task that stopped answering.
pub(crate) fn answer_within(config: &Amqp10Config) -> Duration {
    let after = config.operation_timeout();
    let attachment = config
        .connect_timeout()
        .saturating_add(after.saturating_mul(3));
    attachment
        .saturating_mul(2)
        .saturating_add(config.fetch_wait().min(after))
}
