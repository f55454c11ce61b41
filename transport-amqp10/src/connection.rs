//! Opening connections (TCP or TLS; SASL PLAIN, ANONYMOUS or EXTERNAL) and probing addresses.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::link::{ReceiverAttachError, SenderAttachError, SessionStopReason};
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{AmqpError, ErrorCondition};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use retry_core::TransportError;
use tokio::net::TcpStream;
use tokio::time::timeout;
use tracing::warn;

use crate::config::{Amqp10Config, Endpoint, Nodes};
use crate::external;
use crate::tap::{self, Tap};
use crate::tls;

static LINK_NAMES: AtomicU64 = AtomicU64::new(0);

/// A link name unique in this process; RabbitMQ refuses a duplicate on one session.
pub(crate) fn link_name(role: &str) -> String {
    let n = LINK_NAMES.fetch_add(1, Ordering::Relaxed);
    format!("retry-{role}-{}-{n}", std::process::id())
}

/// Opens a connection on the first node that answers, from the one that answered last;
/// `role` tells the broker's connection list which one this is. A move to another node is
/// logged with both. Fails with the last node's error when none answers.
///
/// Everything that comes in on the connection passes through a [`Tap`] first: messages are
/// checked before fe2o3 decodes them, and the broker's `flow` frames are reported.
pub(crate) async fn open(
    nodes: &Nodes,
    config: &Amqp10Config,
    role: &str,
) -> Result<(ConnectionHandle<()>, Tap), TransportError> {
    let after = config.connect_timeout();
    let several = nodes.list.len() > 1;
    let mut last = None;
    for (i, endpoint) in nodes.order() {
        // Boxed: opening (TCP, TLS, SASL, AMQP) is a large state machine, which would
        // otherwise be part of, and copied with, every future that might open a connection:
        // each receive and each publish.
        let opened = match timeout(after, Box::pin(open_inner(endpoint, config, role))).await {
            Ok(result) => result,
            Err(_) => Err(TransportError::Timeout {
                operation: "opening an AMQP 1.0 connection",
                after,
            }),
        };
        match opened {
            Ok(connection) => {
                if let Some(left) = nodes.answered(i) {
                    warn!(role, left = %left.redacted, reached = %endpoint.redacted, "AMQP 1.0 connection failed over to another node");
                }
                return Ok(connection);
            }
            Err(e) => {
                if several {
                    warn!(role, node = %endpoint.redacted, error = %e, "node does not answer");
                }
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| TransportError::Other("the node list is empty".into())))
}

async fn open_inner(
    endpoint: &Endpoint,
    config: &Amqp10Config,
    role: &str,
) -> Result<(ConnectionHandle<()>, Tap), TransportError> {
    let failed = |what: &str, e: Box<dyn std::error::Error + Send + Sync>| {
        TransportError::connection_failed(format!("{what} {}", endpoint.redacted), e)
    };
    let external = config.external_auth();
    if external && !endpoint.tls {
        return Err(TransportError::Unsupported {
            what: format!("SASL EXTERNAL on {}", endpoint.redacted),
            why: "EXTERNAL logs in as the client certificate of a TLS connection: use an amqps:// URL and a client identity (Amqp10Config::with_tls)".into(),
        });
    }
    let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .map_err(|e| failed("connecting to", e.into()))?;
    // Settlements and confirms are small frames that must not wait for Nagle.
    let _ = tcp.set_nodelay(true);

    let container_id = match config.container_id() {
        Some(id) => format!("{id}-{role}"),
        None => format!("retry-engine-{}-{role}", std::process::id()),
    };
    // The scheme stays "amqp" for TLS too: the stream is already encrypted here, and
    // RabbitMQ's TLS port expects TLS first, not AMQP's TLS protocol header.
    let mut builder = Connection::builder()
        .container_id(container_id)
        .scheme("amqp")
        .hostname(endpoint.open_hostname.as_str())
        .sasl_hostname(endpoint.host.as_str())
        // The tap bounds what it buffers by the same figure.
        .max_frame_size(tap::MAX_FRAME_SIZE);
    // With EXTERNAL the SASL layer is done before fe2o3 gets the stream (see `external`).
    if !external {
        builder = builder.sasl_profile(match &endpoint.credentials {
            Some((user, password)) => SaslProfile::Plain {
                username: user.clone(),
                password: password.expose().to_owned(),
            },
            None => SaslProfile::Anonymous,
        });
    }
    if let Some(idle) = config.idle_timeout() {
        builder = builder.idle_time_out(u32::try_from(idle.as_millis()).unwrap_or(u32::MAX));
    }
    if !endpoint.tls {
        let (stream, tap) = Tap::wrap(tcp);
        let connection = builder
            .open_with_stream(stream)
            .await
            .map_err(|e| failed("opening AMQP 1.0 on", e.into()))?;
        return Ok((connection, tap));
    }

    let client = config.tls_client().map_err(|f| tls::refused(endpoint, f))?;
    let server_name = client
        .server_name(&endpoint.host)
        .map_err(|f| tls::refused(endpoint, f))?;
    let name = client.checked_name(&endpoint.host);
    let presented = client.presents_certificate();
    let mut stream = tokio_rustls::TlsConnector::from(Arc::clone(client.config()))
        .connect(server_name, tcp)
        .await
        .map_err(|e| tls::refused(endpoint, tls::handshake_failure(&e, name)))?;
    // With TLS 1.3 the client's handshake ends before the server has checked the client's
    // certificate: its refusal arrives as the first answer to AMQP, or as a connection
    // closed before any answer.
    let refusal = |e: &(dyn std::error::Error + 'static), answered: bool| {
        transport_kit::settings::failure_in(e, name).or_else(|| {
            (presented && !answered && tls::closed(e)).then(tls::closed_after_handshake)
        })
    };
    if external && let Err(e) = external::login(&mut stream, &endpoint.host).await {
        let answered = !matches!(
            &e,
            external::ExternalError::Io {
                answered: false,
                ..
            }
        );
        return Err(match refusal(&e, answered) {
            Some(failure) => tls::refused(endpoint, failure),
            None => failed("logging in with SASL EXTERNAL on", e.into()),
        });
    }
    let (stream, tap) = Tap::wrap(stream);
    let connection = builder.open_with_stream(stream).await.map_err(|e| {
        match refusal(&e, external || tap.received() > 0) {
            Some(failure) => tls::refused(endpoint, failure),
            None => failed("opening AMQP 1.0 on", e.into()),
        }
    })?;
    Ok((connection, tap))
}

/// How an address is checked for existence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Attach a receiver with no credit, then detach. On RabbitMQ `/amq/queue/NAME` never
    /// declares and fails NOT_FOUND on a missing queue; with no credit nothing is delivered.
    Receiver,
    /// Attach a sender, then detach. RabbitMQ fails a missing exchange NOT_FOUND (but accepts
    /// a sender to a missing queue, which is why queues are probed with a receiver).
    Sender,
}

