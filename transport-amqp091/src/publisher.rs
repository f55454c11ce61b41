//! `Publisher`: a confirm-mode channel whose publish results are paired with the broker's
//! `basic.return`s by a stamp each publish carries, not by lapin.
//!
//! RabbitMQ answers an unroutable `mandatory` publish with a `basic.return` and then the
//! publish's confirm, and may confirm several publishes with one `multiple` ack. lapin 4.12
//! hands the oldest waiting return to whichever confirm it completes next, and completes a
//! `multiple` ack's confirms in hash-map order: with routable and unroutable publishes in
//! flight together, a return lands on the wrong publish (about 8% of the unroutable ones
//! in the `returns` test, before this module). An unroutable clone reported confirmed would
//! have its original acknowledged: a lost message.
//!
//! So every publish is registered with a [`ReturnMatcher`] (one per channel) and carries its
//! stamp in the [`PUBLISH_ID`](retry_core::headers::PUBLISH_ID) header; every confirm
//! lapin completes goes to the matcher with the stamp read from the returned message it
//! carried, whoever's it is; the matcher's verdicts are the results. Three rules keep it
//! sound (see the matcher's docs for why):
//!
//! * Every confirm is awaited to its end, even when the caller's publish future is dropped
//!   (it gave up, a consumer stopped): a publish is sent and its confirm read by a future
//!   of its own, which the caller polls while it waits for the verdict and which goes on in
//!   a task of its own if the caller is dropped first. A confirm dropped unread could carry
//!   another publish's return, and the publishes after it would wait for its answer.
//! * A confirm that does not come in time is not given up on alone: the channel is given
//!   up ([`Publisher::give_up`]: every publish in flight on it fails, nothing more is sent
//!   on it, it is closed), and the next publish opens a new channel with a new matcher.
//! * A publish that cannot be sent gives the channel up the same way. A channel error or a
//!   lost connection fails every confirm in flight in lapin (each is answered as failed);
//!   the channel is then given up and replaced by the next publish, once it is seen
//!   closed or the connection recovered.
//!
//! A failed publish requeues its original: a duplicate at worst, never a loss.

use std::collections::HashMap;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex as StdMutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use retry_core::returns::{stamp_headers, stamp_of};
use retry_core::{Answer, Confirm, Message, Publish, PublishResult, ReturnMatcher, TransportError};
use tokio::sync::{Mutex, oneshot, watch};
use tracing::{debug, warn};

use crate::convert::{headers_from_table, properties_to_amqp};
use crate::error::{connection_error, short};

/// Why a channel was given up: the error every publish in flight on it fails with.
const TIMED_OUT: &str = "a publisher confirm timed out, so the publishing channel was closed";
const NOT_SENT: &str = "a publish on the publishing channel could not be sent";
const CHANNEL_CLOSED: &str = "the publishing channel was closed";
const NO_RUNTIME: &str = "a publish was dropped outside the tokio runtime";
const RECOVERED: &str = "the connection was recovered, so the publishing channel was replaced";

/// One confirm-mode channel and the matcher of its publishes.
pub(crate) struct Publisher {
    channel: Channel,
    /// What the owner was at when it opened it (the transport: its link's recovery count);
    /// a publisher of another epoch is replaced.
    epoch: u64,
    state: StdMutex<State>,
    /// Set when the channel is given up: the publishes' tasks stop waiting for confirms.
    gone: watch::Sender<bool>,
}

struct State {
    matcher: ReturnMatcher,
    /// Who waits for each stamp's verdict.
    waiters: HashMap<u64, Waiter>,
    /// Set once the channel is given up, with why.
    given_up: Option<&'static str>,
}

/// A publish waiting for its verdict, with its own error once it has one.
struct Waiter {
    tx: oneshot::Sender<(Confirm, Option<TransportError>)>,
    error: Option<TransportError>,
}

