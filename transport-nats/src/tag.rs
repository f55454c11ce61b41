//! [`NatsTag`]: how one delivery is settled, and what it holds while unsettled.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::{Client, Subject};
use bytes::Bytes;
use retry_core::{Settlement, TransportError};
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::AbortHandle;

/// The handle that settles one delivery: the delivery's reply subject (JetStream's ack
/// address) for a subscription's or a fetch's delivery, or a stream and sequence for a
/// message a walk read from storage.
#[derive(Clone)]
pub struct NatsTag(pub(crate) Arc<TagState>);

pub(crate) struct TagState {
    pub kind: TagKind,
    /// Tells the server the handler still works on it (`+WPI`) until it is settled.
    pub keeper: Mutex<KeepAlive>,
    /// The subscription's prefetch slot it holds.
    pub permit: Mutex<Option<OwnedSemaphorePermit>>,
}

// A tag is one allocation (an `Arc`) either way; boxing the larger variant saves nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum TagKind {
    /// A delivery of a consumer: settled by a reply to its ack subject.
    Delivered {
        client: Client,
        reply: Subject,
        stream: String,
        sequence: u64,
        /// Fetched alone (the isolation lane): settled with a double ack, at once.
        fetched: bool,
        timeout: Duration,
    },
    /// A stored message a walk read: acking deletes it, anything else leaves it.
    Stored { queue: String, sequence: u64 },
}

/// What keeps an unsettled delivery alive on the server.
#[derive(Default)]
pub(crate) enum KeepAlive {
    #[default]
    None,
    /// A task of its own (a fetched delivery).
    Task(AbortHandle),
    /// Its subscription's [`Keeper`], under this key.
    Shared(Arc<Keeper>, u64),
}

impl KeepAlive {
    fn stop(self) {
        match self {
            KeepAlive::None => {}
            KeepAlive::Task(task) => task.abort(),
            KeepAlive::Shared(keeper, key) => {
                if let Ok(mut unsettled) = keeper.unsettled.lock() {
                    unsettled.remove(&key);
                }
            }
        }
    }
}

/// Tells the server, every period, that each unsettled delivery of one subscription is
/// still being worked on (`+WPI`): one task for all of them rather than one per delivery,
/// which cost a task and a timer per message. A delivery's first `+WPI` comes at most one
/// period after it arrived, and then every period, as with a task of its own. The task
/// ends once the subscription and every delivery it handed out are gone.
pub(crate) struct Keeper {
    /// The connection the subscription's deliveries came on, which a replaced pulling
    /// connection changes.
    client: Mutex<Client>,
    next: AtomicU64,
    unsettled: Mutex<HashMap<u64, Subject>>,
}

impl Keeper {
    /// Keeps deliveries alive through `client` from now on: the one their pulls are made
    /// on.
    pub(crate) fn use_client(&self, client: Client) {
        if let Ok(mut current) = self.client.lock() {
            *current = client;
        }
    }

    pub(crate) fn start(client: Client, every: Duration) -> Arc<Keeper> {
        let keeper = Arc::new(Keeper {
            client: Mutex::new(client),
            next: AtomicU64::new(0),
            unsettled: Mutex::new(HashMap::new()),
        });
        let weak: Weak<Keeper> = Arc::downgrade(&keeper);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now() + every;
            let mut tick = tokio::time::interval_at(start, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(keeper) = weak.upgrade() else {
                    return;
                };
                let replies: Vec<Subject> = keeper
                    .unsettled
                    .lock()
                    .map(|u| u.values().cloned().collect())
                    .unwrap_or_default();
                let Ok(client) = keeper.client.lock().map(|c| c.clone()) else {
                    return;
                };
                drop(keeper);
                for reply in replies {
                    if client
                        .publish(reply, Bytes::from_static(b"+WPI"))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        });
        keeper
    }
}

impl Drop for TagState {
    fn drop(&mut self) {
        if let Ok(keeper) = self.keeper.get_mut() {
            std::mem::take(keeper).stop();
        }
    }
}

