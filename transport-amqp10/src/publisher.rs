//! The publishing connection: one session, one sender per address, every send bounded by a
//! timeout and preceded by a verification of its address that is no older than the
//! re-verification age and was made on the same connection.
//!
//! It is a connection of its own, apart from the consumer's: on RabbitMQ 3.x a send refused by
//! a full `reject-publish` queue crashes the broker's session process and the whole
//! connection closes a few seconds later, with the send never answered. Kept apart, that takes
//! down only the publishing side, so the original can still be released on the consumer's
//! link and is requeued, not left to a dying connection.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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

use crate::config::{Amqp10Config, Nodes};
use crate::connection::{self, Probe, ProbeError, end_session, link_name};
use crate::profile::provision_hint;
use crate::verification::Verifications;

/// No connection has been opened yet.
const NO_GENERATION: u64 = u64::MAX;

/// The most idle probe sessions kept for the next probes: as many as a verification probes
/// at once.
const PROBE_SESSIONS_KEPT: usize = 8;

/// Sessions of the publishing connection whose probe found its address, kept for the next
/// probe instead of ended (see [`connection::probe`]): a probe then begins no session, and
/// none is ended while the connection serves sends and other probes.
#[derive(Default)]
struct IdleSessions {
    /// The connection they belong to.
    generation: u64,
    sessions: Vec<SessionHandle<()>>,
}

struct Live {
    generation: u64,
    connection: ConnectionHandle<()>,
    session: SessionHandle<()>,
    senders: HashMap<String, Arc<Mutex<Sender>>>,
}

pub(crate) struct Publisher {
    nodes: Nodes,
    config: Amqp10Config,
    live: Mutex<Option<Live>>,
    generations: AtomicU64,
    /// The generation of the connection opened last, readable without the `live` lock.
    current: AtomicU64,
    verifications: Verifications,
    /// Shared with the probes' background tasks, which give their sessions back.
    idle: Arc<std::sync::Mutex<IdleSessions>>,
}

