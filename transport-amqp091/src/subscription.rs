//! `AmqpSubscription`: one consumer on a channel of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::BasicCancelOptions;
use lapin::{Channel, Consumer};
use retry_core::{Delivery, Subscription, TransportError};
use tokio::sync::Mutex;
use tracing::{info, warn};

use crate::acks::Acks;
use crate::convert::received;
use crate::error::{connection_error, short};
use crate::tag::AmqpTag;

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
    consumer_tag: String,
    channel: Channel,
    consumer: Mutex<Consumer>,
    acks: Arc<Acks>,
    cancelled: AtomicBool,
}

impl std::fmt::Debug for AmqpSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSubscription")
            .field("queue", &self.queue)
            .field("consumer_tag", &self.consumer_tag)
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

impl AmqpSubscription {
    pub(crate) fn new(
        queue: String,
        consumer_tag: String,
        channel: Channel,
        consumer: Consumer,
        acks: Arc<Acks>,
    ) -> Self {
        AmqpSubscription {
            queue,
            consumer_tag,
            channel,
            consumer: Mutex::new(consumer),
            acks,
            cancelled: AtomicBool::new(false),
        }
    }

    /// The queue it consumes.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The id of its channel.
    pub fn channel_id(&self) -> u16 {
        self.channel.id()
    }
}

#[async_trait]
impl Subscription for AmqpSubscription {
    type Tag = AmqpTag;

    async fn recv(&self) -> Result<Option<Delivery<AmqpTag>>, TransportError> {
        let mut consumer = self.consumer.lock().await;
        loop {
            if self.cancelled.load(Ordering::Acquire) {
                return Ok(None);
            }
            // Acks not yet due are sent by the flusher within its interval, so a broker
            // holding deliveries back for them is never kept waiting for long.
            let delivery = match consumer.next().await {
                None => return Ok(None),
                Some(Err(err)) => {
                    warn!(queue = %self.queue, error = %err, "consuming channel lost; waiting for recovery");
                    self.channel
                        .wait_for_recovery(err)
                        .await
                        .map_err(connection_error)?;
                    continue;
                }
                Some(Ok(d)) => d,
            };
            return Ok(Some(received(
                delivery,
                &self.queue,
                |delivery_tag, acker| {
                    let epoch = self.acks.received(delivery_tag, acker);
                    AmqpTag::batched(Arc::clone(&self.acks), epoch, delivery_tag)
                },
            )));
        }
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        if self.cancelled.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.channel
            .basic_cancel(short(&self.consumer_tag)?, BasicCancelOptions::default())
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
        let channel = self.channel.clone();
        runtime.spawn(async move {
            if channel.status().connected() {
                let _ = channel.close(200, "subscription dropped".into()).await;
            }
        });
    }
}
