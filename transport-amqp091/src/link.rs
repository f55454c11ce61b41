//! The transport's connection: opened through the node list, recovered by lapin, and
//! rebuilt when lapin's recovery stalls.
//!
//! lapin recovers a dropped connection by itself, switching node through
//! [`Nodes::stream`](crate::nodes::Nodes). One case it does not get out of, seen on RabbitMQ
//! 3.10 when a node shuts down gracefully: the node sends `connection.close` and resets the
//! socket before the client's `close-ok` is written. The `close-ok` then stays queued, lapin's
//! IO loop waits for the dead socket to drain it, and the connection stays "reconnecting"
//! forever, with no attempt or with one that never completes.
//!
//! A watchdog checks the connection every second. When it has been reconnecting (or stuck
//! in a recovery's handshake) for [`STALL`] without asking the node list for a new stream,
//! a new connection is opened on the next live node and takes the old one's place: the
//! publishing and fetching channels reopen on it as they are next used, and every
//! subscription consumes again on a channel of the new connection (see
//! `AmqpSubscription`), with a new acknowledgement epoch, so that a tag from the old
//! connection is never settled on the new one. Opening a connection takes at most the
//! connect timeout; a rebuild that fails is tried again after the maximum reconnect delay.
//!
//! A connection given up on (replaced, or not open in time) has its socket shut down and
//! every further stream refused, so that lapin's IO loop for it ends (see the `handed`
//! module); the broker has already put back what it held. The one loop this cannot reach is
//! the one stalled on a `close-ok`: it no longer waits on its socket, and its thread stays
//! blocked. Should lapin recover the old connection after all, it is closed at once, so that
//! its recovered consumers hold no deliveries nobody reads.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use futures::StreamExt;
use lapin::tcp::AsyncTcpStream;
use lapin::{Connection, ConnectionProperties, Event};
use retry_core::{TlsFailure, TransportError};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::config::AmqpConfig;
use crate::error::{closes_only_a_channel, connection_error};
use crate::handed::{Handed, refusal};
use crate::kit::TapKit;
use crate::nodes::Nodes;
use crate::tap::Refusals;
use crate::tls::{self, Tls};

/// How many rounds over the nodes a recovery makes before it gives up, each after a pause
/// that doubles up to the maximum reconnect delay: with the default 5 s, about a day.
const RECONNECT_ROUNDS: usize = 17_280;

/// How long a connection may be reconnecting without a new attempt before it is rebuilt. A
/// recovery merely slower than that (many channels on a loaded broker) is rebuilt too; the
/// old connection is then closed as soon as lapin has recovered it, and deliveries taken on
/// it in the meantime come back redelivered. At 5 s that happened under CI load; 15 s leaves
/// a loaded broker room.
pub(crate) const STALL: Duration = Duration::from_secs(15);

/// The current connection, replaced when recovery stalls.
pub(crate) struct Link {
    config: AmqpConfig,
    nodes: Arc<Nodes>,
    current: RwLock<Arc<Connection>>,
    /// The socket lapin was handed for the current connection.
    handed: std::sync::Mutex<Arc<Handed>>,
    /// Bumped each time the connection is replaced; subscriptions watch it.
    generation: watch::Sender<u64>,
    recoveries: AtomicU64,
    closed: AtomicBool,
    /// What the connections' taps kept from lapin (see the `tap` module).
    refusals: Arc<Refusals>,
}