impl State {
    /// Hands every verdict the matcher has to its waiter.
    fn dispatch(&mut self) {
        while let Some((stamp, confirm)) = self.matcher.poll_verdict() {
            if let Some(waiter) = self.waiters.remove(&stamp) {
                // A waiter that is gone needs no verdict.
                let _ = waiter.tx.send((confirm, waiter.error));
            }
        }
    }
}

impl Publisher {
    /// Opens a channel on `connection` in confirm mode.
    pub(crate) async fn open(
        connection: &Connection,
        epoch: u64,
    ) -> Result<Arc<Self>, TransportError> {
        let channel = confirm_channel(connection).await?;
        debug!(channel = channel.id(), "publishing channel opened");
        Ok(Arc::new(Publisher {
            channel,
            epoch,
            state: StdMutex::new(State {
                matcher: ReturnMatcher::new(),
                waiters: HashMap::new(),
                given_up: None,
            }),
            gone: watch::Sender::new(false),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the channel was given up, if it was.
    fn given_up(&self) -> Option<&'static str> {
        self.lock().given_up
    }

    /// Whether a publish may still go out on this channel: not given up, and open (or
    /// waiting for its connection's recovery, which the owner decides on).
    fn usable(&self, connection: &Connection, epoch: u64) -> Result<(), &'static str> {
        if let Some(why) = self.given_up() {
            return Err(why);
        }
        if self.epoch != epoch {
            return Err(RECOVERED);
        }
        if self.channel.status().connected() || !connection.status().connected() {
            Ok(())
        } else {
            Err(CHANNEL_CLOSED)
        }
    }

    /// Fails every publish in flight, sends nothing more and closes the channel, as soon as
    /// that is possible. Idempotent: the first reason stays.
    pub(crate) fn give_up(&self, why: &'static str) {
        {
            let mut s = self.lock();
            if s.given_up.is_some() {
                return;
            }
            s.given_up = Some(why);
            self.gone.send_replace(true);
            let in_flight = s.matcher.in_flight();
            s.matcher.fail_all();
            s.dispatch();
            if in_flight > 0 {
                warn!(
                    channel = self.channel.id(),
                    in_flight, why, "publishing channel given up; the publishes in flight failed"
                );
            }
        }
        close_when_possible(self.channel.clone(), why);
    }

    /// Publishes `original`'s body `mandatory` with the properties `properties` makes for
    /// its stamp, and waits for the verdict; gives the channel up when none comes by the
    /// deadline (`timeout` after the publish began).
    ///
    /// The publish runs in a task of its own, which sends it and awaits its confirm to the
    /// end (or until the channel is given up), whether or not this future is still there
    /// to hear the verdict.
    async fn publish(
        self: &Arc<Self>,
        exchange: ShortString,
        routing_key: ShortString,
        original: Message,
        properties: impl FnOnce(u64) -> BasicProperties,
        (deadline, timeout): (tokio::time::Instant, Duration),
    ) -> PublishResult {
        let (stamp, mut verdict) = {
            let mut s = self.lock();
            if let Some(why) = s.given_up {
                return PublishResult::Failed(TransportError::connection_lost(why));
            }
            let stamp = s.matcher.register();
            let (tx, rx) = oneshot::channel();
            s.waiters.insert(stamp, Waiter { tx, error: None });
            (stamp, rx)
        };
        let properties = properties(stamp);
        let publisher = Arc::clone(self);
        // Owned, so that it can go on in a task of its own if this future is dropped.
        let sending = Box::pin(async move {
            publisher
                .send(stamp, exchange, routing_key, &original, properties)
                .await;
        });
        let mut send = Detached(Some(sending), Arc::clone(self));
        let mut deadline = pin!(tokio::time::sleep_until(deadline));
        let verdict = poll_fn(|cx| {
            if let Poll::Ready(verdict) = Pin::new(&mut verdict).poll(cx) {
                return Poll::Ready(Some(verdict));
            }
            if let Some(sending) = send.0.as_mut()
                && sending.as_mut().poll(cx).is_ready()
            {
                send.0 = None;
                // Its own answer may have decided it.
                if let Poll::Ready(verdict) = Pin::new(&mut verdict).poll(cx) {
                    return Poll::Ready(Some(verdict));
                }
            }
            deadline.as_mut().poll(cx).map(|()| None)
        })
        .await;
        match verdict {
            Some(Ok((confirm, error))) => self.result(confirm, error),
            Some(Err(_)) => self.result(Confirm::Failed, None),
            None => {
                // Before `send` is dropped: every publish in flight fails with this.
                self.give_up(TIMED_OUT);
                PublishResult::Failed(TransportError::Timeout {
                    operation: "publisher confirm",
                    after: timeout,
                })
            }
        }
    }

    /// Sends the publish `stamp` and gives its confirm to the matcher.
    async fn send(
        &self,
        stamp: u64,
        exchange: ShortString,
        routing_key: ShortString,
        original: &Message,
        properties: BasicProperties,
    ) {
        let mut gone = self.gone.subscribe();
        let sent = self
            .channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                original.body(),
                properties,
            )
            .await;
        let confirm = match sent {
            Ok(confirm) => confirm,
            Err(e) => {
                if let Some(waiter) = self.lock().waiters.get_mut(&stamp) {
                    waiter.error = Some(connection_error(e));
                }
                // lapin may count it as in flight all the same, and its confirm could
                // carry another publish's return: only a new channel is sure.
                self.give_up(NOT_SENT);
                return;
            }
        };
        tokio::select! {
            biased;
            answered = confirm => self.answer(stamp, answered),
            // Every publish in flight has failed: no answer is needed any more, and on a
            // connection that was replaced none may ever come.
            _ = gone.wait_for(|gone| *gone) => {}
        }
    }

    /// The result for a verdict, with the publish's own error if it failed.
    fn result(&self, confirm: Confirm, error: Option<TransportError>) -> PublishResult {
        match confirm {
            Confirm::Ack => PublishResult::Confirmed,
            Confirm::Nack => PublishResult::Refused,
            Confirm::Returned => PublishResult::Returned,
            Confirm::Failed => PublishResult::Failed(error.unwrap_or_else(|| {
                let why = self.given_up().unwrap_or(
                    "a basic.return named no publish in flight on the publishing channel, so \
                     every undecided publish on it failed",
                );
                TransportError::connection_lost(why)
            })),
        }
    }

    /// Gives the matcher what lapin answered for `stamp`, with the stamp of the returned
    /// message it carried, whoever's it is.
    fn answer(&self, stamp: u64, answered: lapin::Result<Confirmation>) {
        let (answer, returned, error) = match answered {
            Ok(Confirmation::Ack(returned)) => (Answer::Ack, returned, None),
            Ok(Confirmation::Nack(returned)) => (Answer::Nack, returned, None),
            Ok(Confirmation::NotRequested) => (
                Answer::Failed,
                None,
                Some(TransportError::Other(
                    "the publishing channel is not in confirm mode".into(),
                )),
            ),
            Err(e) => (Answer::Failed, None, Some(connection_error(e))),
        };
        let returned = returned.map(|message| {
            let owner = returned_stamp(&message);
            debug!(
                stamp,
                ?owner,
                reply = message.reply_code,
                "a confirm carried a returned message"
            );
            owner
        });
        let mut s = self.lock();
        if let Some(waiter) = s.waiters.get_mut(&stamp) {
            waiter.error = error;
        }
        let stray = s.matcher.stray_returns();
        s.matcher.answer(stamp, answer, returned);
        if s.matcher.stray_returns() != stray {
            warn!(
                channel = self.channel.id(),
                "a returned message names no publish in flight; every undecided publish fails \
                 and is requeued"
            );
        }
        s.dispatch();
    }
}

/// The stamp a returned message carries, if it has one that reads as one.
fn returned_stamp(message: &BasicReturnMessage) -> Option<u64> {
    let table = message.delivery.properties.headers().as_ref()?;
    stamp_of(&headers_from_table(table))
}

/// A publish being sent and its confirm awaited, on the caller's task while the caller
/// waits; dropped before it is done, it goes on in a task of its own (the confirm may
/// carry another publish's return), unless the channel was given up.
struct Detached(
    Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    Arc<Publisher>,
);

impl Drop for Detached {
    fn drop(&mut self) {
        let Some(sending) = self.0.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(sending);
            }
            // No runtime to finish it on (it is shutting down): the channel goes with it.
            Err(_) => self.1.give_up(NO_RUNTIME),
        }
    }
}