impl std::fmt::Debug for NatsTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0.kind {
            TagKind::Delivered {
                stream,
                sequence,
                fetched,
                ..
            } => write!(
                f,
                "NatsTag({stream}#{sequence}{})",
                if *fetched { ", fetched" } else { "" }
            ),
            TagKind::Stored { queue, sequence } => {
                write!(f, "NatsTag({queue}#{sequence}, stored)")
            }
        }
    }
}

impl NatsTag {
    pub(crate) fn delivered(kind: TagKind, permit: Option<OwnedSemaphorePermit>) -> Self {
        NatsTag(Arc::new(TagState {
            kind,
            keeper: Mutex::new(KeepAlive::None),
            permit: Mutex::new(permit),
        }))
    }

    /// Starts telling the server, every `every`, that the delivery is still being worked on.
    pub(crate) fn keep_alive(&self, every: Duration) {
        let TagKind::Delivered { client, reply, .. } = &self.0.kind else {
            return;
        };
        let (client, reply) = (client.clone(), reply.clone());
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if client
                    .publish(reply.clone(), Bytes::from_static(b"+WPI"))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        if let Ok(mut keeper) = self.0.keeper.lock() {
            std::mem::replace(&mut *keeper, KeepAlive::Task(task.abort_handle())).stop();
        }
    }

    /// Has its subscription's `keeper` tell the server, until it is settled, that the
    /// delivery is still being worked on.
    pub(crate) fn kept_by(&self, keeper: &Arc<Keeper>) {
        let TagKind::Delivered { reply, .. } = &self.0.kind else {
            return;
        };
        let key = keeper.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut unsettled) = keeper.unsettled.lock() {
            unsettled.insert(key, reply.clone());
        }
        if let Ok(mut kept) = self.0.keeper.lock() {
            std::mem::replace(&mut *kept, KeepAlive::Shared(Arc::clone(keeper), key)).stop();
        }
    }

    /// Stops the keep-alive and gives back the prefetch slot.
    fn release(&self) {
        if let Some(keeper) = self
            .0
            .keeper
            .lock()
            .ok()
            .map(|mut k| std::mem::take(&mut *k))
        {
            keeper.stop();
        }
        if let Ok(mut permit) = self.0.permit.lock() {
            permit.take();
        }
    }

    /// The stream, sequence and ack subject of a fetched delivery.
    pub(crate) fn fetched(&self) -> Option<(&str, u64, &Subject)> {
        match &self.0.kind {
            TagKind::Delivered {
                stream,
                sequence,
                reply,
                fetched: true,
                ..
            } => Some((stream, *sequence, reply)),
            _ => None,
        }
    }

    /// The queue and sequence of a stored message.
    pub(crate) fn stored(&self) -> Option<(&str, u64)> {
        match &self.0.kind {
            TagKind::Stored { queue, sequence } => Some((queue, *sequence)),
            TagKind::Delivered { .. } => None,
        }
    }

    /// Settles a delivery: ack `+ACK`, requeue `-NAK` (redelivered at once, counted),
    /// reject `+TERM` (never redelivered; a work-queue stream drops it). A fetched one is
    /// double-acked: the server's answer proves it has the settlement.
    pub(crate) async fn settle_delivery(
        &self,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        let TagKind::Delivered {
            client,
            reply,
            stream,
            sequence,
            fetched,
            timeout,
        } = &self.0.kind
        else {
            return Ok(());
        };
        let body = Bytes::from_static(match settlement {
            Settlement::Ack => b"+ACK",
            Settlement::Requeue => b"-NAK",
            Settlement::Reject => b"+TERM",
        });
        self.release();
        let what = || format!("settling {stream}#{sequence} ({settlement:?})");
        if *fetched {
            match tokio::time::timeout(*timeout, client.request(reply.clone(), body)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(TransportError::connection_failed(what(), e)),
                Err(_) => Err(TransportError::Timeout {
                    operation: "a double ack",
                    after: *timeout,
                }),
            }
        } else {
            client
                .publish(reply.clone(), body)
                .await
                .map_err(|e| TransportError::connection_failed(what(), e))
        }
    }
}