impl Link {
    /// Asks every node of `config` for its cluster name, opens the first connection and
    /// starts watching it. A list that cannot be used or mixes clusters is refused with its
    /// [`NodeListError`](crate::NodeListError) inside [`TransportError::Other`]; when no node
    /// answers, the error names every node, with why each did not answer as its source.
    pub(crate) async fn open(config: AmqpConfig) -> Result<Arc<Self>, TransportError> {
        let invalid = |e| TransportError::Other(Box::new(e));
        let list = config.node_list().map_err(invalid)?;
        let order = config.node_order().arrange(list.len());
        let (min_delay, max_delay) = config.reconnect_delay();
        let tls = tls_settings(&config)?;
        let nodes = Arc::new(Nodes::new(
            order.iter().map(|&i| list[i].clone()).collect(),
            min_delay,
            max_delay,
            tls,
        ));
        let runtime = lapin::runtime::default_runtime().map_err(connection_error)?;
        let answers = nodes.survey(&runtime).await.map_err(invalid)?;
        if answers.iter().all(Result::is_err) {
            // A TLS refusal is a fault of the settings or of the broker's certificate, not
            // of the network: it is the error, even beside nodes that did not answer.
            if let Some(refused) = answers
                .iter()
                .filter_map(|a| a.as_ref().err())
                .find_map(|e| tls::refusal_in(e))
            {
                return Err(refused.into());
            }
            let addresses: Vec<&str> = (0..nodes.len()).map(|i| nodes.address(i)).collect();
            let mut errors: Vec<(String, std::io::Error)> = answers
                .into_iter()
                .enumerate()
                .filter_map(|(i, a)| a.err().map(|e| (nodes.address(i).to_owned(), e)))
                .collect();
            let source: Box<dyn std::error::Error + Send + Sync> = if errors.len() == 1 {
                Box::new(lapin::Error::from(errors.remove(0).1))
            } else {
                Box::new(Unanswered(errors))
            };
            return Err(TransportError::connection_failed(
                format!(
                    "cannot connect to {}: no node answers",
                    addresses.join(", ")
                ),
                source,
            ));
        }
        let refusals = Arc::new(Refusals::new());
        let (connection, handed) = connect(&config, &nodes, &refusals).await?;
        nodes.established();
        let link = Arc::new(Link {
            config,
            nodes,
            current: RwLock::new(Arc::new(connection)),
            handed: std::sync::Mutex::new(handed),
            generation: watch::Sender::new(0),
            recoveries: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            refusals,
        });
        link.watch_events();
        spawn_watchdog(Arc::downgrade(&link));
        Ok(link)
    }

    /// The connection now.
    pub(crate) fn get(&self) -> Arc<Connection> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// A receiver that sees every replacement of the connection.
    pub(crate) fn replacements(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// How many times the connection was recovered (by lapin or rebuilt).
    pub(crate) fn recoveries(&self) -> u64 {
        self.recoveries.load(Ordering::Relaxed)
    }

    /// The settings it was opened with.
    pub(crate) fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// The messages the connections' taps kept from lapin.
    pub(crate) fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// The node list.
    pub(crate) fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// Stops the watchdog and closes the connection.
    pub(crate) async fn close(&self) -> Result<(), TransportError> {
        self.closed.store(true, Ordering::Relaxed);
        let closed = self
            .get()
            .close(200, "closing".into())
            .await
            .map_err(connection_error);
        self.handed().release();
        closed
    }

    fn handed(&self) -> Arc<Handed> {
        Arc::clone(&self.handed.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Logs every loss and recovery of the current connection, and counts the recoveries.
    ///
    /// lapin reports a channel the broker closed as an error event of the connection too.
    /// That is no connection loss: the operation that made the broker close the channel has
    /// failed with the broker's reply and reports it, and some closures are expected (a
    /// passive declare of a missing object, see the `provision` module). It is logged at
    /// DEBUG only.
    fn watch_events(self: &Arc<Self>) {
        let mut events = self.get().events_listener();
        // The connection's own first `Connected` event can reach a listener made just after
        // it opened: only one after a new stream was asked for is a reconnection.
        let opened = self.nodes.attempts();
        let link = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(event) = events.next().await {
                let Some(link) = link.upgrade() else { return };
                let nodes = &link.nodes;
                let name = |i: Option<usize>| i.map_or("", |i| nodes.address(i));
                match event {
                    Event::Error(e) if closes_only_a_channel(&e) => {
                        debug!(error = %e, "the broker closed a channel");
                    }
                    Event::Error(e) => {
                        warn!(node = name(nodes.current()), error = %e, "connection lost; recovering");
                    }
                    // Every reconnection asks for a stream first; a close the broker
                    // initiates is not always preceded by an `Error` event.
                    Event::Connected if nodes.attempts() == opened => {}
                    Event::Connected => {
                        let n = link.recoveries.fetch_add(1, Ordering::Relaxed) + 1;
                        let (left, reached) = nodes.established();
                        log_recovery(n, name(left), name(reached), "lapin");
                    }
                    Event::ConnectionBlocked(reason) => warn!(reason, "broker blocked publishing"),
                    Event::ConnectionUnblocked => info!("broker unblocked publishing"),
                    _ => {}
                }
            }
        });
    }

    /// Opens a new connection and puts it in place of the stalled one, which is given up:
    /// its IO loop ends if it waits on its socket (see the `handed` module).
    async fn rebuild(self: &Arc<Self>) -> Result<(), TransportError> {
        let (connection, handed) = connect(&self.config, &self.nodes, &self.refusals).await?;
        let (left, reached) = self.nodes.established();
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(|e| e.into_inner()),
            Arc::new(connection),
        );
        let old_handed = std::mem::replace(
            &mut *self.handed.lock().unwrap_or_else(|e| e.into_inner()),
            handed,
        );
        old_handed.give_up();
        close_if_it_recovers(old);
        self.watch_events();
        let n = self.recoveries.fetch_add(1, Ordering::Relaxed) + 1;
        self.generation.send_modify(|g| *g += 1);
        let name = |i: Option<usize>| i.map_or("", |i| self.nodes.address(i));
        log_recovery(n, name(left), name(reached), "rebuilt");
        Ok(())
    }
}

