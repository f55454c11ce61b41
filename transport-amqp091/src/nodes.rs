//! A cluster's node list: parsing its URLs with lapin's parser, and which node the
//! connection goes to next. The list as given, its order and the refusals' wording are the
//! shared connection settings' (`transport_kit::settings`).
//!
//! lapin recovers a connection by calling back for a new TCP stream with the URI it was made
//! with, then replays the handshake, the channels, their QoS, confirm mode and consumers on
//! it. [`Nodes::stream`] is that callback: it opens the stream to a node of the list instead
//! of the first URI, so lapin's own recovery switches node. Credentials, virtual host and
//! options come from the first URL; every node must agree with them (checked when parsing).
//!
//! Each node keeps its own backoff: a node that failed is tried again only after its delay
//! (doubling from the minimum reconnect delay to the maximum), unless every node is waiting,
//! in which case the one due first is tried. A node list of one is the same code with one
//! node.
//!
//! Before a stream of a list of several nodes is handed over, the node is asked for its
//! cluster name (the `cluster_name` server property of `connection.start`, read on a
//! separate TCP connection that is closed at once): a node of another cluster is left out
//! for good.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_rs::Runtime;
use async_rs::traits::{Reactor, RuntimeKit};
use futures::io::{AsyncReadExt, AsyncWriteExt};
use lapin::tcp::AsyncTcpStream;
use lapin::types::AMQPValue;
use lapin::uri::{AMQPScheme, AMQPUri};
use retry_core::NodeListError;
use tracing::{error, info, warn};
use transport_kit::settings::NodeList;

use crate::tls::{Tls, TlsRefused};

/// One node: where to open the TCP stream, and how to name it in logs.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub(crate) uri: AMQPUri,
    /// The URL as given, password redacted.
    pub(crate) address: String,
}

/// Parses a node list: every node an `amqp` or `amqps` URL that lapin reads, agreeing with
/// the first on everything but host and port, and none twice.
pub(crate) fn parse(list: &NodeList) -> Result<Vec<Node>, NodeListError> {
    list.parse_with(|url, nodes: &[Node]| {
        url.check_scheme(&["amqp", "amqps"])?;
        let address = url.redacted();
        let uri: AMQPUri = url
            .url()
            .parse()
            .map_err(|reason: String| url.invalid(reason))?;
        if let Some(first) = nodes.first() {
            let field = if uri.scheme != first.uri.scheme {
                Some("scheme")
            } else if uri.authority.userinfo.username != first.uri.authority.userinfo.username {
                Some("user")
            } else if uri.authority.userinfo.password != first.uri.authority.userinfo.password {
                Some("password")
            } else if uri.vhost != first.uri.vhost {
                Some("virtual host")
            } else if uri.query != first.uri.query {
                Some("options")
            } else {
                None
            };
            if let Some(field) = field {
                return Err(NodeListError::Differs {
                    position: url.position(),
                    node: address,
                    first: first.address.clone(),
                    field,
                });
            }
            if nodes.iter().any(|n| {
                n.uri.authority.host == uri.authority.host
                    && n.uri.authority.port == uri.authority.port
            }) {
                return Err(NodeListError::Duplicate { node: address });
            }
        }
        Ok(Node { uri, address })
    })
}

#[derive(Clone, Copy, Default)]
struct Health {
    failures: u32,
    retry_at: Option<Instant>,
    /// Of another cluster: never tried again.
    excluded: bool,
}

#[derive(Default)]
struct State {
    health: Vec<Health>,
    /// The node the latest stream was opened to.
    current: Option<usize>,
    /// The node of the latest established connection.
    connected: Option<usize>,
    /// The cluster name the first node that told it answered with, and that node.
    cluster: Option<(usize, String)>,
}

/// The node list of one transport, with each node's health.
pub(crate) struct Nodes {
    nodes: Vec<Node>,
    min_delay: Duration,
    max_delay: Duration,
    state: Mutex<State>,
    /// How many times a stream was asked for: lapin's (re)connection attempts.
    attempts: AtomicU64,
    /// The TLS settings of `amqps` nodes.
    tls: Option<Tls>,
}

/// How long a probe of one node (TCP connect and `connection.start`), or the TCP (and TLS)
/// connect of a stream, may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

