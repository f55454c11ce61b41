//! The fetch link of one queue: takes at most one message per fetch, for
//! [`Transport::fetch`](retry_core::Transport::fetch) and for a walk of the queue
//! ([`Transport::walk`](retry_core::Transport::walk)), which holds every message it leaves
//! unsettled on the link until it closes it.
//!
//! A task owns a connection of its own and, on it, a session with one receiver in manual
//! credit. On RabbitMQ a fetch first asks how many messages the queue has ready, with a
//! `flow` that grants nothing: the broker answers every `flow` with one that carries the
//! count (`available`), which the connection's [`Tap`] reads. With none ready the answer is
//! `Ok(None)` at once, and no credit was ever granted. Otherwise (or where the broker does
//! not answer) the fetch grants a credit of exactly 1 and waits for the transfer. If none
//! comes within the fetch wait, the credit is taken back by detaching the link and ending
//! its session, unless the broker's answer to the grant says the queue had a message ready
//! when the credit took effect: that message is on its way to this link, and the fetch
//! waits on for it (up to the operation timeout). The next fetch after a take-back attaches
//! a new link. After a fetch that got a message the link stays attached, with no credit
//! left, so a run of suspects costs one count and one grant each.
//!
//! Why: nothing can take an unanswered credit back without a race on RabbitMQ 3.10. A
//! message the broker dispatches to the link before it handles the detach is dropped unread
//! by fe2o3 (which ignores transfers once it has sent a detach), or never sent, and is put
//! back when the session ends with `first-acquirer = false`: redelivered. From the isolation
//! queue, the engine reads that as a crash of a suspect that never ran. Measured
//! (`tests/fetch_race.rs`): with a message published as each empty fetch gave up, 22 to 33
//! of 120 came back marked; counting first, a message the broker counted could still take
//! longer than a short fetch wait to arrive on a busy broker (answers took up to 76 ms), and
//! with a 100 µs wait 13 of 40 came back marked. Counting first and waiting for what the
//! grant's answer announces, both are 0. The take-back is left for the case where another
//! consumer took the counted message, and a message that crosses it then is logged when
//! fe2o3 drops its transfer.
//!
//! Why not a drain: measured on RabbitMQ 3.10.8, a `flow` with `drain = true` that finds a
//! classic queue empty ends the session with `amqp:internal-error` (a `function_clause` in
//! `rabbit_classic_queue:handle_event` on `send_drained`, 3 to 8 ms after the flow, every
//! time); on a quorum queue the drain is answered within 3 ms, but a later grant on that
//! link delivered nothing within 3 s. fe2o3 0.18 does not surface the peer's `flow` to the
//! application either, so an answered drain could not be told from one still under way.
//!
//! Why not a flow with credit 0 to take a grant back: sent while a transfer is on its way or
//! unread, it carries a delivery count that misses that transfer, and RabbitMQ 3.10 computes
//! the new credit as 0 − 1 (its answer said 255). The crossing transfer is refused by fe2o3
//! once the local credit is 0 (`TransferLimitExceeded`), with no way left to settle it. And
//! the broker echoes every `flow` with its delivery count, which fe2o3 writes over the
//! link's even while a transfer it includes waits unread, then counts that transfer again
//! when it is read: the next grant is then one too many. A flow with credit 0 on a link
//! with no credit and nothing on the way (the count) has none of these problems: the
//! counts agree, and the broker's credit stays 0.
//!
//! A message that cannot be decoded (see [`crate::tap`]) is rejected on a fetch, so that the
//! queue dead-letters it, and the fetch goes on to the next message; a walk, which reads
//! parking queues that dead-letter nowhere, hands it out marked instead
//! ([`UNDECODABLE_HEADER`](crate::UNDECODABLE_HEADER)).

use std::collections::BTreeSet;
use std::time::Duration;

use fe2o3_amqp::Receiver;
use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::{MessageDecodeError, RecvError};
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::Body;
use fe2o3_amqp::types::primitives::Value;
use futures::FutureExt;
use retry_core::{Delivery, DeliveryFacts, Message, Settlement, TransportError};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::timeout;
use tracing::{debug, info, warn};