/// The publishing channel of an owner that publishes on one connection at a time: kept
/// while it can be used, replaced (the old one given up) when it cannot.
#[derive(Default)]
pub(crate) struct PublisherSlot {
    slot: Mutex<Option<Arc<Publisher>>>,
}

impl PublisherSlot {
    /// A slot holding `publisher`.
    pub(crate) fn with(publisher: Arc<Publisher>) -> Self {
        PublisherSlot {
            slot: Mutex::new(Some(publisher)),
        }
    }

    /// Publishes `original`'s clone as `publish` asks, `mandatory`, on the publishing
    /// channel for `connection` in `epoch`, within `timeout` (opening the channel included).
    pub(crate) async fn publish(
        &self,
        connection: &Connection,
        epoch: u64,
        original: &Message,
        publish: &Publish,
        timeout: Duration,
    ) -> PublishResult {
        let deadline = tokio::time::Instant::now() + timeout;
        let (exchange, routing_key) = match (
            short(&publish.route.exchange),
            short(&publish.route.routing_key),
        ) {
            (Ok(exchange), Ok(routing_key)) => (exchange, routing_key),
            (Err(e), _) | (_, Err(e)) => return PublishResult::Failed(e),
        };
        let publisher = match tokio::time::timeout_at(deadline, self.get(connection, epoch)).await {
            Ok(Ok(publisher)) => publisher,
            Ok(Err(e)) => return PublishResult::Failed(e),
            Err(_) => {
                return PublishResult::Failed(TransportError::Timeout {
                    operation: "opening the publishing channel",
                    after: timeout,
                });
            }
        };
        let properties = |stamp| {
            let mut headers = publish.clone_headers(original);
            stamp_headers(&mut headers, stamp);
            properties_to_amqp(
                original.properties(),
                &headers,
                &original.parts().native,
                publish.expiration,
            )
        };
        publisher
            .publish(
                exchange,
                routing_key,
                original.clone(),
                properties,
                (deadline, timeout),
            )
            .await
    }

