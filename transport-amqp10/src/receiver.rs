//! The consuming link of a subscription: a task that owns the receiver, hands deliveries out
//! and settles them, keeping the link's credit so that no more than `prefetch` deliveries are
//! ever held. Also the tag and the commands every link task (this one and the fetch link's)
//! understands.
//!
//! One task owns the link because receiving and settling both need it, and settling must
//! also adjust the credit. Credit is manual: fe2o3's automatic mode refills to the full amount
//! once half is settled, which would let more than `prefetch` deliveries be unsettled.

use std::collections::HashSet;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::link::{MessageDecodeError, RecvError};
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{self, AmqpError};
use fe2o3_amqp::types::messaging::{Body, Modified};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Receiver, Session};
use retry_core::{Delivery, Settlement, TransportError};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tracing::{debug, warn};

use crate::codec::read_message;
use crate::config::{Amqp10Config, Nodes};
use crate::connection::{self, ProbeError, classify_receiver, end_session, link_name};
use crate::profile::BrokerProfile;
use crate::tap::{FlowSeen, Tap};

/// The handle that settles one delivery of an [`Amqp10Transport`](crate::Amqp10Transport),
/// received by an [`Amqp10Subscription`](crate::Amqp10Subscription) or taken by
/// [`fetch`](retry_core::Transport::fetch).
///
/// It names the link that received the delivery: after a reconnection, a tag of the old link
/// can no longer settle (the broker has already put its delivery back in the queue), and a
/// tag of one subscription never settles a delivery of another.
#[derive(Clone, Debug)]
pub struct Amqp10Tag {
    pub(crate) link: mpsc::Sender<Command>,
    pub(crate) info: DeliveryInfo,
    pub(crate) generation: u64,
}

impl Amqp10Tag {
    /// Which link of its subscription (or of its queue's fetch link) received the delivery,
    /// counted from 0 and incremented by every new attachment.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The delivery id the broker gave the transfer.
    pub fn delivery_id(&self) -> u32 {
        self.info.delivery_id()
    }
}

/// What a link task is asked to do. Commands are handled one at a time, in order.
pub(crate) enum Command {
    Settle {
        info: DeliveryInfo,
        /// The attachment the tag came from: delivery ids start again on every new session.
        generation: u64,
        settlement: Settlement,
        done: oneshot::Sender<Result<(), TransportError>>,
    },
    /// Stop the flow of deliveries but keep the link, so held ones can still be settled.
    Cancel { done: oneshot::Sender<()> },
    /// Answered once every command sent before it has been handled.
    Flush { done: oneshot::Sender<()> },
    /// Take at most one message (fetch links only).
    Fetch { done: oneshot::Sender<Fetched> },
    /// How many messages the queue has ready, taking none; `None` where it cannot be told
    /// (fetch links only).
    Count {
        done: oneshot::Sender<Result<Option<u32>, TransportError>>,
    },
    /// Detach and close.
    Close { done: oneshot::Sender<()> },
}

/// What a fetch answers.
pub(crate) type Fetched = Result<Option<Delivery<Amqp10Tag>>, TransportError>;

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Settle { .. } => "Settle",
            Command::Cancel { .. } => "Cancel",
            Command::Flush { .. } => "Flush",
            Command::Fetch { .. } => "Fetch",
            Command::Count { .. } => "Count",
            Command::Close { .. } => "Close",
        })
    }
}

/// What the link task hands to [`recv`](retry_core::Subscription::recv).
pub(crate) enum Incoming {
    Delivery(Box<Delivery<Amqp10Tag>>),
    /// The link is gone; the consumer may attach again.
    Lost(TransportError),
    /// Cancelled: no more deliveries.
    Cancelled,
}

/// Begins a session on `connection` and attaches a receiver on `queue` to it, in manual
/// credit with none granted. A missing queue is [`TransportError::MissingAddress`], and
/// ends only that session.
pub(crate) async fn attach_receiver(
    connection: &mut ConnectionHandle<()>,
    role: &str,
    queue: &str,
    profile: &BrokerProfile,
) -> Result<(SessionHandle<()>, Receiver), TransportError> {
    let address = profile.queue_address(queue);
    let mut session = Session::begin(connection).await.map_err(|e| {
        TransportError::connection_failed(format!("beginning a session to consume {queue}"), e)
    })?;
    let receiver = Receiver::builder()
        .name(link_name(role))
        .source(address.as_str())
        .credit_mode(CreditMode::Manual)
        .attach(&mut session)
        .await
        .map_err(|e| match classify_receiver(e) {
            ProbeError::Missing(why) => TransportError::MissingAddress {
                address,
                hint: format!("{why}; {}", crate::profile::provision_hint(profile)),
            },
            ProbeError::Failed(e) => e,
        })?;
    Ok((session, receiver))
}

