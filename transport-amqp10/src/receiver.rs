//! The consuming link of a subscription: a task that owns the receiver, hands deliveries out
//! and settles them, keeping the link's credit so that no more than `prefetch` deliveries are
//! ever held. Also the tag and the commands every link task (this one and the fetch link's)
//! understands.
//!
//! One task owns the link's receiver: it receives, grants credit and handles the commands.
//! Accepting and releasing (the settlements of nearly every delivery) do not pass through it:
//! a tag carries the link's [`Settler`], which sends the disposition from the caller's own
//! task with fe2o3's [`ReceiverDisposer`] and wakes the link task only when that makes a grant
//! due. The credit ledger (what is held, what credit the broker has left) is shared between
//! the two under a lock. Credit is manual: fe2o3's automatic mode refills to the full amount
//! once half is settled, which would let more than `prefetch` deliveries be unsettled.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::receiver::{CreditMode, ReceiverDisposer};
use fe2o3_amqp::link::{MessageDecodeError, RecvError};
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{self, AmqpError};
use fe2o3_amqp::types::messaging::{Body, Modified};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Receiver, Session};
use retry_core::{Delivery, Settlement, TransportError};
use tokio::sync::{Notify, RwLock, mpsc, oneshot, watch};
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
    /// A subscription's link settles most deliveries without its task (see [`Settler`]);
    /// `None` on a fetch link, whose task settles everything.
    pub(crate) settler: Option<Arc<Settler>>,
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

/// What a subscription's link task shares with the tags of its deliveries, so that accepting
/// and releasing a delivery (`Ack`, and `Requeue` on RabbitMQ 3.x) go from the settling task
/// straight to the link's session, with fe2o3's [`ReceiverDisposer`], instead of through the
/// link task as a command awaiting an answer. `Reject`, and `Requeue` as `modified`, which the
/// disposer cannot send, still go through the link task.
///
/// The credit rule does not change with it: a settlement takes its delivery off the
/// [`Ledger`] under its lock, and wakes the link task only when that makes a grant due (the
/// previous grant used up), which then grants `prefetch − held`. Only the link task grants,
/// and only once it has counted the last grant's transfers in, so nothing can be on its way
/// when it does: the broker never has more credit than `prefetch − held`.
pub(crate) struct Settler {
    disposer: ReceiverDisposer,
    /// `Requeue` is `modified` (sent by the link task), not `released`.
    modified: bool,
    ledger: Mutex<Ledger>,
    /// Wakes the link task when a settlement made a grant due. A wake-up sent while the task
    /// is busy is kept for its next wait.
    grant_due: Notify,
    /// `true` while the link is attached. Every settlement here holds it shared while it
    /// sends; the link task sets it `false`, holding it exclusively, before it detaches.
    /// So a settlement either reaches the session before the detach or fails as a stale
    /// tag's does (the broker puts the delivery back), as when settling went through the
    /// link task.
    attached: RwLock<bool>,
}

/// The credit of a subscription's link and the deliveries it has handed out.
#[derive(Debug)]
struct Ledger {
    prefetch: u32,
    /// The credit the broker has left, as far as this side knows.
    credit: u32,
    /// Delivery ids handed out and not yet settled.
    held: HashSet<u32>,
    /// No more grants.
    cancelled: bool,
}

impl Ledger {
    /// The credit to grant now: `prefetch − held`, once the previous grant is used up, never
    /// earlier; `None` when nothing is due.
    ///
    /// RabbitMQ 3.10 applies a flow's link-credit as new credit without subtracting transfers
    /// already on the way, and fe2o3 tears the link down (`TransferLimitExceeded`) on a
    /// transfer beyond the credit it granted. Once this side has counted the whole grant in,
    /// nothing can be on the way, so a new grant cannot be overrun.
    fn due(&self) -> Option<u32> {
        if self.cancelled || self.credit > 0 {
            return None;
        }
        let held = u32::try_from(self.held.len()).unwrap_or(u32::MAX);
        Some(self.prefetch.saturating_sub(held)).filter(|&target| target > 0)
    }
}

impl std::fmt::Debug for Settler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settler")
            .field("modified", &self.modified)
            .finish_non_exhaustive()
    }
}

