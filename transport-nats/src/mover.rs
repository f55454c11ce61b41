//! Movers: what brings a delayed clone back once it is due.
//!
//! A delay queue of the plan is a stream with a durable consumer, like any other. Its mover
//! pulls what is there; a clone not yet due is nak'ed with the time it has left (the server
//! holds it and hands it out again then, the clone's own timer, so no clone waits behind
//! another), and a clone that is due is published to the queue its delay queue leads to,
//! with a `Nats-Msg-Id` made of its stream and sequence, and acked once the server has
//! acknowledged that publish. A mover that dies between the two leaves the clone
//! unacked: it comes back after the ack wait and is published again with the same id,
//! which the destination stream recognises as a duplicate within its duplicate window.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context};
use futures::StreamExt;
use tracing::{debug, warn};

use crate::codec::{DUE, MSG_ID, copy_id};
use crate::delivery::now_millis;
use crate::names::stream_name;

/// How many due-or-not clones one pull takes.
const BATCH: usize = 256;

pub(crate) struct Mover {
    pub js: Context,
    pub consumer: PullConsumer,
    /// The delay queue's name, for logs.
    pub queue: String,
    /// Where due clones go.
    pub destination: String,
    /// The delay queue's level: a clone without a due time is due this long after it was
    /// stored.
    pub level: Duration,
    pub pull_wait: Duration,
    /// Bumped at each reconnection.
    pub reconnects: tokio::sync::watch::Receiver<u64>,
}

impl Mover {
    pub(crate) async fn run(mut self) {
        loop {
            self.reconnects.borrow_and_update();
            let batch = self
                .consumer
                .batch()
                .max_messages(BATCH)
                .expires(self.pull_wait)
                .messages()
                .await;
            let mut batch = match batch {
                Ok(b) => b,
                Err(e) => {
                    debug!(queue = %self.queue, error = %e, "delay mover: pull failed; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            loop {
                let message = tokio::select! {
                    message = batch.next() => match message {
                        Some(message) => message,
                        None => break,
                    },
                    // The pull was made on a connection that is gone.
                    changed = self.reconnects.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
                };
                match message {
                    Ok(m) => self.handle(m).await,
                    Err(e) => {
                        debug!(queue = %self.queue, error = %e, "delay mover: pull ended");
                        break;
                    }
                }
            }
        }
    }

    async fn handle(&self, message: async_nats::jetstream::Message) {
        let Ok(info) = message.info() else {
            return;
        };
        let (stream, sequence) = (info.stream.to_owned(), info.stream_sequence);
        let stored_ms =
            u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        let published_ns = info.published.unix_timestamp_nanos();
        let due = message
            .headers
            .as_ref()
            .and_then(|h| h.get(DUE))
            .and_then(|v| v.as_str().parse::<u64>().ok())
            .unwrap_or_else(|| {
                stored_ms.saturating_add(u64::try_from(self.level.as_millis()).unwrap_or(u64::MAX))
            });
        let now = now_millis();
        if now < due {
            let left = Duration::from_millis(due - now);
            if let Err(e) = message.ack_with(AckKind::Nak(Some(left))).await {
                debug!(queue = %self.queue, error = %e, "delay mover: nak failed");
            }
            return;
        }
        let headers = message.headers.clone().unwrap_or_default();
        let mut clean = async_nats::HeaderMap::new();
        for (name, values) in headers.iter() {
            let text: &str = name.as_ref();
            // The server's headers (the id, the expected stream) were the delay clone's.
            if text == DUE || text.starts_with("Nats-") {
                continue;
            }
            for v in values {
                clean.append(name.clone(), v.clone());
            }
        }
        clean.insert(
            MSG_ID,
            copy_id(&stream, sequence, published_ns, &self.destination).as_str(),
        );
        let publish = async_nats::jetstream::message::PublishMessage::build()
            .payload(message.payload.clone())
            .headers(clean)
            .expected_stream(stream_name(&self.destination));
        let acked = match self
            .js
            .send_publish(self.destination.clone(), publish)
            .await
        {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match acked {
            Ok(_) => {
                if let Err(e) = message.double_ack().await {
                    debug!(queue = %self.queue, error = %e, "delay mover: ack after the move failed; it moves again, deduplicated");
                }
            }
            Err(e) => {
                warn!(queue = %self.queue, destination = %self.destination, error = %e, "delay mover: publishing a due clone failed; trying again in 1 s");
                let _ = message
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
            }
        }
    }
}