/// A running consuming link.
pub(crate) struct Link {
    pub(crate) commands: mpsc::Sender<Command>,
    pub(crate) incoming: mpsc::Receiver<Incoming>,
}

/// Opens a connection, attaches a receiver on `queue` and starts its task.
pub(crate) async fn start(
    nodes: &Nodes,
    config: &Amqp10Config,
    queue: &str,
    prefetch: u16,
    generation: u64,
) -> Result<Link, TransportError> {
    let profile = config.profile();
    let after = config.operation_timeout();
    let (mut connection, tap) = connection::open(nodes, config, "consumer").await?;
    let attached = timeout(
        after,
        attach_receiver(&mut connection, "consumer", queue, &profile),
    )
    .await;
    let (session, mut receiver) = match attached {
        Ok(Ok(parts)) => parts,
        Ok(Err(e)) => {
            let _ = timeout(after, connection.close()).await;
            return Err(e);
        }
        Err(_) => {
            let _ = timeout(after, connection.close()).await;
            return Err(TransportError::Timeout {
                operation: "attaching the consumer",
                after,
            });
        }
    };
    let credit = u32::from(prefetch);
    let flows = tap.flows();
    let granted_at = flows.borrow().seq;
    if let Err(e) = receiver.set_credit(credit).await {
        return Err(TransportError::connection_failed(
            format!("granting credit to consume {queue}"),
            e,
        ));
    }
    let (commands, command_rx) = mpsc::channel(usize::from(prefetch).max(16));
    // Credit bounds what is undelivered in the channel to `prefetch`, plus one final marker.
    let (incoming_tx, incoming) = mpsc::channel(usize::from(prefetch) + 2);
    let task = LinkTask {
        connection,
        session,
        receiver,
        queue: queue.to_owned(),
        profile,
        prefetch: credit,
        credit,
        held: HashSet::new(),
        cancelled: None,
        ended: false,
        received: 0,
        granted_at,
        flows,
        generation,
        own: commands.downgrade(),
        settle_timeout: after,
        tap,
    };
    tokio::spawn(task.run(command_rx, incoming_tx));
    Ok(Link { commands, incoming })
}

struct LinkTask {
    connection: ConnectionHandle<()>,
    session: SessionHandle<()>,
    receiver: Receiver,
    queue: String,
    profile: BrokerProfile,
    prefetch: u32,
    /// The credit the broker has left, as far as this side knows.
    credit: u32,
    /// Delivery ids handed out and not yet settled.
    held: HashSet<u32>,
    /// Once cancelled: until when what the credit still brings is waited for.
    cancelled: Option<Instant>,
    /// The consumer was told it has everything ([`Incoming::Cancelled`]).
    ended: bool,
    /// Transfers taken in on the link (the connection's only one), as the tap counts them.
    received: u64,
    /// The tap's count of broker flows before the last grant of credit.
    granted_at: u64,
    flows: watch::Receiver<FlowSeen>,
    generation: u64,
    /// For tags; weak, so that the task ends once the transport and every tag are gone.
    own: mpsc::WeakSender<Command>,
    settle_timeout: Duration,
    tap: Tap,
}