/// Why each node of a list did not answer.
#[derive(Debug)]
struct Unanswered(Vec<(String, std::io::Error)>);

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (node, e)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{node}: {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Unanswered {}

fn log_recovery(n: u64, left: &str, reached: &str, by: &'static str) {
    if left != reached {
        warn!(
            recoveries = n,
            left,
            reached,
            by,
            "failed over to another node; deliveries held across the drop will be redelivered"
        );
    } else {
        warn!(
            recoveries = n,
            node = reached,
            by,
            "connection recovered; deliveries held across the drop will be redelivered"
        );
    }
}

/// Every second: a connection that has been reconnecting for [`STALL`] without asking for a
/// new stream is rebuilt; a rebuild that fails is tried again after the maximum reconnect
/// delay, for as long as the connection stays stalled. Ends when the link is dropped or
/// closed.
fn spawn_watchdog(link: Weak<Link>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The stream count last seen, and since when it has not changed while reconnecting.
        let mut last = (0, Instant::now());
        // When to try again after a rebuild that failed.
        let mut retry_at: Option<Instant> = None;
        loop {
            tick.tick().await;
            let Some(link) = link.upgrade() else { return };
            if link.closed.load(Ordering::Relaxed) || !link.config.auto_recover() {
                return;
            }
            let attempts = link.nodes.attempts();
            // A recovery is `Connecting` during its handshake: one that never completes
            // stalls as surely as one that never starts.
            let status = link.get().status().clone();
            if !(status.reconnecting() || status.connecting()) {
                last = (attempts, Instant::now());
                retry_at = None;
                continue;
            }
            match retry_at {
                Some(at) if Instant::now() < at => continue,
                Some(_) => {}
                None if attempts != last.0 => {
                    last = (attempts, Instant::now());
                    continue;
                }
                None if last.1.elapsed() < STALL => continue,
                None => warn!(
                    node = link.nodes.current().map_or("", |i| link.nodes.address(i)),
                    quiet = ?last.1.elapsed(),
                    "recovery made no attempt; opening a new connection"
                ),
            }
            retry_at = match link.rebuild().await {
                Ok(()) => None,
                Err(e) => {
                    let again = link.config.reconnect_delay().1;
                    warn!(
                        error = &e as &dyn std::error::Error,
                        ?again,
                        "no node answers; trying again"
                    );
                    Some(Instant::now() + again)
                }
            };
            last = (link.nodes.attempts(), Instant::now());
        }
    });
}

/// Closes a replaced connection if lapin recovers it after all (a recovery that was slow,
/// not stalled), so that it holds no deliveries nobody reads; gives up after an hour.
fn close_if_it_recovers(old: Arc<Connection>) {
    tokio::spawn(async move {
        for _ in 0..3_600 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let status = old.status();
            if status.connected() {
                warn!("the replaced connection recovered after all; closing it");
                let _ = old.close(200, "replaced".into()).await;
                return;
            }
            if status.closed() || status.errored() {
                return;
            }
        }
    });
}

