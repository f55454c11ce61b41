//! The transport's two connections: one that pulls, and one for everything else.
//!
//! async-nats parses each incoming message's header block on the task that runs its
//! connection. A block it refuses fails that connection (the client reconnects); a header
//! value holding a bare carriage return makes it panic, which ends the task for good: the
//! client then never sends or receives again, reports no event, and its state still says
//! connected. Only pulls bring stored messages in, so pulls get a connection of their own,
//! the [`Receiver`]: a hostile message takes down at most that one, never the connection
//! the transport publishes clones and parked copies, and asks the API, on (the sweep
//! included), and a receiver whose task died is replaced by a new connection. A
//! subscription's acks and keep-alives go out on the connection its deliveries came on: on
//! the other one they cost the success path an eighth of its throughput here (two
//! connection tasks to wake per message instead of one).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use async_nats::client::FlushErrorKind;
use async_nats::{Client, ConnectOptions, ServerAddr};
use retry_core::TransportError;
use tokio::sync::watch;
use tracing::{error, info, warn};
use transport_kit::settings::NodeOrder;

use crate::config::NatsConfig;
use crate::provision::bounded;

/// How long a look at whether a client still works may take: a working one answers a
/// flush in a round trip; one reconnecting holds it, and is not dead.
const LIVENESS_WAIT: Duration = Duration::from_millis(500);

/// What each connection reports.
#[derive(Clone)]
pub(crate) struct Events {
    /// Bumped each time the receiving connection is (re)established: a pull made on the
    /// lost connection can never be answered, and waiting out its expiry would stall.
    pub reconnects: watch::Sender<u64>,
    /// Connections lost, of either kind, and receivers replaced.
    pub losses: Arc<AtomicU64>,
}

/// Which of the two connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Publishes, API requests, the acks of fetched and moved messages.
    Control,
    /// Pulls, and the acks and keep-alives of a subscription's deliveries.
    Receiver,
}

impl Role {
    fn label(self) -> &'static str {
        match self {
            Role::Control => "control",
            Role::Receiver => "pulls",
        }
    }
}

/// Connects `role`'s connection to `nodes`.
pub(crate) async fn connect(
    config: &NatsConfig,
    nodes: Vec<ServerAddr>,
    role: Role,
    events: &Events,
) -> Result<Client, TransportError> {
    let (bump, lost, shown) = (
        events.reconnects.clone(),
        Arc::clone(&events.losses),
        config.url(),
    );
    let mut options = ConnectOptions::new()
        .connection_timeout(config.settings().connect_timeout())
        .request_timeout(Some(config.operation_timeout()))
        .event_callback(move |event| {
            let (bump, lost, shown) = (bump.clone(), Arc::clone(&lost), shown.clone());
            async move {
                let connection = role.label();
                match event {
                    async_nats::Event::Connected => {
                        if role == Role::Receiver {
                            bump.send_modify(|n| *n += 1);
                        }
                        info!(url = %shown, connection, "NATS connection (re)established");
                    }
                    async_nats::Event::Disconnected => {
                        lost.fetch_add(1, Ordering::Relaxed);
                        warn!(url = %shown, connection, "NATS connection lost; reconnecting");
                    }
                    _ => {}
                }
            }
        });
    if config.settings().node_order() == NodeOrder::InOrder {
        options = options.retain_servers_order();
    }
    if let Some(name) = config.name() {
        options = options.name(match role {
            Role::Control => name.to_owned(),
            Role::Receiver => format!("{name} (pulls)"),
        });
    }
    let url = config.url();
    bounded(
        config.settings().connect_timeout(),
        "connecting to NATS",
        options.connect(nodes),
    )
    .await?
    .map_err(|e| TransportError::connection_failed(format!("connecting to {url}"), e))
}

/// The connection pulls are made on, replaced when async-nats' task for it dies.
pub(crate) struct Receiver {
    config: NatsConfig,
    nodes: Vec<ServerAddr>,
    events: Events,
    /// The client, and how many times it was replaced.
    current: RwLock<(u64, Client)>,
    /// Held while a replacement is made, so that one is made at a time.
    replacing: tokio::sync::Mutex<()>,
}

impl Receiver {
    pub(crate) async fn connect(
        config: &NatsConfig,
        nodes: Vec<ServerAddr>,
        events: Events,
    ) -> Result<Receiver, TransportError> {
        let client = connect(config, nodes.clone(), Role::Receiver, &events).await?;
        Ok(Receiver {
            config: config.clone(),
            nodes,
            events,
            current: RwLock::new((0, client)),
            replacing: tokio::sync::Mutex::new(()),
        })
    }

    /// The client to pull with, and its generation, for [`revive`](Self::revive).
    pub(crate) fn client(&self) -> (u64, Client) {
        match self.current.read() {
            Ok(current) => (current.0, current.1.clone()),
            Err(poisoned) => {
                let current = poisoned.into_inner();
                (current.0, current.1.clone())
            }
        }
    }

    /// Called when a pull could not be made or its subscription ended: if the client of
    /// `generation` no longer works at all (its connection task is gone), a new connection
    /// takes its place, and its establishment bumps the reconnection count, which starts a
    /// sweep. Answers whether the receiver was replaced, by this call or another.
    pub(crate) async fn revive(&self, generation: u64) -> bool {
        let _one_at_a_time = self.replacing.lock().await;
        let (current, client) = self.client();
        if current != generation {
            return true;
        }
        let dead = match tokio::time::timeout(LIVENESS_WAIT, client.flush()).await {
            Ok(Err(e)) => e.kind() == FlushErrorKind::SendError,
            // Answered, or held while it reconnects: alive.
            Ok(Ok(())) | Err(_) => false,
        };
        if !dead {
            return false;
        }
        error!(url = %self.config.url(), "the NATS client's connection task died (async-nats panics on a header value holding a carriage return); connecting again");
        match connect(
            &self.config,
            self.nodes.clone(),
            Role::Receiver,
            &self.events,
        )
        .await
        {
            Ok(fresh) => {
                self.events.losses.fetch_add(1, Ordering::Relaxed);
                let mut current = match self.current.write() {
                    Ok(current) => current,
                    Err(poisoned) => poisoned.into_inner(),
                };
                *current = (generation + 1, fresh);
                true
            }
            Err(e) => {
                error!(
                    error = &e as &dyn std::error::Error,
                    "connecting a new receiving connection failed; trying again at the next pull"
                );
                false
            }
        }
    }

    /// Stops the client.
    pub(crate) async fn close(&self) {
        let (_, client) = self.client();
        let _ = tokio::time::timeout(Duration::from_secs(5), client.drain()).await;
    }
}
