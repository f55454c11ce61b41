//! The publishing connection: one session, one sender per address, every send bounded by a
//! timeout.
//!
//! It is a connection of its own, apart from the consumer's: on RabbitMQ 3.x a send refused by
//! a full `reject-publish` queue crashes the broker's session process and the whole
//! connection closes a few seconds later, with the send never answered. Kept apart, that takes
//! down only the publishing side, so the original can still be released on the consumer's
//! link and is requeued, not left to a dying connection.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::messaging::{Body, Message as AmqpMessage, Outcome};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Sender, Session};
use retry_core::{PublishResult, TransportError};
use tokio::sync::Mutex;
use tokio::time::timeout;
use tracing::{debug, warn};

use crate::config::{Amqp10Config, Endpoint};
use crate::connection::{self, Probe, ProbeError, end_session, link_name};

struct Live {
    generation: u64,
    connection: ConnectionHandle<()>,
    session: SessionHandle<()>,
    senders: HashMap<String, Arc<Mutex<Sender>>>,
}

pub(crate) struct Publisher {
    endpoint: Endpoint,
    config: Amqp10Config,
    live: Mutex<Option<Live>>,
    generations: std::sync::atomic::AtomicU64,
    verified: std::sync::Mutex<HashSet<String>>,
}

impl Publisher {
    pub(crate) fn new(endpoint: Endpoint, config: Amqp10Config) -> Self {
        Publisher {
            endpoint,
            config,
            live: Mutex::new(None),
            generations: std::sync::atomic::AtomicU64::new(0),
            verified: std::sync::Mutex::new(HashSet::new()),
        }
    }

    /// Opens the connection now, so that a wrong URL or password shows at once.
    pub(crate) async fn connect(&self) -> Result<(), TransportError> {
        let mut live = self.live.lock().await;
        self.ensure(&mut live).await.map(|_| ())
    }

    async fn ensure<'a>(&self, live: &'a mut Option<Live>) -> Result<&'a mut Live, TransportError> {
        if live.as_ref().is_some_and(|l| l.session.is_ended())
            && let Some(mut stale) = live.take()
        {
            let _ = timeout(self.config.operation_timeout(), stale.connection.close()).await;
        }
        if live.is_none() {
            let mut connection =
                connection::open(&self.endpoint, &self.config, "publisher").await?;
            let session = timeout(
                self.config.operation_timeout(),
                Session::begin(&mut connection),
            )
            .await
            .map_err(|_| TransportError::Timeout {
                operation: "beginning a session",
                after: self.config.operation_timeout(),
            })?
            .map_err(|e| TransportError::Connection(e.to_string()))?;
            let generation = self
                .generations
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            debug!(generation, broker = %self.endpoint.redacted, "publisher connected");
            *live = Some(Live {
                generation,
                connection,
                session,
                senders: HashMap::new(),
            });
        }
        live.as_mut().ok_or(TransportError::Closed)
    }

    /// Drops the connection of `generation` if it is still the current one: a send on it went
    /// unanswered, so it cannot be trusted any more.
    async fn discard(&self, generation: u64) {
        let mut live = self.live.lock().await;
        if live.as_ref().is_some_and(|l| l.generation == generation)
            && let Some(mut stale) = live.take()
        {
            warn!(
                generation,
                "dropping the publishing connection after a failed send"
            );
            for (_, sender) in stale.senders.drain() {
                if let Ok(sender) = Arc::try_unwrap(sender) {
                    let _ = timeout(Duration::from_millis(200), sender.into_inner().detach()).await;
                }
            }
            let _ = timeout(Duration::from_millis(500), stale.connection.close()).await;
        }
    }

    /// Whether `address` was verified on this transport.
    pub(crate) fn is_verified(&self, address: &str) -> bool {
        self.verified
            .lock()
            .map(|v| v.contains(address))
            .unwrap_or(false)
    }

    /// Checks that `address` exists, on a session of its own.
    pub(crate) async fn verify(&self, address: &str, how: Probe) -> Result<(), ProbeError> {
        if self.is_verified(address) {
            return Ok(());
        }
        let mut live = self.live.lock().await;
        let current = self.ensure(&mut live).await.map_err(ProbeError::Failed)?;
        connection::probe(
            &mut current.connection,
            address,
            how,
            self.config.operation_timeout(),
        )
        .await?;
        if let Ok(mut v) = self.verified.lock() {
            v.insert(address.to_owned());
        }
        Ok(())
    }

    async fn sender(&self, address: &str) -> Result<(Arc<Mutex<Sender>>, u64), TransportError> {
        let mut live = self.live.lock().await;
        let current = self.ensure(&mut live).await?;
        if let Some(sender) = current.senders.get(address) {
            return Ok((Arc::clone(sender), current.generation));
        }
        let sender = Sender::builder()
            .name(link_name("sender"))
            .target(address)
            .attach(&mut current.session)
            .await
            .map_err(|e| TransportError::Connection(format!("attaching to {address}: {e}")))?;
        let sender = Arc::new(Mutex::new(sender));
        current
            .senders
            .insert(address.to_owned(), Arc::clone(&sender));
        Ok((sender, current.generation))
    }

    /// Sends `message` unsettled and waits for the broker's outcome, at most the publish
    /// timeout in all (connecting and waiting for link credit included).
    pub(crate) async fn send(
        &self,
        address: &str,
        message: AmqpMessage<Body<Value>>,
    ) -> PublishResult {
        let after = self.config.publish_timeout();
        let mut generation = None;
        let attempt = async {
            let (sender, g) = self.sender(address).await?;
            generation = Some(g);
            // The link is held only to hand the transfer over; the outcome is awaited
            // without it, so concurrent publishes to one address pipeline.
            let pending = {
                let mut sender = sender.lock().await;
                sender.send_batchable(message).await
            }
            .map_err(|e| TransportError::Connection(format!("sending to {address}: {e}")))?;
            pending
                .await
                .map_err(|e| TransportError::Connection(format!("sending to {address}: {e}")))
        };
        let result = timeout(after, attempt).await;
        match result {
            Ok(Ok(Outcome::Accepted(_))) => PublishResult::Confirmed,
            Ok(Ok(other)) => {
                debug!(address, outcome = ?other, "publish refused");
                PublishResult::Refused
            }
            Ok(Err(e)) => {
                if let Some(g) = generation {
                    self.discard(g).await;
                }
                PublishResult::Failed(e)
            }
            Err(_) => {
                if let Some(g) = generation {
                    self.discard(g).await;
                }
                PublishResult::Failed(TransportError::Timeout {
                    operation: "publish",
                    after,
                })
            }
        }
    }

    pub(crate) async fn close(&self) {
        let mut live = self.live.lock().await;
        if let Some(mut current) = live.take() {
            let after = self.config.operation_timeout();
            for (_, sender) in current.senders.drain() {
                if let Ok(sender) = Arc::try_unwrap(sender) {
                    let _ = timeout(after, sender.into_inner().detach()).await;
                }
            }
            let _ = timeout(after, async {
                end_session(&mut current.session).await;
                current.connection.close().await
            })
            .await;
        }
    }
}
