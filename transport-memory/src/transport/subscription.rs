//! `MemorySubscription`: one consumer on a [`MemoryTransport`]'s connection.
//!
//! [`MemoryTransport`]: crate::MemoryTransport

use std::fmt;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use async_trait::async_trait;
use retry_core::{Delivery, Subscription, TransportError};

use crate::broker::Broker;
use crate::broker::connections::Recv;
use crate::transport::delivery::{DeliveryTag, receive};
use crate::transport::link::{Link, lock_link};

/// A consumer of one queue on a [`MemoryTransport`]'s connection, with its own prefetch.
/// Made by [`Transport::consume`]; it follows its transport to a recovered connection.
///
/// [`MemoryTransport`]: crate::MemoryTransport
/// [`Transport::consume`]: retry_core::Transport::consume
pub struct MemorySubscription {
    broker: Broker,
    link: Arc<Mutex<Link>>,
    index: usize,
}

impl fmt::Debug for MemorySubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let link = lock_link(&self.link);
        let sub = &link.subscriptions[self.index];
        f.debug_struct("MemorySubscription")
            .field("queue", &sub.queue)
            .field("prefetch", &sub.prefetch)
            .field("connection", &sub.connection)
            .finish()
    }
}

impl MemorySubscription {
    pub(crate) fn new(broker: Broker, link: Arc<Mutex<Link>>, index: usize) -> Self {
        MemorySubscription {
            broker,
            link,
            index,
        }
    }

    /// The next delivery if one is waiting, without waiting: for tests that drive the
    /// broker by hand. `Ok(None)` when nothing is waiting. Does not recover a closed
    /// connection.
    pub fn try_recv(&self) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        let link = lock_link(&self.link);
        let sub = &link.subscriptions[self.index];
        let mut state = self.broker.shared.lock();
        if let Some(reason) = state.connections().closed(sub.connection) {
            return Err(TransportError::connection_lost(reason.to_string()));
        }
        match state.recv(sub.connection, sub.consumer, None, receive) {
            Recv::Delivery(d) => Ok(Some(d)),
            Recv::Ended | Recv::Pending => Ok(None),
        }
    }

    /// Polls for a delivery. A closed connection is reported once, then recovered.
    fn poll_recv(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<Option<Delivery<DeliveryTag>>, TransportError>> {
        let mut link = lock_link(&self.link);
        self.broker.shared.with(|s| {
            let sub = &mut link.subscriptions[self.index];
            if let Some(reason) = s.connections().closed(sub.connection) {
                if sub.cancelled {
                    // Cancelled, and what it held went back with the connection.
                    return Poll::Ready(Ok(None));
                }
                let reason = reason.to_string();
                if !sub.close_reported {
                    sub.close_reported = true;
                    return Poll::Ready(Err(TransportError::connection_lost(reason)));
                }
                if !link.recover {
                    return Poll::Ready(Err(TransportError::connection_lost(reason)));
                }
                if s.connections().closed(link.id).is_some()
                    && let Err(e) = link.recover(s)
                {
                    return Poll::Ready(Err(e));
                }
            }
            let sub = &link.subscriptions[self.index];
            match s.recv(sub.connection, sub.consumer, Some(cx.waker()), receive) {
                Recv::Delivery(d) => Poll::Ready(Ok(Some(d))),
                // Cancelled, by the client once its inbox is empty, or by the broker (its
                // queue was deleted, say).
                Recv::Ended => Poll::Ready(Ok(None)),
                Recv::Pending => Poll::Pending,
            }
        })
    }
}

#[async_trait]
impl Subscription for MemorySubscription {
    type Tag = DeliveryTag;

    async fn recv(&self) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        futures::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        let mut link = lock_link(&self.link);
        let sub = &mut link.subscriptions[self.index];
        sub.cancelled = true;
        let (conn, ci) = (sub.connection, sub.consumer);
        self.broker.shared.with(|s| {
            if let Some(reason) = s.connections().closed(conn) {
                return Err(TransportError::connection_lost(reason.to_string()));
            }
            s.cancel(conn, ci);
            Ok(())
        })
    }

    /// Settlements are applied when made: nothing waits to be sent.
    async fn flush(&self) -> Result<(), TransportError> {
        Ok(())
    }
}