/// Why a probe failed.
#[derive(Debug)]
pub(crate) enum ProbeError {
    /// The broker says the address does not exist.
    Missing(String),
    /// Anything else: the connection, a timeout.
    Failed(TransportError),
}

/// Begins the session one probe runs on: a refused attach ends the whole session on
/// RabbitMQ, so each probe gets a session of its own. Only this needs the connection; the
/// probe itself runs on the session, so the connection is free for sends meanwhile.
pub(crate) async fn probe_session(
    connection: &mut ConnectionHandle<()>,
    after: Duration,
) -> Result<SessionHandle<()>, TransportError> {
    match timeout(after, Session::begin(connection)).await {
        Ok(Ok(session)) => Ok(session),
        Ok(Err(e)) => Err(TransportError::connection_failed(
            "beginning a session to verify an address",
            e,
        )),
        Err(_) => Err(TransportError::Timeout {
            operation: "beginning a session to verify an address",
            after,
        }),
    }
}

/// Checks that `address` exists on `session` (see [`probe_session`]). The answer is the
/// attach's: the probe link is detached in the background, as nothing depends on it. Then,
/// if the attach succeeded (the session lives on), the session is offered to `keep`, for
/// the next probe; a session it does not keep, or one the broker ended, is ended.
///
/// Ending a session is worth saving: RabbitMQ 3.10 now and then takes up to a second to
/// answer an `end`, and meanwhile handles nothing else that comes in on the connection (a
/// `begin` sent then waited 70 to 350 ms, measured with the AMQP 1.0 throughput example's
/// time to first delivery, now `cargo run -p benches --bin first_delivery`).
pub(crate) async fn probe(
    mut session: SessionHandle<()>,
    address: &str,
    how: Probe,
    after: Duration,
    keep: impl FnOnce(SessionHandle<()>) -> Option<SessionHandle<()>> + Send + 'static,
) -> Result<(), ProbeError> {
    let attach = async {
        match how {
            Probe::Receiver => match Receiver::builder()
                .name(link_name("probe"))
                .source(address)
                .credit_mode(CreditMode::Manual)
                .attach(&mut session)
                .await
            {
                Ok(receiver) => Ok(Attached::Receiver(receiver)),
                Err(e) => Err(classify_receiver(e)),
            },
            Probe::Sender => match Sender::builder()
                .name(link_name("probe"))
                .target(address)
                .attach(&mut session)
                .await
            {
                Ok(sender) => Ok(Attached::Sender(sender)),
                Err(e) => Err(classify_sender(e)),
            },
        }
    };
    let attached = timeout(after, attach).await;
    let reusable = matches!(attached, Ok(Ok(_)));
    let (outcome, attached) = match attached {
        Ok(Ok(link)) => (Ok(()), Some(link)),
        Ok(Err(e)) => (Err(e), None),
        Err(_) => (
            Err(ProbeError::Failed(TransportError::Timeout {
                operation: "verifying an address",
                after,
            })),
            None,
        ),
    };
    tokio::spawn(async move {
        let detaching = async {
            match attached {
                Some(Attached::Receiver(receiver)) => receiver.detach().await.is_ok(),
                Some(Attached::Sender(sender)) => sender.detach().await.is_ok(),
                None => false,
            }
        };
        let detached = timeout(after, detaching).await.unwrap_or(false);
        if reusable && detached && !session.is_ended() {
            match keep(session) {
                None => return,
                Some(unkept) => session = unkept,
            }
        }
        end_session(&mut session).await;
    });
    outcome
}