impl Nodes {
    /// `nodes` in the order they are tried in, `amqps` ones with `tls`.
    pub(crate) fn new(
        nodes: Vec<Node>,
        min_delay: Duration,
        max_delay: Duration,
        tls: Option<Tls>,
    ) -> Self {
        let state = State {
            health: vec![Health::default(); nodes.len()],
            ..State::default()
        };
        Nodes {
            nodes,
            min_delay,
            max_delay: max_delay.max(min_delay),
            state: Mutex::new(state),
            attempts: AtomicU64::new(0),
            tls,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many nodes there are.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The address of node `i`, password redacted.
    pub(crate) fn address(&self, i: usize) -> &str {
        &self.nodes[i].address
    }

    /// The `host:port` of node `i`, as a TLS refusal names it.
    pub(crate) fn endpoint(&self, i: usize) -> String {
        crate::tls::endpoint(&self.nodes[i].uri)
    }

    /// The URI lapin's handshake uses: the first node's (they agree on all it reads).
    pub(crate) fn handshake_uri(&self) -> AMQPUri {
        self.nodes[0].uri.clone()
    }

    /// How many streams were asked for so far.
    pub(crate) fn attempts(&self) -> u64 {
        self.attempts.load(Ordering::Relaxed)
    }

    /// The node the latest stream went to.
    pub(crate) fn current(&self) -> Option<usize> {
        self.lock().current
    }

    /// A connection is established on the current node: its backoff is cleared. Returns
    /// the node the previous connection was on and this one's.
    pub(crate) fn established(&self) -> (Option<usize>, Option<usize>) {
        let mut s = self.lock();
        let reached = s.current;
        if let Some(i) = reached {
            s.health[i].failures = 0;
            s.health[i].retry_at = None;
        }
        let left = std::mem::replace(&mut s.connected, reached);
        (left, reached)
    }

    fn failed(&self, s: &mut State, i: usize) {
        let h = &mut s.health[i];
        let delay = self
            .min_delay
            .saturating_mul(1u32 << h.failures.min(16))
            .min(self.max_delay);
        h.failures = h.failures.saturating_add(1);
        h.retry_at = Some(Instant::now() + delay);
    }

    /// The nodes to try now, in order: those not waiting out a backoff in list order, then
    /// the waiting ones by when they are due. Never a node of another cluster.
    fn candidates(&self, s: &State) -> Vec<usize> {
        let now = Instant::now();
        let (mut ready, mut waiting): (Vec<usize>, Vec<usize>) = (0..self.nodes.len())
            .filter(|&i| !s.health[i].excluded)
            .partition(|&i| s.health[i].retry_at.is_none_or(|t| t <= now));
        waiting.sort_by_key(|&i| s.health[i].retry_at);
        ready.extend(waiting);
        ready
    }

    /// Asks every node for its cluster name, at once: refuses a list that mixes clusters and
    /// remembers the name for failovers. Returns which nodes answered, with each error of
    /// those that did not. A list of one node has no names to compare: its node is only
    /// connected to (TCP, and TLS for `amqps`), which the broker does not log, where a
    /// `connection.start` read and dropped is logged as a client that closed unexpectedly.
    pub(crate) async fn survey<RK: RuntimeKit + Send + Sync>(
        &self,
        runtime: &Runtime<RK>,
    ) -> Result<Vec<Result<(), std::io::Error>>, NodeListError> {
        let several = self.nodes.len() > 1;
        let answers = futures::future::join_all(self.nodes.iter().map(|n| async move {
            if several {
                probe(&n.uri, self.tls.as_ref(), runtime).await
            } else {
                reach(&n.uri, self.tls.as_ref(), runtime)
                    .await
                    .map(|()| None)
            }
        }))
        .await;
        let mut s = self.lock();
        let mut reachable = Vec::with_capacity(answers.len());
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(name) => {
                    self.check_cluster(&mut s, i, name)?;
                    reachable.push(Ok(()));
                }
                Err(e) => {
                    self.failed(&mut s, i);
                    reachable.push(Err(e));
                }
            }
        }
        Ok(reachable)
    }