use crate::codec::{read_message, undecodable_message};
use crate::config::{Amqp10Config, Nodes};
use crate::connection::{self, end_session};
use crate::profile::BrokerProfile;
use crate::receiver::{
    Amqp10Tag, Command, Fetched, Undecodable, already_settled, attach_receiver, dispose,
    reject_undecodable, stale,
};
use crate::tap::{FlowSeen, Tap};

/// What a fetch link is for, which decides what becomes of a message that cannot be
/// decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// [`Transport::fetch`](retry_core::Transport::fetch): such a message is rejected (the
    /// queue dead-letters it) and the fetch takes the next.
    Fetch,
    /// A walk of a queue (the parking lot), which may dead-letter nowhere: such a message is
    /// handed out, marked, and settled as the walk decides.
    Walk,
}

/// Starts the task of a fetch link on `queue`. Nothing is opened until the first fetch.
pub(crate) fn spawn(
    nodes: &Nodes,
    config: &Amqp10Config,
    queue: &str,
    purpose: Purpose,
) -> mpsc::Sender<Command> {
    let (commands, command_rx) = mpsc::channel(16);
    let task = FetchTask {
        nodes: nodes.clone(),
        config: config.clone(),
        profile: config.profile(),
        queue: queue.to_owned(),
        purpose,
        connection: None,
        link: None,
        held: BTreeSet::new(),
        unclaimed: None,
        generation: 0,
        attachments: 0,
        received: 0,
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
    purpose: Purpose,
    /// The connection, and the tap on what comes in on it.
    connection: Option<(ConnectionHandle<()>, Tap)>,
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
    /// Transfers fe2o3 handed over on the current connection, decodable or not: what the
    /// tap counted beyond these, fe2o3 dropped.
    received: u64,
    /// For tags; weak, so that the task ends once the transport and every tag are gone.
    own: mpsc::WeakSender<Command>,
}

/// What waiting for the transfer of a grant came to.
enum Received {
    Delivery(Box<fe2o3_amqp::link::delivery::Delivery<Body<Value>>>),
    Undecodable(MessageDecodeError),
    /// Nothing within the wait; the credit is taken back.
    Nothing,
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
                Command::Attach => {
                    if let Err(e) = self.attach().await {
                        debug!(queue = %self.queue, error = %e, "attaching the fetch link ahead of the first fetch failed; the fetch tries again");
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
                Command::Count { done } => {
                    let counted = if self.unclaimed.is_some() {
                        // Held for the next fetch: that fetch takes it.
                        Ok(Some(1))
                    } else if self.profile.answers_flows() {
                        self.count().await
                    } else {
                        Ok(None)
                    };
                    let _ = done.send(counted);
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
                settler: None,
                info,
                generation: self.generation,
            };
            return Ok(Some(Delivery {
                tag,
                message,
                facts,
            }));
        }
        let answers = self.profile.answers_flows();
        // Each turn either answers or settles one undecodable message, which has then left
        // the queue: the loop ends.
        loop {
            if answers && self.count().await? == Some(0) {
                return Ok(None);
            }
            // The broker's answer to the grant, from here on, says whether a message is on
            // its way (see `receive`).
            let answer = match self.connection.as_ref() {
                Some((_, tap)) if answers => {
                    let flows = tap.flows();
                    let asked = flows.borrow().seq;
                    Some((flows, asked))
                }
                _ => None,
            };
            self.flow(1).await?;
            match self.receive(answer).await? {
                Received::Delivery(delivery) => return self.hand_out(*delivery),
                Received::Nothing => return Ok(None),
                Received::Undecodable(error) => match self.purpose {
                    Purpose::Walk => return self.hand_out_undecodable(error),
                    Purpose::Fetch => self.reject(error).await?,
                },
            }
        }
    }

    /// How many messages the queue has ready, as the broker says in its answer to a `flow`
    /// that grants nothing; `None` if no answer came within the operation timeout. Sent only
    /// on a link with no credit and nothing on the way, where it changes nothing. (A busy
    /// broker can take tens of milliseconds to answer; granting without the count would leave
    /// an empty queue with a credit to take back.)
    async fn count(&mut self) -> Result<Option<u32>, TransportError> {
        self.attach().await?;
        let Some((_, tap)) = self.connection.as_ref() else {
            return Err(TransportError::Closed);
        };
        let mut flows = tap.flows();
        let asked = flows.borrow().seq;
        self.flow(0).await?;
        let wait = self.config.operation_timeout();
        match timeout(wait, flows.wait_for(|seen| seen.seq > asked)).await {
            Ok(Ok(seen)) => {
                debug!(queue = %self.queue, available = ?seen.available, "counted");
                Ok(seen.available)
            }
            _ => {
                debug!(queue = %self.queue, "no count from the broker; granting to find out");
                Ok(None)
            }
        }
    }

    /// Sets the link's credit to `credit` (0 to ask for a count, 1 to take a message) on a
    /// link that has none. A link that died while idle had nothing granted and holds
    /// nothing: it is replaced, once, without an error.
    async fn flow(&mut self, credit: u32) -> Result<(), TransportError> {
        let after = self.config.operation_timeout();
        let mut replaced = false;
        loop {
            self.attach().await?;
            let Some((_, receiver)) = self.link.as_mut() else {
                return Err(TransportError::Closed);
            };
            let failure = match timeout(after, receiver.set_credit(credit)).await {
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

    /// Waits for the transfer of the credit just granted; takes the credit back if none
    /// comes within the fetch wait and `answer` (the broker's flows and how many had come
    /// before the grant) does not say one is on its way.
    ///
    /// RabbitMQ answers the grant with the queue's count of ready messages: taken before the
    /// queue dispatches on a classic queue, after it on a quorum queue. A count above 0 means
    /// the queue had a message when this credit took effect, and since a ready message means
    /// no other consumer was waiting with credit, it went to this link: on a busy broker it
    /// can take longer than the fetch wait to arrive, and taking the credit back then would
    /// send it back to the queue marked redelivered. So the fetch waits on for it, up to the
    /// operation timeout.
    async fn receive(
        &mut self,
        answer: Option<(watch::Receiver<FlowSeen>, u64)>,
    ) -> Result<Received, TransportError> {
        let after = self.config.operation_timeout();
        let wait = self.config.fetch_wait().min(after);
        let Some((_, receiver)) = self.link.as_mut() else {
            return Err(TransportError::Closed);
        };
        let mut received = match timeout(wait, receiver.recv::<Body<Value>>()).await {
            Ok(result) => Some(result),
            // A transfer that arrived just as the wait ended is still within the credit.
            Err(_) => receiver.recv::<Body<Value>>().now_or_never(),
        };
        let mut announced = false;
        if received.is_none()
            && let Some((mut flows, asked)) = answer
            && on_its_way(&mut flows, asked, after).await
        {
            debug!(queue = %self.queue, "a message is on its way to the fetch link; waiting for it");
            announced = true;
            received = timeout(after, receiver.recv::<Body<Value>>()).await.ok();
            if received.is_none() {
                warn!(queue = %self.queue, ?after, "a message the broker dispatched to the fetch link did not arrive; taking the credit back, which puts it back marked redelivered");
            }
        }
        match received {
            Some(Ok(delivery)) => {
                self.received += 1;
                Ok(Received::Delivery(Box::new(delivery)))
            }
            Some(Err(RecvError::MessageDecode(error))) => {
                self.received += 1;
                Ok(Received::Undecodable(error))
            }
            // The link broke with the credit granted: a message dispatched to it goes back
            // to the queue redelivered, through no crash of its own.
            Some(Err(e)) => {
                let context = format!("the fetch link broke with a credit granted: {e}");
                self.lost(e);
                Err(TransportError::FetchLost {
                    queue: self.queue.clone(),
                    context,
                })
            }
            None => {
                self.take_back().await;
                if announced {
                    return Err(TransportError::FetchLost {
                        queue: self.queue.clone(),
                        context: format!(
                            "the message the broker dispatched to the fetch link did not arrive within {after:?}"
                        ),
                    });
                }
                Ok(Received::Nothing)
            }
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
        if self
            .connection
            .as_ref()
            .is_none_or(|(connection, _)| connection.is_closed())
        {
            self.connection = None;
            self.connection = Some(connection::open(&self.nodes, &self.config, "fetcher").await?);
            self.received = 0;
        }
        let Some((connection, _)) = self.connection.as_mut() else {
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
            settler: None,
            info,
            generation: self.generation,
        };
        Ok(Some(read_message(message, &self.queue, &self.profile, tag)))
    }

    /// A walk's undecodable message: handed out with its sections as its body, when the tap
    /// kept them, and why in [`UNDECODABLE_HEADER`](crate::UNDECODABLE_HEADER).
    fn hand_out_undecodable(&mut self, error: MessageDecodeError) -> Fetched {
        let Some(link) = self.own.upgrade() else {
            return Err(TransportError::Closed);
        };
        let Some((_, tap)) = self.connection.as_ref() else {
            return Err(TransportError::Closed);
        };
        let Undecodable { info, why, payload } = Undecodable::new(tap, error);
        warn!(queue = %self.queue, delivery_id = info.delivery_id(), %why, "a message in the queue cannot be decoded");
        self.held.insert(info.delivery_id());
        let tag = Amqp10Tag {
            link,
            settler: None,
            info,
            generation: self.generation,
        };
        Ok(Some(undecodable_message(&self.queue, why, payload, tag)))
    }

    /// Rejects an undecodable message: the queue dead-letters it.
    async fn reject(&mut self, error: MessageDecodeError) -> Result<(), TransportError> {
        let (Some((_, receiver)), Some((_, tap))) = (self.link.as_ref(), self.connection.as_ref())
        else {
            return Err(TransportError::Closed);
        };
        let after = self.config.operation_timeout();
        let rejected =
            match timeout(after, reject_undecodable(receiver, tap, &self.queue, error)).await {
                Ok(result) => result,
                Err(_) => Err(TransportError::Timeout {
                    operation: "rejecting an undecodable message",
                    after,
                }),
            };
        if rejected.is_err() {
            // Whether the broker saw it is unknown; a new link starts clean.
            self.discard();
        }
        rejected
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
            if let Some((_, tap)) = self.connection.as_ref() {
                // fe2o3 drops a transfer that arrives once it has sent the detach.
                let crossed = tap.transfers().saturating_sub(self.received);
                if crossed > 0 {
                    self.received += crossed;
                    warn!(
                        queue = %self.queue,
                        crossed,
                        "a message reached the fetch link as its credit was taken back: the broker puts it back marked redelivered, so a consumer of an isolation queue counts a crash when it next fetches it"
                    );
                }
            }
            tokio::spawn(async move { end_session(&mut session).await });
        }
    }

    /// Drops a link that failed, with its session, in the background; the next fetch
    /// attaches a new one.
    fn discard(&mut self) {
        self.held.clear();
        self.unclaimed = None;
        if let Some((_, tap)) = self.connection.as_ref() {
            // Whatever that link had coming goes back with it, known: not a crossing.
            self.received = tap.transfers();
        }
        if let Some((mut session, receiver)) = self.link.take() {
            let after = self.config.operation_timeout();
            tokio::spawn(async move {
                let _ = timeout(after, receiver.detach()).await;
                end_session(&mut session).await;
            });
        }
    }

    async fn close_connection(&mut self) {
        if let Some((mut connection, _)) = self.connection.take() {
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

/// Whether the broker's answer to a grant (the first link flow after the `asked`-th) says
/// the queue had a message ready when the credit took effect; `false` if none came within
/// `within`.
async fn on_its_way(flows: &mut watch::Receiver<FlowSeen>, asked: u64, within: Duration) -> bool {
    match timeout(within, flows.wait_for(|seen| seen.seq > asked)).await {
        Ok(Ok(answer)) => answer.available.is_some_and(|n| n > 0),
        _ => false,
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

/// Asks the fetch link task `link` to attach its link now, without waiting for it: a fetch
/// asked for meanwhile is answered once it has.
pub(crate) fn attach_ahead(link: &mpsc::Sender<Command>) {
    let _ = link.try_send(Command::Attach);
}

/// Asks the fetch link task `link` how many messages its queue has ready, and waits for the
/// answer: `None` where the broker does not say.
pub(crate) async fn count(
    link: &mpsc::Sender<Command>,
    config: &Amqp10Config,
) -> Result<Option<u32>, TransportError> {
    let (done, answer) = oneshot::channel();
    link.send(Command::Count { done })
        .await
        .map_err(|_| TransportError::Closed)?;
    let after = answer_within(config);
    match timeout(after, answer).await {
        Ok(Ok(counted)) => counted,
        Ok(Err(_)) => Err(TransportError::Closed),
        Err(_) => Err(TransportError::Timeout {
            operation: "counting a queue",
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
