//! `AmqpSubscription`: one consumer on a channel of its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};
use retry_core::{Delivery, Subscription, TransportError};
use tokio::sync::{Mutex, watch};
use tracing::{info, warn};

use crate::acks::Acks;
use crate::convert::received;
use crate::error::{connection_error, queue_error, short};
use crate::link::Link;
use crate::tag::AmqpTag;
use crate::undecodable;

/// Opens a channel on `connection` with `prefetch` and consumes `queue` on it, within
/// `timeout` (channel, `basic.qos` and `basic.consume`).
pub(crate) async fn open(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
    timeout: Duration,
) -> Result<(Channel, String, Consumer), TransportError> {
    tokio::time::timeout(timeout, open_now(connection, queue, prefetch))
        .await
        .map_err(|_| TransportError::Timeout {
            operation: "opening a consuming channel",
            after: timeout,
        })?
}

async fn open_now(
    connection: &Connection,
    queue: &str,
    prefetch: u16,
) -> Result<(Channel, String, Consumer), TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(connection_error)?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .map_err(connection_error)?;
    let consumer_tag = format!("retry-{}-{}", queue, channel.id());
    let consumer = channel
        .basic_consume(
            short(queue)?,
            short(&consumer_tag)?,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| queue_error(queue, e))?;
    Ok((channel, consumer_tag, consumer))
}

/// A subscription to one queue, made by
/// [`AmqpTransport::consume`](retry_core::Transport::consume): a channel with its own
/// prefetch (`basic.qos`), its own consumer and its own acknowledgement batching.
///
/// Acknowledgements of its deliveries are batched with `multiple` over finished prefixes of
/// tags and sent when the finished deliveries fill half the prefetch window or are at least
/// as many as the places in the window still free (at once, when deliveries waiting on
/// their clones' confirms fill it), on the transport's flush interval, on
/// [`flush`](Subscription::flush), and when the transport is closed. Dropping it closes its
/// channel, which returns every delivery it holds unsettled (prefetched and never received,
/// or acknowledged but not yet sent) to the queue: [`flush`](Subscription::flush) first, as
/// the consumer does before it returns.
///
/// When the transport had to replace its connection (lapin's recovery stalled), the
/// subscription consumes again on a channel of the new connection, by itself, and starts a
/// new acknowledgement epoch: a delivery received before is never settled on the new
/// channel.
///
/// ```no_run
/// use retry_core::{Settlement, Subscription, Transport};
/// use transport_amqp091::{AmqpConfig, AmqpTransport};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
/// let comments = transport.consume("comments", 20).await?;
/// while let Some(delivery) = comments.recv().await? {
///     println!("{} bytes", delivery.message.body().len());
///     transport.settle(&delivery.tag, Settlement::Ack).await?;
/// }
/// comments.flush().await?; // the batched acks are on the wire
/// # Ok(()) }
/// ```
pub struct AmqpSubscription {
    queue: String,
    prefetch: u16,
    consumer_tag: StdMutex<String>,
    channel: StdMutex<Channel>,
    live: Mutex<Live>,
    acks: Arc<Acks>,
    link: Arc<Link>,
    cancelled: AtomicBool,
    /// The consumer's stream has ended: after a cancel, or the broker cancelled it.
    ended: AtomicBool,
    /// Whether the queue dead-letters into a parking queue: a delivery the tap kept from
    /// lapin is then rejected here, not handed out (see the `undecodable` module).
    dead_letters_undecodable: bool,
}

/// What `recv` reads from: the consumer, and the connection replacements it follows.
struct Live {
    consumer: Consumer,
    replacements: watch::Receiver<u64>,
}

impl std::fmt::Debug for AmqpSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSubscription")
            .field("queue", &self.queue)
            .field("consumer_tag", &*self.lock_tag())
            .field("channel", &self.channel_id())
            .finish_non_exhaustive()
    }
}

impl AmqpSubscription {
    pub(crate) fn new(
        queue: String,
        prefetch: u16,
        (channel, consumer_tag, consumer): (Channel, String, Consumer),
        acks: Arc<Acks>,
        link: Arc<Link>,
        dead_letters_undecodable: bool,
    ) -> Self {
        let mut replacements = link.replacements();
        replacements.mark_unchanged();
        AmqpSubscription {
            queue,
            prefetch,
            consumer_tag: StdMutex::new(consumer_tag),
            channel: StdMutex::new(channel),
            live: Mutex::new(Live {
                consumer,
                replacements,
            }),
            acks,
            link,
            cancelled: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            dead_letters_undecodable,
        }
    }

