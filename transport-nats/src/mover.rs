//! Movers: what brings a delayed clone back once it is due.
//!
//! A delay queue of the plan is a stream with a durable consumer, like any other. Its mover
//! pulls what is there, and each clone waits for its own due time, none behind another:
//!
//! * one due within the mover's horizon (half the ack wait, at most 5 s) is held by the
//!   mover, unacked, and moved when due, to the millisecond;
//! * one due later is nak'ed with the time it has left less half the horizon: the server
//!   holds it and hands it out again a little before it is due, and the mover holds it
//!   from there. The server's redelivery timer is only so precise: a nak resets the
//!   consumer's pending timer to 10 ms (nats-server 2.9's `processNak`), so while naks
//!   come faster than one every 10 ms its redeliveries wait. Naking only the clones that
//!   are far from due, and early, keeps that delay off the due time.
//!
//! A clone that is due is published to the queue its delay queue leads to, with a
//! `Nats-Msg-Id` naming its stream and sequence, and acked once the server has acknowledged
//! that publish. A mover that dies between the two leaves the clone unacked: it comes back
//! after the ack wait and is published again with the same id, which the destination
//! stream recognises as a duplicate within its duplicate window.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{AckKind, Context};
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::codec::{DUE, MSG_ID, copy_id};
use crate::connection::Receiver;
use crate::delivery::now_millis;
use crate::names::stream_name;
use crate::pull::{Pull, Pulled};

/// How many due-or-not clones one pull takes.
const BATCH: usize = 256;

/// The longest a mover holds a clone itself before it is due.
const MAX_HORIZON: Duration = Duration::from_secs(5);

pub(crate) struct Mover {
    /// What pulls are made on.
    pub receiver: Arc<Receiver>,
    /// What moved clones are published and acked through.
    pub js: Context,
    /// The delay queue's name, for logs.
    pub queue: String,
    /// Where due clones go.
    pub destination: String,
    /// The delay queue's level: a clone without a due time is due this long after it was
    /// stored.
    pub level: Duration,
    pub pull_wait: Duration,
    /// The consumers' ack wait: a clone held longer would be handed out again.
    pub ack_wait: Duration,
    pub operation_timeout: Duration,
    /// Bumped at each reconnection.
    pub reconnects: tokio::sync::watch::Receiver<u64>,
    /// Where a queue is named for a quarantine sweep.
    pub sweeps: tokio::sync::mpsc::UnboundedSender<String>,
}

impl Mover {
    pub(crate) async fn run(self) {
        let mut reconnects = self.reconnects.clone();
        let mover = Arc::new(self);
        // The clones held or being moved; dropping the set (the mover stopped) aborts them,
        // and the server hands their clones out again after the ack wait.
        let mut moving = JoinSet::new();
        loop {
            while moving.try_join_next().is_some() {}
            reconnects.borrow_and_update();
            let (generation, receiver) = mover.receiver.client();
            let pulled = Pull::start(
                &receiver,
                &mover.js,
                &mover.queue,
                BATCH,
                mover.pull_wait,
                mover.operation_timeout,
            )
            .await;
            let mut pull = match pulled {
                Ok(pull) => pull,
                Err(e) => {
                    debug!(queue = %mover.queue, error = %e, "delay mover: pull failed; trying again");
                    mover.receiver.revive(generation).await;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            loop {
                let pulled = tokio::select! {
                    pulled = pull.next() => pulled,
                    // The pull was made on a connection that is gone.
                    changed = reconnects.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        break;
                    }
                };
                match pulled {
                    Pulled::Message(m) => {
                        if let Some(wait) = mover.hold_for(&m).await {
                            moving.spawn(Arc::clone(&mover).move_when_due(m, wait));
                        }
                    }
                    Pulled::Misread => {
                        let _ = mover.sweeps.send(mover.queue.clone());
                    }
                    Pulled::End | Pulled::Unanswered => break,
                    Pulled::Lost => {
                        mover.receiver.revive(generation).await;
                        break;
                    }
                    Pulled::Failed(e) => {
                        debug!(queue = %mover.queue, error = %e, "delay mover: pull ended");
                        break;
                    }
                }
            }
        }
    }

    /// How long to hold `message` before moving it; `None` when it was nak'ed instead, or
    /// cannot be read.
    async fn hold_for(&self, message: &async_nats::jetstream::Message) -> Option<Duration> {
        let info = message.info().ok()?;
        let stored_ms =
            u64::try_from(info.published.unix_timestamp_nanos() / 1_000_000).unwrap_or(0);
        let due = message
            .headers
            .as_ref()
            .and_then(|h| h.get(DUE))
            .and_then(|v| v.as_str().parse::<u64>().ok())
            .unwrap_or_else(|| {
                stored_ms.saturating_add(u64::try_from(self.level.as_millis()).unwrap_or(u64::MAX))
            });
        let left = Duration::from_millis(due.saturating_sub(now_millis()));
        let horizon = (self.ack_wait / 2).min(MAX_HORIZON);
        if left <= horizon {
            return Some(left);
        }
        if let Err(e) = message
            .ack_with(AckKind::Nak(Some(left - horizon / 2)))
            .await
        {
            debug!(queue = %self.queue, error = %e, "delay mover: nak failed");
        }
        None
    }

    /// Waits `wait`, then moves `message` where its delay queue leads.
    async fn move_when_due(
        self: Arc<Self>,
        message: async_nats::jetstream::Message,
        wait: Duration,
    ) {
        tokio::time::sleep(wait).await;
        let Ok(info) = message.info() else {
            return;
        };
        let (stream, sequence) = (info.stream.to_owned(), info.stream_sequence);
        let published_ns = info.published.unix_timestamp_nanos();
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