impl LinkTask {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>, out: mpsc::Sender<Incoming>) {
        let mut close_done = None;
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(Command::Settle { info, generation, settlement, done }) => {
                        let result = if generation == self.generation {
                            self.settle(info, settlement).await
                        } else {
                            Err(stale(&info))
                        };
                        let _ = done.send(result);
                    }
                    Some(Command::Cancel { done }) => {
                        self.cancel();
                        self.end_if_nothing_owed(&out);
                        let _ = done.send(());
                    }
                    // Settling is never batched here: every settle before this is sent.
                    Some(Command::Flush { done }) => {
                        let _ = done.send(());
                    }
                    Some(Command::Count { done }) => {
                        let _ = done.send(Ok(None));
                    }
                    Some(Command::Fetch { done }) => {
                        let _ = done.send(Err(TransportError::Other(
                            "a subscription's link does not fetch".into(),
                        )));
                    }
                    Some(Command::Close { done }) => {
                        close_done = Some(done);
                        break;
                    }
                    None => break,
                },
                // The broker's answer to the last grant, awaited after a cancel.
                _ = self.flows.changed(), if self.cancelled.is_some() && !self.ended => {
                    self.end_if_nothing_owed(&out);
                }
                _ = sleep_until(self.cancelled.unwrap_or_else(Instant::now)), if self.cancelled.is_some() && !self.ended => {
                    debug!(queue = %self.queue, "the credit's last transfers did not come; consuming ends");
                    self.end(&out);
                }
                received = self.receiver.recv::<Body<Value>>() => match received {
                    Ok(delivery) => {
                        self.credit = self.credit.saturating_sub(1);
                        self.received += 1;
                        if self.ended {
                            // Sent on credit the broker still had once the consumer was told
                            // it had everything (a message published after the cancel onto an
                            // empty queue): back to the queue for other consumers.
                            let _ = self.receiver.release(&delivery).await;
                            continue;
                        }
                        let Some(tag_link) = self.own.upgrade() else { break };
                        let (info, message) = delivery.into_parts();
                        self.held.insert(info.delivery_id());
                        let tag = Amqp10Tag { link: tag_link, info, generation: self.generation };
                        let delivery = read_message(message, &self.queue, &self.profile, tag);
                        if out.send(Incoming::Delivery(Box::new(delivery))).await.is_err() {
                            break;
                        }
                        if self.cancelled.is_some() {
                            self.end_if_nothing_owed(&out);
                        }
                        if let Err(e) = self.refill().await {
                            let _ = out.try_send(Incoming::Lost(e));
                            break;
                        }
                    }
                    Err(RecvError::MessageDecode(undecodable)) => {
                        // It used the credit; the link carries on.
                        self.credit = self.credit.saturating_sub(1);
                        self.received += 1;
                        if self.cancelled.is_some() {
                            self.end_if_nothing_owed(&out);
                        }
                        let settled = reject_undecodable(
                            &self.receiver,
                            &self.tap,
                            &self.queue,
                            undecodable,
                        )
                        .await;
                        if let Err(e) = match settled {
                            Ok(()) => self.refill().await,
                            Err(e) => Err(e),
                        } {
                            let _ = out.try_send(Incoming::Lost(e));
                            break;
                        }
                    }
                    Err(e) => {
                        warn!(queue = %self.queue, error = %e, "consuming link lost");
                        let lost = TransportError::connection_failed(format!("consuming {}", self.queue), e);
                        let _ = out.try_send(Incoming::Lost(lost));
                        break;
                    }
                },
            }
        }
        self.shut_down().await;
        if let Some(done) = close_done {
            let _ = done.send(());
        }
    }

    async fn settle(
        &mut self,
        info: DeliveryInfo,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        if !self.held.remove(&info.delivery_id()) {
            return Err(already_settled(&info));
        }
        dispose(&self.receiver, &self.profile, info, settlement).await?;
        self.refill().await
    }

    /// Grants `prefetch - held` once the previous grant is used up, never earlier.
    ///
    /// RabbitMQ 3.10 applies a flow's link-credit as new credit without subtracting transfers
    /// already on the way, and fe2o3 tears the link down (`TransferLimitExceeded`) on a
    /// transfer beyond the credit it granted. Once this side has counted the whole grant in,
    /// nothing can be on the way, so a new grant cannot be overrun.
    async fn refill(&mut self) -> Result<(), TransportError> {
        if self.cancelled.is_some() || self.credit > 0 {
            return Ok(());
        }
        let held = u32::try_from(self.held.len()).unwrap_or(u32::MAX);
        let target = self.prefetch.saturating_sub(held);
        if target > 0 {
            self.granted_at = self.flows.borrow().seq;
            timeout(self.settle_timeout, self.receiver.set_credit(target))
                .await
                .map_err(|_| TransportError::Timeout {
                    operation: "granting credit",
                    after: self.settle_timeout,
                })?
                .map_err(|e| TransportError::connection_failed("granting credit", e))?;
            self.credit = target;
        }
        Ok(())
    }

    /// Stops granting credit. The credit is not taken back: fe2o3 counts a transfer the
    /// broker sent before it saw a lowered credit as a violation and tears the link down, and
    /// the held deliveries could then no longer be settled. What the broker said it would
    /// send on the credit it has (see [`owed`](Self::owed)) is still handed out, so that a
    /// consumer that stops runs it instead of sending it back redelivered (RabbitMQ 3.x marks
    /// a released message redelivered); only then is the consumer told it has everything.
    fn cancel(&mut self) {
        self.cancelled = Some(Instant::now() + self.settle_timeout);
    }

    /// How many transfers the broker is still to send on the credit it has: as many as its
    /// last flow said it had credit and messages for, less those that came since. `None`
    /// while the answer to the last grant has not come; `Some(0)` where the broker does not
    /// say what it has (nothing is then waited for).
    fn owed(&self) -> Option<u64> {
        let seen = *self.flows.borrow();
        if seen.seq <= self.granted_at {
            return None;
        }
        let (Some(credit), Some(available)) = (seen.link_credit, seen.available) else {
            return Some(0);
        };
        let promised = seen.transfers_before + u64::from(credit.min(available));
        Some(promised.saturating_sub(self.received))
    }

    /// After a cancel: tells the consumer it has everything once nothing more is owed.
    fn end_if_nothing_owed(&mut self, out: &mpsc::Sender<Incoming>) {
        if self.owed() == Some(0) {
            self.end(out);
        }
    }

    fn end(&mut self, out: &mpsc::Sender<Incoming>) {
        self.ended = true;
        let _ = out.try_send(Incoming::Cancelled);
    }

    /// Detach, never close: closing a link misbehaves on RabbitMQ 3.10. Unsettled deliveries
    /// go back to the queue.
    async fn shut_down(self) {
        let LinkTask {
            mut connection,
            mut session,
            receiver,
            settle_timeout,
            ..
        } = self;
        let _ = timeout(settle_timeout, async {
            let _ = receiver.detach().await;
            end_session(&mut session).await;
            let _ = connection.close().await;
        })
        .await;
    }
}