impl Publisher {
    pub(crate) fn new(nodes: Nodes, config: Amqp10Config) -> Self {
        Publisher {
            nodes,
            config,
            live: Mutex::new(None),
            generations: AtomicU64::new(0),
            current: AtomicU64::new(NO_GENERATION),
            verifications: Verifications::default(),
            idle: Arc::default(),
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
            // Nothing is received on it: its tap has nothing to report.
            let (mut connection, _) =
                connection::open(&self.nodes, &self.config, "publisher").await?;
            let session = timeout(
                self.config.operation_timeout(),
                Session::begin(&mut connection),
            )
            .await
            .map_err(|_| TransportError::Timeout {
                operation: "beginning a session",
                after: self.config.operation_timeout(),
            })?
            .map_err(|e| {
                TransportError::connection_failed("beginning the publishing session", e)
            })?;
            let generation = self.generations.fetch_add(1, Ordering::Relaxed);
            // Every address is verified again on the new connection before a send to it.
            self.current.store(generation, Ordering::Release);
            debug!(generation, node = %self.nodes.current(), "publisher connected");
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

    /// Probes `address` now, whenever it was last verified; the connection's generation.
    pub(crate) async fn verify(&self, address: &str, how: Probe) -> Result<u64, ProbeError> {
        self.verified(address, how, true).await
    }

    /// Makes sure `address` was verified on the current connection less than the
    /// re-verification age ago, probing it if not (`force` probes anyway). Answers the
    /// generation of the connection it was verified on.
    ///
    /// Probes of one address are single-flight: a send that waited while another probed
    /// takes that probe's answer instead of probing again.
    async fn verified(&self, address: &str, how: Probe, force: bool) -> Result<u64, ProbeError> {
        let slot = self.verifications.slot(address);
        let current = || self.current.load(Ordering::Acquire);
        // Boxed, as a rare path (once per address and re-verification age): the future of
        // every send would carry the probe's otherwise.
        let probe = || async {
            // A kept session the broker ended meanwhile fails the attach as a lost session
            // would: the probe is made again, once, on a session begun for it.
            let (generation, outcome, reused) =
                Box::pin(self.probe_once(address, how, true)).await?;
            let (generation, outcome) = match outcome {
                Err(ProbeError::Failed(_)) if reused => {
                    let (generation, outcome, _) =
                        Box::pin(self.probe_once(address, how, false)).await?;
                    (generation, outcome)
                }
                outcome => (generation, outcome),
            };
            match &outcome {
                Ok(()) => debug!(address, generation, "verified"),
                Err(ProbeError::Missing(why)) => debug!(address, generation, %why, "missing"),
                Err(ProbeError::Failed(e)) => {
                    debug!(address, generation, error = %e, "probe failed");
                }
            }
            Ok((generation, outcome))
        };
        slot.verify(current, self.config.reverify_after(), force, probe)
            .await
    }

    /// Probes `address` on a kept session of the current connection (`reuse`, when there is
    /// one) or on one begun for it; the connection's generation, the broker's answer, and
    /// whether the session was a kept one. A session whose probe found its address is kept
    /// afterwards (at most [`PROBE_SESSIONS_KEPT`]).
    async fn probe_once(
        &self,
        address: &str,
        how: Probe,
        reuse: bool,
    ) -> Result<(u64, Result<(), ProbeError>, bool), TransportError> {
        let after = self.config.operation_timeout();
        // The connection is held only to begin the probe's session: sends go on while the
        // probe attaches.
        let (session, generation, reused) = {
            let mut live = self.live.lock().await;
            let current = self.ensure(&mut live).await?;
            let kept = if reuse {
                self.idle_session(current.generation)
            } else {
                None
            };
            match kept {
                Some(session) => (session, current.generation, true),
                None => {
                    let session = connection::probe_session(&mut current.connection, after).await?;
                    (session, current.generation, false)
                }
            }
        };
        let idle = Arc::clone(&self.idle);
        let keep = move |session: SessionHandle<()>| {
            let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.generation != generation || idle.sessions.len() >= PROBE_SESSIONS_KEPT {
                return Some(session);
            }
            idle.sessions.push(session);
            None
        };
        let outcome = connection::probe(session, address, how, after, keep).await;
        Ok((generation, outcome, reused))
    }

    /// A kept probe session of the connection of `generation`, if there is one; those of an
    /// earlier connection are dropped (which ends them).
    fn idle_session(&self, generation: u64) -> Option<SessionHandle<()>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.generation != generation {
            idle.generation = generation;
            idle.sessions.clear();
        }
        while let Some(session) = idle.sessions.pop() {
            if !session.is_ended() {
                return Some(session);
            }
        }
        None
    }

    async fn sender(&self, address: &str) -> Result<(Arc<Mutex<Sender>>, u64), TransportError> {
        let mut live = self.live.lock().await;
        let current = Box::pin(self.ensure(&mut live)).await?;
        if let Some(sender) = current.senders.get(address) {
            return Ok((Arc::clone(sender), current.generation));
        }
        let sender = Sender::builder()
            .name(link_name("sender"))
            .target(address)
            .attach(&mut current.session)
            .await
            .map_err(|e| TransportError::connection_failed(format!("attaching to {address}"), e))?;
        let sender = Arc::new(Mutex::new(sender));
        current
            .senders
            .insert(address.to_owned(), Arc::clone(&sender));
        Ok((sender, current.generation))
    }

    /// Sends `message` unsettled to `address` and waits for the broker's outcome, at most
    /// the publish timeout in all (connecting, verifying and waiting for link credit
    /// included).
    ///
    /// `address` is verified first (with `how`) unless it was verified on this connection
    /// less than the re-verification age ago: a missing one fails with
    /// [`TransportError::MissingAddress`], and nothing is sent.
    pub(crate) async fn send(
        &self,
        address: &str,
        how: Probe,
        message: AmqpMessage<Body<Value>>,
    ) -> PublishResult {
        let after = self.config.publish_timeout();
        let mut generation = None;
        let attempt = async {
            let verified_on = self.verified(address, how, false).await?;
            let (sender, g) = self.sender(address).await.map_err(ProbeError::Failed)?;
            generation = Some(g);
            if g != verified_on && self.verified(address, how, false).await? != g {
                return Err(ProbeError::Failed(TransportError::connection_lost(
                    format!("the publishing connection was replaced while verifying {address}"),
                )));
            }
            // The link is held only to hand the transfer over; the outcome is awaited
            // without it, so concurrent publishes to one address pipeline.
            let pending = {
                let mut sender = sender.lock().await;
                sender.send_batchable(message).await
            }
            .map_err(|e| {
                ProbeError::Failed(TransportError::connection_failed(
                    format!("sending to {address}"),
                    e,
                ))
            })?;
            pending.await.map_err(|e| {
                ProbeError::Failed(TransportError::connection_failed(
                    format!("sending to {address}"),
                    e,
                ))
            })
        };
        let result = timeout(after, attempt).await;
        match result {
            Ok(Ok(Outcome::Accepted(_))) => PublishResult::Confirmed,
            Ok(Ok(other)) => {
                debug!(address, outcome = ?other, "publish refused");
                PublishResult::Refused
            }
            Ok(Err(ProbeError::Missing(why))) => {
                PublishResult::Failed(TransportError::MissingAddress {
                    address: address.to_owned(),
                    hint: format!("{why}; {}", provision_hint(&self.config.profile())),
                })
            }
            // The connection failed us, verifying or sending: it cannot be trusted any more.
            Ok(Err(ProbeError::Failed(e))) => {
                self.discard(generation.unwrap_or_else(|| self.current.load(Ordering::Acquire)))
                    .await;
                PublishResult::Failed(e)
            }
            Err(_) => {
                self.discard(generation.unwrap_or_else(|| self.current.load(Ordering::Acquire)))
                    .await;
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