    /// Compares node `i`'s cluster name with the first one seen.
    fn check_cluster(
        &self,
        s: &mut State,
        i: usize,
        name: Option<String>,
    ) -> Result<(), NodeListError> {
        let Some(name) = name else { return Ok(()) };
        match &s.cluster {
            None => s.cluster = Some((i, name)),
            Some((first, first_cluster)) if *first_cluster != name => {
                return Err(NodeListError::DifferentClusters {
                    first: self.address(*first).to_owned(),
                    first_cluster: first_cluster.clone(),
                    node: self.address(i).to_owned(),
                    cluster: name,
                });
            }
            Some(_) => {}
        }
        Ok(())
    }

    /// A TCP (or TLS) stream to the next node, for lapin's (re)connection. The node the
    /// previous stream went to has failed, if there was one: it waits out its backoff.
    pub(crate) async fn stream<RK: RuntimeKit + Send + Sync>(
        &self,
        runtime: &Runtime<RK>,
    ) -> lapin::Result<AsyncTcpStream<<RK as Reactor>::TcpStream>> {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let candidates = {
            let mut s = self.lock();
            if let Some(previous) = s.current.take() {
                self.failed(&mut s, previous);
            }
            self.candidates(&s)
        };
        let several = self.nodes.len() > 1;
        let mut last = None;
        for i in candidates {
            let node = &self.nodes[i];
            if several {
                match probe(&node.uri, self.tls.as_ref(), runtime).await {
                    Ok(name) => {
                        let mut s = self.lock();
                        if let Err(e) = self.check_cluster(&mut s, i, name) {
                            error!(node = %node.address, error = %e, "leaving out a node of another cluster");
                            s.health[i].excluded = true;
                            last = Some(std::io::Error::other(e));
                            continue;
                        }
                    }
                    Err(e) => {
                        warn!(node = %node.address, error = %e, "node does not answer");
                        self.failed(&mut self.lock(), i);
                        last = Some(e);
                        continue;
                    }
                }
            }
            let connecting = open(&node.uri, self.tls.as_ref(), runtime);
            let connected = tokio::time::timeout(PROBE_TIMEOUT, connecting)
                .await
                .unwrap_or_else(|_| Err(timed_out("no connection")));
            match connected {
                Ok(stream) => {
                    self.lock().current = Some(i);
                    info!(node = %node.address, "connecting");
                    return Ok(stream);
                }
                Err(e) => {
                    warn!(node = %node.address, error = %e, "node does not answer");
                    self.failed(&mut self.lock(), i);
                    last = Some(e);
                }
            }
        }
        Err(last
            .unwrap_or_else(|| std::io::Error::other("no node of the list is left to try"))
            .into())
    }
}

/// A TCP stream to `uri`'s node, and for `amqps` the TLS handshake on it with `tls`. An
/// `amqps` node without TLS settings is refused, never reached in plain TCP.
async fn open<RK: RuntimeKit + Send + Sync>(
    uri: &AMQPUri,
    tls: Option<&Tls>,
    runtime: &Runtime<RK>,
) -> std::io::Result<AsyncTcpStream<<RK as Reactor>::TcpStream>> {
    let addresses = runtime.to_socket_addrs((uri.authority.host.clone(), uri.authority.port));
    let stream = AsyncTcpStream::connect(runtime, addresses).await?;
    match (&uri.scheme, tls) {
        (AMQPScheme::AMQP, _) => Ok(stream),
        (AMQPScheme::AMQPS, Some(tls)) => tls.handshake(uri, stream).await,
        (AMQPScheme::AMQPS, None) => Err(std::io::Error::other(TlsRefused {
            endpoint: crate::tls::endpoint(uri),
            failure: retry_core::TlsFailure::Configuration {
                file: "the TLS settings".into(),
                reason: "missing for an amqps:// node".into(),
            },
        })),
    }
}

/// Opens a TCP (and for `amqps`, TLS) connection to `uri`'s node and closes it.
async fn reach<RK: RuntimeKit + Send + Sync>(
    uri: &AMQPUri,
    tls: Option<&Tls>,
    runtime: &Runtime<RK>,
) -> std::io::Result<()> {
    let connect = open(uri, tls, runtime);
    match tokio::time::timeout(PROBE_TIMEOUT, connect).await {
        Ok(stream) => {
            let mut stream = stream?;
            let _ = stream.close().await;
            match tls {
                Some(tls) if tls.presents_a_certificate() => tls.verdict(uri, stream).await,
                _ => Ok(()),
            }
        }
        Err(_) => Err(timed_out("no connection")),
    }
}

