//! `ChannelWalk`: the AMQP 0-9-1 transport's walk of a queue, on a channel of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use lapin::options::{BasicGetOptions, BasicNackOptions};
use lapin::types::ShortString;
use lapin::{Channel, Connection};
use retry_core::{Delivery, QueueWalk, TransportError};

use crate::convert::received;
use crate::error::{connection_error, queue_error, short};
use crate::tag::AmqpTag;

/// A walk of one queue with `basic.get` on a channel used for nothing else.
///
/// A delivery left costs only its delivery tag: tags grow on a channel, and every
/// delivery the walk took was acknowledged before the next `basic.get`, so one
/// `basic.nack` with `multiple` and `requeue` on the highest tag left puts back exactly the
/// deliveries left, in their places. Dropping the walk drops its channel, which lapin then
/// closes, and the broker puts back whatever it still held.
pub(crate) struct ChannelWalk {
    channel: Option<Channel>,
    queue: String,
    name: ShortString,
    /// The highest delivery tag left.
    last_left: Option<u64>,
    /// The highest delivery tag read: a recovered channel numbers from 1 again.
    last_read: u64,
    /// Set once the walk saw its channel recovered.
    broken: bool,
    recoveries: Arc<AtomicU64>,
    recoveries_at_start: u64,
}

impl ChannelWalk {
    /// Opens the walk's channel on `connection`; `recoveries` counts the connection's
    /// recoveries, which end the walk.
    pub(crate) async fn open(
        connection: &Connection,
        queue: &str,
        recoveries: Arc<AtomicU64>,
    ) -> Result<Self, TransportError> {
        let name = short(queue)?;
        let channel = connection
            .create_channel()
            .await
            .map_err(connection_error)?;
        let recoveries_at_start = recoveries.load(Ordering::Relaxed);
        Ok(ChannelWalk {
            channel: Some(channel),
            queue: queue.to_owned(),
            name,
            last_left: None,
            last_read: 0,
            broken: false,
            recoveries,
            recoveries_at_start,
        })
    }

    /// Whether the connection was re-established since the walk started: the broker then
    /// put back everything the walk held, and tags on the recovered channel start again.
    fn recovered(&self) -> bool {
        self.broken || self.recoveries.load(Ordering::Relaxed) != self.recoveries_at_start
    }

    fn ended_by_recovery(&self) -> TransportError {
        TransportError::connection_lost(format!(
            "the walk of {:?} ended: the connection was re-established and the broker put back every message the walk held",
            self.queue
        ))
    }
}

#[async_trait]
impl QueueWalk<AmqpTag> for ChannelWalk {
    async fn next(&mut self) -> Result<Option<Delivery<AmqpTag>>, TransportError> {
        let Some(channel) = self.channel.as_ref().filter(|_| !self.recovered()) else {
            return Err(self.ended_by_recovery());
        };
        let got = channel
            .basic_get(self.name.clone(), BasicGetOptions { no_ack: false })
            .await
            .map_err(|e| queue_error(&self.queue, e))?;
        let Some(got) = got else { return Ok(None) };
        // The recovery counter can lag behind lapin's recovery; a tag that does not grow
        // cannot.
        if got.delivery.delivery_tag <= self.last_read || self.recovered() {
            self.broken = true;
            return Err(self.ended_by_recovery());
        }
        self.last_read = got.delivery.delivery_tag;
        Ok(Some(received(
            got.delivery,
            &self.queue,
            |delivery_tag, acker| AmqpTag::fetched(acker, delivery_tag),
        )))
    }

    fn leave(&mut self, tag: AmqpTag) {
        self.last_left = self.last_left.max(Some(tag.delivery_tag()));
    }

    async fn ack(&mut self, tag: AmqpTag) -> Result<(), TransportError> {
        tag.settle(retry_core::Settlement::Ack).await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        let Some(channel) = self.channel.take() else {
            return Ok(());
        };
        let mut result = Ok(());
        if let Some(last) = self.last_left.take()
            && channel.status().connected()
            && !self.recovered()
        {
            let all_left = BasicNackOptions {
                multiple: true,
                requeue: true,
            };
            result = channel
                .basic_nack(last, all_left)
                .await
                .map_err(connection_error);
        }
        // Closing puts back anything the nack did not reach; a channel that is gone
        // already has.
        let _ = channel.close(200, "walk ended".into()).await;
        result
    }
}