impl Settler {
    /// The settler of a link just granted `prefetch`.
    fn new(disposer: ReceiverDisposer, profile: &BrokerProfile, prefetch: u32) -> Self {
        Settler {
            disposer,
            modified: profile.supports_modified(),
            ledger: Mutex::new(Ledger {
                prefetch,
                credit: prefetch,
                held: HashSet::new(),
                cancelled: false,
            }),
            grant_due: Notify::new(),
            attached: RwLock::new(true),
        }
    }

    /// The ledger; a lock poisoned by a panic elsewhere is still consistent (every change is
    /// one statement).
    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this settlement goes straight to the session (`true`) or through the link
    /// task.
    fn settles(&self, settlement: Settlement) -> bool {
        match settlement {
            Settlement::Ack => true,
            Settlement::Requeue => !self.modified,
            Settlement::Reject => false,
        }
    }

    /// Accepts or releases one delivery held: sends its disposition to the session from the
    /// calling task, then wakes the link task if that made a grant due.
    async fn settle(
        &self,
        info: &DeliveryInfo,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        let attached = self.attached.read().await;
        if !*attached {
            return Err(stale(info));
        }
        let grant = {
            let mut ledger = self.ledger();
            if !ledger.held.remove(&info.delivery_id()) {
                return Err(already_settled(info));
            }
            ledger.due().is_some()
        };
        let disposed = match settlement {
            Settlement::Ack => self.disposer.accept(info.clone()).await,
            _ => self.disposer.release(info.clone()).await,
        };
        drop(attached);
        disposed.map_err(|e| TransportError::connection_failed("settling a delivery", e))?;
        if grant {
            self.grant_due.notify_one();
        }
        Ok(())
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
    /// Open the connection and attach the link now, granting nothing, so that the first
    /// fetch does not wait for them (fetch links only; unanswered, a failure is the next
    /// fetch's to report).
    Attach,
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
            Command::Attach => "Attach",
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

/// A consuming link attached with no credit, not yet started: what [`open`] makes and
/// [`start`] starts.
pub(crate) struct Opened {
    connection: ConnectionHandle<()>,
    tap: Tap,
    session: SessionHandle<()>,
    receiver: Receiver,
}

/// A consuming link opened ahead of [`consume`](retry_core::Transport::consume), while the
/// consumer verifies its plan and looks at its isolation queue: connecting and attaching
/// are then off the path to the first delivery. With no credit granted nothing is delivered
/// on it, as on the receivers that verify queues. Dropped unused, it closes its connection.
pub(crate) type Ahead = oneshot::Receiver<Result<Opened, TransportError>>;

/// Starts opening a consuming link on `queue` in the background (see [`Ahead`]).
pub(crate) fn open_ahead(nodes: &Nodes, config: &Amqp10Config, queue: &str) -> Ahead {
    let (opened, ahead) = oneshot::channel();
    let (nodes, config, queue) = (nodes.clone(), config.clone(), queue.to_owned());
    tokio::spawn(async move {
        // Unwanted by then (the transport closed), it is dropped: that closes it.
        let _ = opened.send(open(&nodes, &config, &queue).await);
    });
    ahead
}

/// Opens a connection and attaches a receiver on `queue` to it, with no credit.
pub(crate) async fn open(
    nodes: &Nodes,
    config: &Amqp10Config,
    queue: &str,
) -> Result<Opened, TransportError> {
    let profile = config.profile();
    let after = config.operation_timeout();
    let (mut connection, tap) = connection::open(nodes, config, "consumer").await?;
    let attached = timeout(
        after,
        attach_receiver(&mut connection, "consumer", queue, &profile),
    )
    .await;
    let (session, receiver) = match attached {
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
    Ok(Opened {
        connection,
        tap,
        session,
        receiver,
    })
}

/// Starts consuming `queue`: grants the credit on a link opened ahead when there is one
/// that opened, or else on one opened now, and starts its task.
pub(crate) async fn start(
    nodes: &Nodes,
    config: &Amqp10Config,
    queue: &str,
    prefetch: u16,
    generation: u64,
    ahead: Option<Ahead>,
) -> Result<Link, TransportError> {
    let profile = config.profile();
    let after = config.operation_timeout();
    let opened = match ahead {
        Some(ahead) => match ahead.await {
            Ok(Ok(opened)) => Some(opened),
            Ok(Err(e)) => {
                debug!(%queue, error = %e, "the link opened ahead failed; opening another");
                None
            }
            Err(_) => None,
        },
        None => None,
    };
    let Opened {
        connection,
        tap,
        session,
        mut receiver,
    } = match opened {
        // One that ended while it waited (the broker restarted, the queue was deleted) is
        // replaced.
        Some(opened) if !opened.session.is_ended() => opened,
        _ => open(nodes, config, queue).await?,
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
    let settler = Arc::new(Settler::new(receiver.disposer(), &profile, credit));
    let (commands, command_rx) = mpsc::channel(usize::from(prefetch).max(16));
    // Credit bounds what is undelivered in the channel to `prefetch`, plus one final marker.
    let (incoming_tx, incoming) = mpsc::channel(usize::from(prefetch) + 2);
    let task = LinkTask {
        connection,
        session,
        receiver,
        queue: queue.to_owned(),
        profile,
        settler,
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
    /// The credit ledger, shared with the tags of the deliveries handed out.
    settler: Arc<Settler>,
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
                    Some(Command::Attach) => {}
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
                // A settlement outside the task used up what held back the next grant.
                () = self.settler.grant_due.notified() => {
                    if let Err(e) = self.refill().await {
                        let _ = out.try_send(Incoming::Lost(e));
                        break;
                    }
                }
                received = self.receiver.recv::<Body<Value>>() => match received {
                    Ok(delivery) => {
                        self.used_one();
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
                        self.settler.ledger().held.insert(info.delivery_id());
                        let tag = Amqp10Tag {
                            link: tag_link,
                            settler: Some(Arc::clone(&self.settler)),
                            info,
                            generation: self.generation,
                        };
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
                        self.used_one();
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
        if !self.settler.ledger().held.remove(&info.delivery_id()) {
            return Err(already_settled(&info));
        }
        dispose(&self.receiver, &self.profile, info, settlement).await?;
        self.refill().await
    }

    /// A transfer came in on the credit.
    fn used_one(&self) {
        let mut ledger = self.settler.ledger();
        ledger.credit = ledger.credit.saturating_sub(1);
    }

    /// Grants `prefetch - held` once the previous grant is used up, never earlier (see
    /// [`Ledger::due`]). The ledger counts the grant before it is sent, so that a settlement
    /// meanwhile does not ask for another.
    async fn refill(&mut self) -> Result<(), TransportError> {
        let target = {
            let mut ledger = self.settler.ledger();
            let Some(target) = ledger.due() else {
                return Ok(());
            };
            ledger.credit = target;
            target
        };
        self.granted_at = self.flows.borrow().seq;
        timeout(self.settle_timeout, self.receiver.set_credit(target))
            .await
            .map_err(|_| TransportError::Timeout {
                operation: "granting credit",
                after: self.settle_timeout,
            })?
            .map_err(|e| TransportError::connection_failed("granting credit", e))?;
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
        self.settler.ledger().cancelled = true;
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
            settler,
            settle_timeout,
            ..
        } = self;
        let _ = timeout(settle_timeout, async {
            // Settlements under way reach the session first; later ones are stale.
            *settler.attached.write().await = false;
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

/// Settles a delivery: a subscription's accept or release from this task, through its link's
/// [`Settler`]; anything else through the link task that received the delivery.
pub(crate) async fn settle(
    tag: &Amqp10Tag,
    settlement: Settlement,
    after: Duration,
) -> Result<(), TransportError> {
    if let Some(settler) = tag.settler.as_ref().filter(|s| s.settles(settlement)) {
        return match timeout(after, settler.settle(&tag.info, settlement)).await {
            Ok(result) => result,
            Err(_) => Err(TransportError::Timeout {
                operation: "settling a delivery",
                after,
            }),
        };
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(prefetch: u32, credit: u32, held: &[u32]) -> Ledger {
        Ledger {
            prefetch,
            credit,
            held: held.iter().copied().collect(),
            cancelled: false,
        }
    }

    #[test]
    fn a_grant_is_due_only_once_the_last_is_used_up_and_never_beyond_the_prefetch() {
        // Credit left: transfers may be on their way, so nothing is granted.
        assert_eq!(ledger(4, 1, &[]).due(), None);
        // Used up: what the held deliveries leave of the prefetch.
        assert_eq!(ledger(4, 0, &[]).due(), Some(4));
        assert_eq!(ledger(4, 0, &[7, 9]).due(), Some(2));
        // Everything held: nothing until a settlement.
        assert_eq!(ledger(2, 0, &[1, 2]).due(), None);
        let mut cancelled = ledger(4, 0, &[]);
        cancelled.cancelled = true;
        assert_eq!(cancelled.due(), None, "no grants after a cancel");
    }
}
