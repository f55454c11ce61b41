//! [`NatsSubscription`]: a durable pull consumer read with pulls sized to the free prefetch.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::Context;
use async_trait::async_trait;
use retry_core::{Delivery, Subscription, TransportError};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};

use crate::connection::Receiver;
use crate::delivery::delivery_of;
use crate::pull::{Pull, Pulled};
use crate::tag::{Keeper, NatsTag};

/// A running subscription to one queue's durable consumer, made by
/// [`consume`](retry_core::Transport::consume).
///
/// A task pulls for it: each pull asks for as many messages as the prefetch has free slots
/// and waits at most the pull wait, so the subscription never holds more than `prefetch`
/// unsettled deliveries, and none waits in a client buffer where a cancel would strand it.
/// [`cancel`](Subscription::cancel) stops new pulls; what the last pull brings is still
/// received, then [`recv`](Subscription::recv) answers `None`.
pub struct NatsSubscription {
    deliveries: Mutex<mpsc::Receiver<Result<Delivery<NatsTag>, TransportError>>>,
    cancel: watch::Sender<bool>,
    /// Where its deliveries' acks go.
    receiver: Arc<Receiver>,
    queue: String,
}

impl std::fmt::Debug for NatsSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSubscription")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Pulling {
    /// What pulls are made on, and deliveries settled and kept alive through: the
    /// connection that brought them.
    pub receiver: Arc<Receiver>,
    /// What the deliveries' acks go through.
    pub js: Context,
    pub queue: String,
    pub prefetch: u16,
    pub pull_wait: Duration,
    pub ack_wait: Duration,
    pub operation_timeout: Duration,
    /// Bumped at each reconnection.
    pub reconnects: watch::Receiver<u64>,
    /// Where a queue is named for a quarantine sweep.
    pub sweeps: mpsc::UnboundedSender<String>,
}

impl NatsSubscription {
    pub(crate) fn start(p: Pulling) -> (Self, tokio::task::AbortHandle) {
        let (tx, rx) = mpsc::channel(usize::from(p.prefetch.max(1)));
        let (cancel, cancelled) = watch::channel(false);
        let subscription = NatsSubscription {
            deliveries: Mutex::new(rx),
            cancel,
            receiver: Arc::clone(&p.receiver),
            queue: p.queue.clone(),
        };
        let task = tokio::spawn(pull(p, tx, cancelled));
        (subscription, task.abort_handle())
    }
}

async fn pull(
    mut p: Pulling,
    tx: mpsc::Sender<Result<Delivery<NatsTag>, TransportError>>,
    mut cancelled: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(usize::from(p.prefetch.max(1))));
    let (mut kept_on, first_client) = p.receiver.client();
    let keeper = Keeper::start(first_client, p.ack_wait / 3);
    let mut failures = 0u32;
    loop {
        if *cancelled.borrow() {
            return;
        }
        // One free slot at least, then every one free now.
        let first = tokio::select! {
            permit = Arc::clone(&slots).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
            _ = cancelled.changed() => return,
        };
        p.reconnects.borrow_and_update();
        let mut permits = vec![first];
        while let Ok(permit) = Arc::clone(&slots).try_acquire_owned() {
            permits.push(permit);
        }
        let (generation, receiver) = p.receiver.client();
        if generation != kept_on {
            keeper.use_client(receiver.clone());
            kept_on = generation;
        }
        let pulled = Pull::start(
            &receiver,
            &p.js,
            &p.queue,
            permits.len(),
            p.pull_wait,
            p.operation_timeout,
        )
        .await;
        let mut pull = match pulled {
            Ok(pull) => pull,
            Err(why) => {
                p.receiver.revive(generation).await;
                if tx.send(Err(why)).await.is_err() {
                    return;
                }
                failures += 1;
                tokio::time::sleep(Duration::from_millis(100 * u64::from(failures.min(20)))).await;
                continue;
            }
        };
        failures = 0;
        loop {
            let item = tokio::select! {
                item = pull.next() => item,
                // The pull was made on a connection that is gone: pull again on the new one.
                changed = p.reconnects.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    break;
                }
            };
            let message = match item {
                Pulled::Message(m) => m,
                Pulled::Misread => {
                    let _ = p.sweeps.send(p.queue.clone());
                    continue;
                }
                Pulled::End | Pulled::Unanswered => break,
                Pulled::Lost => {
                    p.receiver.revive(generation).await;
                    break;
                }
                Pulled::Failed(why) => {
                    if tx.send(Err(why)).await.is_err() {
                        return;
                    }
                    break;
                }
            };
            let permit = permits.pop();
            match delivery_of(
                &receiver,
                message,
                &p.queue,
                false,
                p.operation_timeout,
                permit,
            ) {
                Ok(delivery) => {
                    delivery.tag.kept_by(&keeper);
                    if tx.send(Ok(delivery)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Subscription for NatsSubscription {
    type Tag = NatsTag;

    async fn recv(&self) -> Result<Option<Delivery<NatsTag>>, TransportError> {
        let mut deliveries = self.deliveries.lock().await;
        match deliveries.recv().await {
            Some(Ok(d)) => Ok(Some(d)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.cancel.send_replace(true);
        Ok(())
    }

    async fn flush(&self) -> Result<(), TransportError> {
        let (_, client) = self.receiver.client();
        client.flush().await.map_err(|e| {
            TransportError::connection_failed(format!("flushing acks of {}", self.queue), e)
        })
    }
}
