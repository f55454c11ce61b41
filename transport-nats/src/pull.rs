//! [`Pull`]: one pull request to a queue's durable consumer, read message by message.
//!
//! async-nats' own pull (`PullConsumer::batch`) reads every message with a status as the
//! server's word about the pull. A stored message whose header block's first line carries a
//! status (`NATS/1.0 408`, which nats-server stores as sent) is then never handed over: a
//! 408 or 404 ends the pull, leaving what came after it undelivered until its ack wait; a
//! 100 is taken for a heartbeat and leaves the pull waiting, without a wake-up, until its
//! own timer (five seconds past the expiry) drops the rest; any other ends it with an error.
//! The message comes back after each ack wait and does it again. Here a message is told by
//! where it comes from: a stored message always carries its ack subject (`$JS.ACK.…`) as its
//! reply, the server's word never does. A stored message with a status is reported
//! [`Pulled::Misread`], so that its queue is swept (see the `quarantine` module), and the
//! pull goes on.

use std::time::Duration;

use async_nats::jetstream::{self, Context};
use async_nats::{Client, StatusCode, Subscriber};
use futures::StreamExt;
use retry_core::TransportError;
use tokio::time::Instant;

use crate::names::{CONSUMER, stream_name};
use crate::provision::bounded;

/// How long past its expiry a pull is waited for: the server ends it at its expiry.
const GRACE: Duration = Duration::from_secs(1);

/// One pull request, under way.
pub(crate) struct Pull {
    subscriber: Subscriber,
    js: Context,
    /// Messages still to come before the pull is filled.
    left: usize,
    ends_by: Instant,
    queue: String,
}

/// What a pull brought.
// Made once per message and moved straight on: a box would cost an allocation per message.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Pulled {
    /// A stored message the consumer handed out.
    Message(jetstream::Message),
    /// A stored message whose header block's first line carries a status, which async-nats
    /// reads instead of the message: it was handed out, and is never handed over.
    Misread,
    /// The pull is over: filled, or ended by the server (expired, or nothing to hand out).
    End,
    /// The pull's time ran out (its expiry and a grace) without the server's word that it
    /// ended: a message it was handed may still be on its way, to a subscription about to
    /// go, and then comes back redelivered after the ack wait.
    Unanswered,
    /// The server ended the pull with an error (a 409: the consumer was deleted, too many
    /// pulls wait, ...).
    Failed(TransportError),
    /// The pull's subscription ended: its connection, or its client, is gone.
    Lost,
}

impl Pull {
    /// Asks `queue`'s consumer for up to `batch` messages, for at most `expires`. `js` is
    /// the context the messages' acks go through.
    pub(crate) async fn start(
        client: &Client,
        js: &Context,
        queue: &str,
        batch: usize,
        expires: Duration,
        timeout: Duration,
    ) -> Result<Pull, TransportError> {
        let failed = |e: Box<dyn std::error::Error + Send + Sync>| {
            TransportError::connection_failed(format!("pulling from queue {queue}"), e)
        };
        let inbox = client.new_inbox();
        let subscriber = bounded(timeout, "a pull request", client.subscribe(inbox.clone()))
            .await?
            .map_err(|e| failed(e.into()))?;
        let request = serde_json::json!({
            "batch": batch,
            "expires": u64::try_from(expires.as_nanos()).unwrap_or(u64::MAX),
        });
        let subject = format!(
            "$JS.API.CONSUMER.MSG.NEXT.{}.{CONSUMER}",
            stream_name(queue)
        );
        bounded(
            timeout,
            "a pull request",
            client.publish_with_reply(subject, inbox, request.to_string().into()),
        )
        .await?
        .map_err(|e| failed(e.into()))?;
        Ok(Pull {
            subscriber,
            js: js.clone(),
            left: batch,
            ends_by: Instant::now() + expires + GRACE,
            queue: queue.to_owned(),
        })
    }

    /// The next thing the pull brings; after [`Pulled::End`], [`Pulled::Unanswered`],
    /// [`Pulled::Failed`] or [`Pulled::Lost`], it brings nothing more.
    pub(crate) async fn next(&mut self) -> Pulled {
        loop {
            if self.left == 0 {
                return Pulled::End;
            }
            let message = tokio::select! {
                message = self.subscriber.next() => match message {
                    Some(message) => message,
                    None => return Pulled::Lost,
                },
                () = tokio::time::sleep_until(self.ends_by) => return Pulled::Unanswered,
            };
            let stored = message
                .reply
                .as_ref()
                .is_some_and(|reply| reply.starts_with("$JS.ACK."));
            let status = message.status.filter(|s| *s != StatusCode::OK);
            if stored {
                self.left -= 1;
                return match status {
                    None => Pulled::Message(jetstream::Message {
                        message,
                        context: self.js.clone(),
                    }),
                    Some(_) => Pulled::Misread,
                };
            }
            match status {
                // A heartbeat: the pull goes on.
                Some(StatusCode::IDLE_HEARTBEAT) => {}
                // Expired, or nothing to hand out.
                Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => return Pulled::End,
                Some(code) => {
                    let why = message.description.unwrap_or_default();
                    return Pulled::Failed(TransportError::connection_failed(
                        format!("pulling from queue {}", self.queue),
                        format!("the server ended the pull: {code} {why}"),
                    ));
                }
                // Neither a stored message nor a status: nothing the server sends on a
                // pull's inbox.
                None => {}
            }
        }
    }
}