/// A timeout of `what` after [`PROBE_TIMEOUT`].
fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} within {PROBE_TIMEOUT:?}"),
    )
}

/// Opens a connection to `uri`'s node, sends the protocol header and reads `connection.start`
/// for the `cluster_name` server property, then closes it. `Ok(None)`: the node answered
/// without a cluster name.
async fn probe<RK: RuntimeKit + Send + Sync>(
    uri: &AMQPUri,
    tls: Option<&Tls>,
    runtime: &Runtime<RK>,
) -> std::io::Result<Option<String>> {
    let exchange = async {
        let mut stream = open(uri, tls, runtime).await?;
        stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        stream.flush().await?;
        let mut header = [0u8; 7];
        stream.read_exact(&mut header).await?;
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
        // A connection.start is a few hundred bytes; refuse to buffer what no broker sends.
        if header[0] != 1 || size > 64 * 1024 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the node did not answer the protocol header with an AMQP 0-9-1 method frame",
            ));
        }
        let mut payload = vec![0u8; size + 1];
        stream.read_exact(&mut payload).await?;
        let _ = stream.close().await;
        Ok(cluster_name(&payload))
    };
    match tokio::time::timeout(PROBE_TIMEOUT, exchange).await {
        Ok(answer) => answer,
        Err(_) => Err(timed_out("no connection.start")),
    }
}