    fn lock_tag(&self) -> std::sync::MutexGuard<'_, String> {
        self.consumer_tag.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn channel(&self) -> Channel {
        self.channel
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Consumes again on a channel of the transport's new connection. If that fails, the
    /// replacement stays unseen, so the next `recv` tries again rather than wait on the old
    /// connection's consumer.
    async fn resubscribe(&self, live: &mut Live) -> Result<(), TransportError> {
        live.replacements.mark_unchanged();
        let timeout = self.link.config().request_timeout();
        let opened = open(&self.link.get(), &self.queue, self.prefetch, timeout).await;
        let (channel, tag, consumer) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                live.replacements.mark_changed();
                return Err(e);
            }
        };
        self.acks.new_epoch();
        info!(queue = %self.queue, channel = channel.id(), "consuming again on the new connection");
        *self.channel.lock().unwrap_or_else(|e| e.into_inner()) = channel;
        *self.lock_tag() = tag;
        live.consumer = consumer;
        Ok(())
    }

    /// The queue it consumes.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The id of its channel.
    pub fn channel_id(&self) -> u16 {
        self.channel().id()
    }
}

#[async_trait]
impl Subscription for AmqpSubscription {
    type Tag = AmqpTag;

    /// After a cancel, the deliveries lapin received before the broker's `cancel-ok` still
    /// come, then `Ok(None)`: a consumer that stops can run what it was given rather than
    /// send it back redelivered.
    async fn recv(&self) -> Result<Option<Delivery<AmqpTag>>, TransportError> {
        let mut guard = self.live.lock().await;
        let live = &mut *guard;
        loop {
            if self.ended.load(Ordering::Acquire) {
                return Ok(None);
            }
            let cancelled = self.cancelled.load(Ordering::Acquire);
            // Acks not yet due are sent by the flusher within its interval, so a broker
            // holding deliveries back for them is never kept waiting for long.
            let next = tokio::select! {
                next = live.consumer.next() => next,
                _ = live.replacements.changed() => {
                    if cancelled {
                        // Its channel is gone, and what it held went back with it.
                        self.ended.store(true, Ordering::Release);
                        return Ok(None);
                    }
                    self.resubscribe(live).await?;
                    continue;
                }
            };
            let delivery = match next {
                None => {
                    self.ended.store(true, Ordering::Release);
                    return Ok(None);
                }
                Some(Err(_)) if cancelled => {
                    self.ended.store(true, Ordering::Release);
                    return Ok(None);
                }
                Some(Err(err)) => {
                    warn!(queue = %self.queue, error = %err, "consuming channel lost; waiting for recovery");
                    let channel = self.channel();
                    tokio::select! {
                        recovered = channel.wait_for_recovery(err) => {
                            recovered.map_err(connection_error)?;
                        }
                        _ = live.replacements.changed() => self.resubscribe(live).await?,
                    }
                    continue;
                }
                Some(Ok(d)) => d,
            };
            let delivery = received(
                delivery,
                &self.queue,
                Some(self.link.refusals()),
                |delivery_tag, acker| {
                    let epoch = self.acks.received(delivery_tag, acker);
                    AmqpTag::batched(Arc::clone(&self.acks), epoch, delivery_tag)
                },
            );
            match undecodable::unless_parked(&self.queue, delivery, self.dead_letters_undecodable)
                .await
            {
                Some(delivery) => return Ok(Some(delivery)),
                None => continue,
            }
        }
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        if self.cancelled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let tag = self.lock_tag().clone();
        self.channel()
            .basic_cancel(short(&tag)?, BasicCancelOptions::default())
            .await
            .map_err(connection_error)?;
        info!(queue = %self.queue, "stopped consuming");
        Ok(())
    }

    async fn flush(&self) -> Result<(), TransportError> {
        self.acks.flush().await
    }
}

impl Drop for AmqpSubscription {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let channel = self.channel();
        runtime.spawn(async move {
            if channel.status().connected() {
                let _ = channel.close(200, "subscription dropped".into()).await;
            }
        });
    }
}