/// The TLS side of `config`: read from its files when a node is `amqps`. TLS settings for
/// `amqp` nodes, or an `EXTERNAL` login without a client certificate, are refused rather
/// than ignored.
fn tls_settings(config: &AmqpConfig) -> Result<Option<Tls>, TransportError> {
    let list = config
        .node_list()
        .map_err(|e| TransportError::Other(Box::new(e)))?;
    let first = &list[0].uri;
    let refuse = |file: &str, reason: &str| TransportError::Tls {
        endpoint: tls::endpoint(first),
        failure: TlsFailure::Configuration {
            file: file.to_owned(),
            reason: reason.to_owned(),
        },
    };
    let external = config.external_auth()
        || first.query.auth_mechanism == Some(lapin::uri::SASLMechanism::External);
    if external && config.tls().and_then(|t| t.client_identity()).is_none() {
        return Err(refuse(
            "the client certificate",
            "an EXTERNAL login needs one (TlsConfig::with_client_identity)",
        ));
    }
    if first.scheme != lapin::uri::AMQPScheme::AMQPS {
        return match config.tls() {
            Some(_) => Err(refuse(
                "the URL",
                "TLS settings are given for an amqp:// URL: use amqps://",
            )),
            None => Ok(None),
        };
    }
    let settings = config.tls().cloned().unwrap_or_default();
    let tls = Tls::new(&settings).map_err(|failure| TransportError::Tls {
        endpoint: tls::endpoint(first),
        failure,
    })?;
    Ok(Some(tls))
}

/// A lapin connection to the first node of `nodes` that answers, recovered by lapin through
/// the node list, with the socket it was handed. Opening it (TCP, TLS and the AMQP
/// handshake) takes at most the connect timeout; a connection not open by then, or that
/// failed, is given up, so that its IO loop ends.
///
/// lapin reads every stream through a tap (see the `tap` module), which keeps the messages
/// it cannot parse from it in `refusals`.
async fn connect(
    config: &AmqpConfig,
    nodes: &Arc<Nodes>,
    refusals: &Arc<Refusals>,
) -> Result<(Connection, Arc<Handed>), TransportError> {
    let (min_delay, max_delay) = config.reconnect_delay();
    let mut properties = ConnectionProperties::default();
    if config.auto_recover() {
        properties = properties.enable_auto_recover().configure_backoff(|b| {
            b.with_min_delay(min_delay)
                .with_max_delay(max_delay)
                .with_max_times(RECONNECT_ROUNDS)
        });
    }
    if let Some(name) = config.connection_name() {
        properties = properties.with_connection_name(name.into());
    }
    let sockets = lapin::runtime::default_runtime().map_err(connection_error)?;
    let mut uri = nodes.handshake_uri();
    if config.external_auth() {
        uri.query.auth_mechanism = Some(lapin::uri::SASLMechanism::External);
    }
    let kit = TapKit::current(uri.query.frame_max, Arc::clone(refusals));
    let runtime = async_rs::Runtime::new(kit.clone());
    let streams = Arc::clone(nodes);
    let handed = Handed::new();
    let keeper = Arc::clone(&handed);
    let connecting = Connection::connector(
        uri,
        runtime,
        async move |_uri, runtime| {
            if keeper.given_up() {
                return Ok(refusal(&runtime).await?);
            }
            let stream = streams.stream(&sockets).await?;
            let socket = match &stream {
                AsyncTcpStream::Plain(plain) => plain.get_ref().as_fd().try_clone_to_owned(),
                AsyncTcpStream::Rustls(tls) => {
                    tls.get_ref().0.get_ref().as_fd().try_clone_to_owned()
                }
                _ => Err(std::io::Error::other("a stream of another kind")),
            };
            keeper.keep(socket.ok().map(std::net::TcpStream::from));
            Ok(AsyncTcpStream::Plain(kit.tap(stream)))
        },
        properties,
    );
    let timeout = config.connect_timeout();
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| {
        handed.give_up();
        if let Some(refused) = tls::refusal_in(source.as_ref()) {
            return refused.into();
        }
        // A server that refuses the client's certificate says so with an alert after the
        // client's side of a TLS 1.3 handshake is done: it reaches lapin's first read.
        if let (Some(alert), Some(i)) = (tls::alert_in(source.as_ref()), nodes.current()) {
            return TransportError::Tls {
                endpoint: nodes.endpoint(i),
                failure: alert,
            };
        }
        let node = nodes
            .current()
            .map_or_else(|| config.redacted_url(), |i| nodes.address(i).to_owned());
        TransportError::connection_failed(format!("cannot connect to {node}"), source)
    };
    match tokio::time::timeout(timeout, connecting).await {
        Ok(Ok(connection)) => Ok((connection, handed)),
        Ok(Err(e)) => Err(failed(Box::new(e))),
        Err(_) => Err(failed(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "the connection was not open within {timeout:?} (TCP, TLS and the AMQP handshake)"
            ),
        )))),
    }
}
