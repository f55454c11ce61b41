//! The connection, and questions to the broker that leave it as it is.

use std::sync::OnceLock;
use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use retry_core::{ExchangeKind, TlsConfig, TransportError};
use transport_amqp091::{AmqpConfig, AmqpTransport};

use crate::error::CliError;

const NOT_FOUND: u16 = 404;

/// How long connecting may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// The TLS settings of the `--tls-*` options: one command, one broker, set once.
static TLS: OnceLock<TlsConfig> = OnceLock::new();

/// Connects with `tls` (`--tls-*`) from now on.
pub fn use_tls(tls: TlsConfig) {
    let _ = TLS.set(tls);
}

/// Connects to `url`, with the `--tls-*` settings. The connection does not recover by
/// itself: a command that loses it fails and says so.
pub async fn connect(url: &str) -> Result<AmqpTransport, CliError> {
    let mut config = AmqpConfig::new(url)
        .with_connection_name("retryctl")
        .with_auto_recover(false);
    if let Some(tls) = TLS.get() {
        config = config.with_tls(tls.clone());
    }
    let at = config.redacted_url();
    match tokio::time::timeout(CONNECT_TIMEOUT, AmqpTransport::connect(config)).await {
        Ok(Ok(transport)) => Ok(transport),
        // Not "connection lost": there was none yet.
        Ok(Err(TransportError::Connection {
            context,
            source: Some(source),
            ..
        })) => Err(CliError::failure_from(context, source)),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(CliError::failure(format!(
            "no answer from {at} within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// A queue as a passive declare sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueState {
    /// Messages ready for delivery.
    pub messages: u32,
    /// Consumers subscribed to it.
    pub consumers: u32,
}

/// Queue `name` as the broker has it, or `None` when there is no such queue.
pub async fn queue_state(conn: &Connection, name: &str) -> Result<Option<QueueState>, CliError> {
    // A passive declare of a missing object closes its channel: one channel per question.
    let channel = open_channel(conn).await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let answer = channel
        .queue_declare(name.into(), passive, FieldTable::default())
        .await;
    match answer {
        Ok(queue) => {
            close(channel).await;
            Ok(Some(QueueState {
                messages: queue.message_count(),
                consumers: queue.consumer_count(),
            }))
        }
        Err(e) if amqp_code(&e) == Some(NOT_FOUND) => Ok(None),
        Err(e) => Err(CliError::failure_from(
            format!("cannot inspect queue {name:?}"),
            e,
        )),
    }
}

/// Whether exchange `name` exists.
pub async fn exchange_exists(
    conn: &Connection,
    name: &str,
    kind: ExchangeKind,
) -> Result<bool, CliError> {
    let channel = open_channel(conn).await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    let answer = channel
        .exchange_declare(
            name.into(),
            lapin_kind(kind),
            passive,
            FieldTable::default(),
        )
        .await;
    match answer {
        Ok(()) => {
            close(channel).await;
            Ok(true)
        }
        Err(e) if amqp_code(&e) == Some(NOT_FOUND) => Ok(false),
        Err(e) => Err(CliError::failure_from(
            format!("cannot inspect exchange {name:?}"),
            e,
        )),
    }
}

/// A new channel on `conn`.
pub async fn open_channel(conn: &Connection) -> Result<Channel, CliError> {
    conn.create_channel()
        .await
        .map_err(|e| CliError::failure_from("cannot open a channel", e))
}

/// Closes `channel`, whatever state it is in.
pub async fn close(channel: Channel) {
    let _ = channel.close(200, "done".into()).await;
}

/// The AMQP reply code of a broker error, if it is one.
pub fn amqp_code(err: &lapin::Error) -> Option<u16> {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => Some(e.get_id()),
        _ => None,
    }
}

fn lapin_kind(kind: ExchangeKind) -> lapin::ExchangeKind {
    match kind {
        ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
        ExchangeKind::Topic => lapin::ExchangeKind::Topic,
    }
}