    /// The publisher to use on `connection` in `epoch`: the current one while it is usable
    /// (a lost connection is left to automatic recovery), otherwise a new one.
    async fn get(
        &self,
        connection: &Connection,
        epoch: u64,
    ) -> Result<Arc<Publisher>, TransportError> {
        let mut slot = self.slot.lock().await;
        if let Some(publisher) = slot.as_ref() {
            match publisher.usable(connection, epoch) {
                Ok(()) => return Ok(Arc::clone(publisher)),
                Err(why) => {
                    publisher.give_up(why);
                    *slot = None;
                }
            }
        }
        let publisher = Publisher::open(connection, epoch).await?;
        *slot = Some(Arc::clone(&publisher));
        Ok(publisher)
    }
}

/// A channel on `connection` in confirm mode.
pub(crate) async fn confirm_channel(connection: &Connection) -> Result<Channel, TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(connection_error)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(connection_error)?;
    Ok(channel)
}

/// Closes a given-up channel now, or once lapin has recovered it (so that a recovery does
/// not bring back a channel nobody uses); gives up after an hour.
fn close_when_possible(channel: Channel, why: &'static str) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        for _ in 0..3_600 {
            let status = channel.status();
            if status.connected() {
                let _ = channel.close(200, why.into()).await;
                return;
            }
            if !status.reconnecting() && !status.initializing() {
                return;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
}