/// The `cluster_name` server property of a `connection.start` frame's payload (with its frame
/// end byte), if it is one and has it. Never panics on what a peer sent.
fn cluster_name(payload: &[u8]) -> Option<String> {
    // class 10, method 10, version-major, version-minor, then the server properties.
    let (method, rest) = payload.split_at_checked(6)?;
    if method[..4] != [0, 10, 0, 10] {
        return None;
    }
    let (_, table) = lapin::types::parsing::parse_field_table(rest).ok()?;
    match table.inner().get("cluster_name")? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_parses_and_refuses_what_cannot_be_one_cluster() {
        let split = NodeList::new;
        let nodes = parse(&split(
            "amqp://u:p@h1:5672/%2f, amqp://u:p@h2:5673/%2f,,amqp://u:p@h3/%2f",
        ))
        .unwrap();
        let hosts: Vec<_> = nodes
            .iter()
            .map(|n| (n.uri.authority.host.as_str(), n.uri.authority.port))
            .collect();
        assert_eq!(hosts, [("h1", 5672), ("h2", 5673), ("h3", 5672)]);
        assert_eq!(nodes[1].address, "amqp://u:****@h2:5673/%2f");

        let cases = [
            ("amqp://u:p@h1/%2f,amqps://u:p@h2/%2f", "scheme"),
            ("amqp://u:p@h1/%2f,amqp://v:p@h2/%2f", "user"),
            ("amqp://u:p@h1/%2f,amqp://u:q@h2/%2f", "password"),
            ("amqp://u:p@h1/%2f,amqp://u:p@h2/other", "virtual host"),
            ("amqp://u:p@h1/%2f,amqp://u:p@h2/%2f?heartbeat=5", "options"),
        ];
        for (list, want) in cases {
            match parse(&split(list)).unwrap_err() {
                NodeListError::Differs {
                    position, field, ..
                } => assert_eq!((position, field), (2, want), "{list}"),
                other => panic!("{list}: {other:?}"),
            }
        }
        let err = parse(&split("amqp://u:secret@h1/%2f,amqp://u:secret@h1:5672/%2f")).unwrap_err();
        assert_eq!(
            err,
            NodeListError::Duplicate {
                node: "amqp://u:****@h1:5672/%2f".into()
            }
        );
        let err = parse(&split("amqp://u:secret@h1/%2f,h2:5672")).unwrap_err();
        assert!(
            matches!(err, NodeListError::Invalid { position: 2, .. }),
            "{err:?}"
        );
        assert!(!err.to_string().contains("secret"), "{err}");
        // The wording of this refusal is the shared node list's (transport-kit's tests).
        let err = parse(&split("amqp://u:p@h1/%2f,http://u:p@h2/%2f")).unwrap_err();
        assert!(
            matches!(err, NodeListError::UnsupportedScheme { position: 2, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn a_failed_node_waits_while_another_is_tried_and_comes_back_when_due() {
        let nodes = Nodes::new(
            parse(&NodeList::from_urls([
                "amqp://h1",
                "amqp://h2",
                "amqp://h3",
            ]))
            .unwrap(),
            Duration::from_secs(60),
            Duration::from_secs(600),
            None,
        );
        let mut s = nodes.lock();
        assert_eq!(nodes.candidates(&s), [0, 1, 2]);
        nodes.failed(&mut s, 0);
        assert_eq!(nodes.candidates(&s), [1, 2, 0]);
        nodes.failed(&mut s, 1);
        nodes.failed(&mut s, 0);
        // Both wait; node 1 (one failure, 60 s) is due before node 0 (two, 120 s).
        assert_eq!(nodes.candidates(&s), [2, 1, 0]);
        s.health[2].excluded = true;
        assert_eq!(nodes.candidates(&s), [1, 0]);
        s.health[1].retry_at = Some(Instant::now() - Duration::from_secs(1));
        assert_eq!(nodes.candidates(&s), [1, 0]);
        s.current = Some(0);
        drop(s);
        assert_eq!(nodes.established(), (None, Some(0)));
        assert_eq!(nodes.candidates(&nodes.lock()), [0, 1]);
    }

    #[test]
    fn the_cluster_name_is_read_from_connection_start_and_hostile_frames_are_ignored() {
        // A field table of long strings, as RabbitMQ writes its server properties.
        let mut entries = Vec::new();
        for (key, value) in [("product", "RabbitMQ"), ("cluster_name", "rabbit@one")] {
            entries.push(key.len() as u8);
            entries.extend(key.as_bytes());
            entries.push(b'S');
            entries.extend((value.len() as u32).to_be_bytes());
            entries.extend(value.as_bytes());
        }
        let mut payload = vec![0, 10, 0, 10, 0, 9];
        payload.extend((entries.len() as u32).to_be_bytes());
        payload.extend(entries);
        payload.push(0xCE);
        assert_eq!(cluster_name(&payload).as_deref(), Some("rabbit@one"));
        for cut in 0..payload.len() - 1 {
            // Truncated anywhere: no name, no panic.
            assert_eq!(cluster_name(&payload[..cut]), None, "cut at {cut}");
        }
        // Another method, and a table longer than the frame.
        assert_eq!(cluster_name(&[0, 10, 0, 11, 0, 9, 0, 0, 0, 0]), None);
        assert_eq!(
            cluster_name(&[0, 10, 0, 10, 0, 9, 0xFF, 0xFF, 0xFF, 0xFF]),
            None
        );
    }

    #[test]
    fn nodes_of_another_cluster_are_refused_by_the_first_name_seen() {
        let nodes = Nodes::new(
            parse(&NodeList::from_urls([
                "amqp://u:secret@h1",
                "amqp://u:secret@h2",
                "amqp://u:secret@h3",
            ]))
            .unwrap(),
            Duration::from_millis(100),
            Duration::from_secs(5),
            None,
        );
        let mut s = nodes.lock();
        // A node that tells no name is never refused, and sets nothing.
        assert_eq!(nodes.check_cluster(&mut s, 2, None), Ok(()));
        assert_eq!(nodes.check_cluster(&mut s, 1, Some("prod".into())), Ok(()));
        assert_eq!(nodes.check_cluster(&mut s, 0, Some("prod".into())), Ok(()));
        let err = nodes
            .check_cluster(&mut s, 2, Some("staging".into()))
            .unwrap_err();
        assert_eq!(
            err,
            NodeListError::DifferentClusters {
                first: "amqp://u:****@h2".into(),
                first_cluster: "prod".into(),
                node: "amqp://u:****@h3".into(),
                cluster: "staging".into(),
            }
        );
        assert!(!err.to_string().contains("secret"), "{err}");
    }
}