/// Sends the disposition of one delivery. Requeue is `modified` with `delivery-failed` where
/// the broker takes it (so it counts the attempt), `released` on RabbitMQ 3.x, which ends the
/// session on `modified`.
pub(crate) async fn dispose(
    receiver: &Receiver,
    profile: &BrokerProfile,
    info: DeliveryInfo,
    settlement: Settlement,
) -> Result<(), TransportError> {
    let disposed = match settlement {
        Settlement::Ack => receiver.accept(info).await,
        Settlement::Reject => receiver.reject(info, None).await,
        Settlement::Requeue if profile.supports_modified() => {
            let modified = Modified {
                delivery_failed: Some(true),
                undeliverable_here: None,
                message_annotations: None,
            };
            receiver.modify(info, modified).await
        }
        Settlement::Requeue => receiver.release(info).await,
    };
    disposed.map_err(|e| TransportError::connection_failed("settling a delivery", e))
}

/// A message fe2o3 could not decode: either the [`Tap`] refused it (too deeply nested, or no
/// valid AMQP 1.0 encoding) and kept its bytes, or fe2o3's decoder failed on it.
pub(crate) struct Undecodable {
    pub(crate) info: DeliveryInfo,
    /// Why, to log and to put in the rejection.
    pub(crate) why: String,
    /// Its sections as they came, when the tap refused it.
    pub(crate) payload: Option<Vec<u8>>,
}

impl Undecodable {
    pub(crate) fn new(tap: &Tap, error: MessageDecodeError) -> Self {
        let MessageDecodeError { info, source } = error;
        match tap.take_refused(info.delivery_id()) {
            Some(refused) => Undecodable {
                info,
                why: refused.refusal.to_string(),
                payload: Some(refused.payload),
            },
            None => Undecodable {
                info,
                why: format!("it does not decode as an AMQP 1.0 message: {source}"),
                payload: None,
            },
        }
    }
}

/// Settles a message that cannot be decoded with `rejected`, so that the broker dead-letters
/// it: a work or isolation queue of a plan dead-letters into its parking queue. It never
/// reaches the engine, and never goes back to the queue to be received again.
pub(crate) async fn reject_undecodable(
    receiver: &Receiver,
    tap: &Tap,
    queue: &str,
    error: MessageDecodeError,
) -> Result<(), TransportError> {
    let Undecodable { info, why, .. } = Undecodable::new(tap, error);
    warn!(
        %queue,
        delivery_id = info.delivery_id(),
        %why,
        "rejecting a message that cannot be decoded: the queue dead-letters it"
    );
    let error = definitions::Error::new(
        AmqpError::DecodeError,
        format!("transport-amqp10 cannot decode this message: {why}"),
        None,
    );
    receiver
        .reject(info, error)
        .await
        .map_err(|e| TransportError::connection_failed("rejecting an undecodable message", e))
}

pub(crate) fn already_settled(info: &DeliveryInfo) -> TransportError {
    TransportError::Other(format!("delivery {} is already settled", info.delivery_id()).into())
}

/// A tag of an earlier attachment: its link is gone, and with it the delivery.
pub(crate) fn stale(info: &DeliveryInfo) -> TransportError {
    TransportError::connection_lost(format!(
        "the link that received delivery {} is gone; the broker has put it back",
        info.delivery_id()
    ))
}

/// Settles through the link task that received the delivery.
pub(crate) async fn settle(
    tag: &Amqp10Tag,
    settlement: Settlement,
    after: Duration,
) -> Result<(), TransportError> {
    let (done, answer) = oneshot::channel();
    let gone = || {
        TransportError::connection_lost(format!(
            "the link that received delivery {} is gone; the broker has put it back",
            tag.delivery_id()
        ))
    };
    let command = Command::Settle {
        info: tag.info.clone(),
        generation: tag.generation,
        settlement,
        done,
    };
    match timeout(after, async {
        tag.link.send(command).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    })
    .await
    {
        Ok(result) => result,
        Err(_) => Err(TransportError::Timeout {
            operation: "settling a delivery",
            after,
        }),
    }
}