/// A probe link, detached once the probe has its answer.
enum Attached {
    Receiver(Receiver),
    Sender(Sender),
}

/// Ends a session unless the broker already has, waiting a second at most: RabbitMQ 3.10
/// now and then never answers an `end`, and nothing depends on the answer (dropping the
/// handle ends the session on this side anyway).
pub(crate) async fn end_session(session: &mut SessionHandle<()>) {
    if !session.is_ended() {
        let _ = timeout(Duration::from_secs(1), session.end()).await;
    }
}

fn not_found(reason: &SessionStopReason) -> Option<String> {
    match reason {
        SessionStopReason::RemoteEndedWithError(e)
            if e.condition == ErrorCondition::AmqpError(AmqpError::NotFound) =>
        {
            Some(e.description.clone().unwrap_or_else(|| "not found".into()))
        }
        _ => None,
    }
}

/// A refused attach: RabbitMQ ends the session with `amqp:not-found`; brokers that follow the
/// specification answer with a null source or target and detach.
pub(crate) fn classify_receiver(e: ReceiverAttachError) -> ProbeError {
    match &e {
        ReceiverAttachError::SessionStopped(reason) => match not_found(reason) {
            Some(why) => ProbeError::Missing(why),
            None => ProbeError::Failed(TransportError::connection_failed(
                "attaching a receiver to verify an address",
                e,
            )),
        },
        ReceiverAttachError::IncomingSourceIsNone => {
            ProbeError::Missing("the broker refused the link".into())
        }
        _ => ProbeError::Failed(TransportError::connection_failed(
            "attaching a receiver to verify an address",
            e,
        )),
    }
}

fn classify_sender(e: SenderAttachError) -> ProbeError {
    match &e {
        SenderAttachError::SessionStopped(reason) => match not_found(reason) {
            Some(why) => ProbeError::Missing(why),
            None => ProbeError::Failed(TransportError::connection_failed(
                "attaching a sender to verify an address",
                e,
            )),
        },
        SenderAttachError::IncomingTargetIsNone => {
            ProbeError::Missing("the broker refused the link".into())
        }
        _ => ProbeError::Failed(TransportError::connection_failed(
            "attaching a sender to verify an address",
            e,
        )),
    }
}
