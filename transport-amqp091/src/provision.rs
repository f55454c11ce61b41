//! Declaring a `TopologyPlan`, idempotently, with conflicts reported by name.
//!
//! Each object is first inspected with a passive declare (does it exist?), then declared
//! with the plan's settings on a scratch channel. RabbitMQ refuses an inequivalent
//! redeclaration with `PRECONDITION_FAILED` and closes the channel; that reply names the
//! argument and both values, and becomes a [`TransportError::TopologyConflict`].

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ExchangeKind as LapinKind};
use retry_core::{ExchangeKind, TopologyPlan, TransportError};
use tracing::info;

use crate::convert::table_from_headers;
use crate::error::{amqp_code, connection_error, short};

const PRECONDITION_FAILED: u16 = 406;
const NOT_FOUND: u16 = 404;

/// What provisioning did, object by object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProvisionReport {
    /// Objects that did not exist and were declared.
    pub created: Vec<String>,
    /// Objects that existed with the planned settings.
    pub verified: Vec<String>,
}

struct Scratch<'a> {
    conn: &'a Connection,
    channel: Channel,
}

impl<'a> Scratch<'a> {
    async fn open(conn: &'a Connection) -> Result<Self, TransportError> {
        let channel = conn.create_channel().await.map_err(connection_error)?;
        Ok(Scratch { conn, channel })
    }

    /// A failed declare closes the channel; the next step needs a fresh one.
    async fn renew(&mut self) -> Result<(), TransportError> {
        self.channel = self.conn.create_channel().await.map_err(connection_error)?;
        Ok(())
    }
}

fn kind(k: ExchangeKind) -> LapinKind {
    match k {
        ExchangeKind::Direct => LapinKind::Direct,
        ExchangeKind::Fanout => LapinKind::Fanout,
        ExchangeKind::Topic => LapinKind::Topic,
    }
}

/// Declares every exchange, queue and binding of `plan`.
pub(crate) async fn provision(
    conn: &Connection,
    plan: &TopologyPlan,
) -> Result<ProvisionReport, TransportError> {
    let mut scratch = Scratch::open(conn).await?;
    let mut report = ProvisionReport::default();
    for e in plan.exchanges() {
        let name = short(&e.name)?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let exists = match scratch
            .channel
            .exchange_declare(name.clone(), kind(e.kind), passive, FieldTable::default())
            .await
        {
            Ok(()) => true,
            Err(err) if amqp_code(&err) == Some(NOT_FOUND) => {
                scratch.renew().await?;
                false
            }
            Err(err) => return Err(connection_error(err)),
        };
        let options = ExchangeDeclareOptions {
            durable: e.durable,
            ..ExchangeDeclareOptions::default()
        };
        if let Err(err) = scratch
            .channel
            .exchange_declare(name, kind(e.kind), options, FieldTable::default())
            .await
        {
            return Err(conflict_or(err, "exchange", &e.name));
        }
        record(&mut report, exists, format!("exchange {}", e.name));
    }
    for q in plan.queues() {
        let name = short(&q.name)?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let exists = match scratch
            .channel
            .queue_declare(name.clone(), passive, FieldTable::default())
            .await
        {
            Ok(_) => true,
            Err(err) if amqp_code(&err) == Some(NOT_FOUND) => {
                scratch.renew().await?;
                false
            }
            Err(err) => return Err(connection_error(err)),
        };
        let options = QueueDeclareOptions {
            durable: q.durable,
            ..QueueDeclareOptions::default()
        };
        let args = table_from_headers(&q.arguments.to_headers());
        if let Err(err) = scratch.channel.queue_declare(name, options, args).await {
            return Err(conflict_or(err, "queue", &q.name));
        }
        record(&mut report, exists, format!("queue {}", q.name));
    }
    for b in plan.bindings() {
        scratch
            .channel
            .queue_bind(
                short(&b.queue)?,
                short(&b.exchange)?,
                short(&b.routing_key)?,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(connection_error)?;
    }
    let _ = scratch.channel.close(200, "provisioned".into()).await;
    info!(
        queue = plan.work_queue(),
        created = ?report.created,
        verified = report.verified.len(),
        "topology provisioned"
    );
    Ok(report)
}

/// Deletes every queue and exchange of `plan`, messages included.
pub(crate) async fn teardown(conn: &Connection, plan: &TopologyPlan) -> Result<(), TransportError> {
    let channel = conn.create_channel().await.map_err(connection_error)?;
    for q in plan.queues() {
        channel
            .queue_delete(short(&q.name)?, QueueDeleteOptions::default())
            .await
            .map_err(connection_error)?;
    }
    for e in plan.exchanges() {
        channel
            .exchange_delete(short(&e.name)?, ExchangeDeleteOptions::default())
            .await
            .map_err(connection_error)?;
    }
    let _ = channel.close(200, "torn down".into()).await;
    Ok(())
}

fn record(report: &mut ProvisionReport, existed: bool, what: String) {
    if existed {
        report.verified.push(what);
    } else {
        report.created.push(what);
    }
}

fn conflict_or(err: lapin::Error, object_kind: &str, name: &str) -> TransportError {
    if amqp_code(&err) != Some(PRECONDITION_FAILED) {
        return connection_error(err);
    }
    let text = match err.kind() {
        lapin::ErrorKind::ProtocolError(e) => e.get_message().as_str().to_owned(),
        _ => err.to_string(),
    };
    refused(object_kind, name, &text)
}

/// What RabbitMQ's `PRECONDITION_FAILED` reply `text` to declaring `name` means: a conflict
/// with an existing object ("inequivalent arg"), or a refusal of the declaration itself.
fn refused(object_kind: &str, name: &str, text: &str) -> TransportError {
    let parsed = parse_inequivalent(text);
    let Some(argument) = parsed.0 else {
        // Not a conflict with an existing object: the declaration itself was refused, for
        // instance an argument of the wrong type ("invalid arg").
        let refused = format!("the broker refused to declare {object_kind} {name:?}: {text}");
        return TransportError::Other(refused.into());
    };
    TransportError::TopologyConflict {
        object: format!("{object_kind} {name:?}"),
        argument,
        existing: parsed.2.unwrap_or_else(|| format!("(broker said: {text})")),
        wanted: parsed.1.unwrap_or_else(|| "the plan's value".into()),
    }
}

/// Reads RabbitMQ's "inequivalent arg 'A' for queue 'Q' in vhost 'V': received X but
/// current is Y" into (A, X, Y).
fn parse_inequivalent(text: &str) -> (Option<String>, Option<String>, Option<String>) {
    let argument = text
        .split_once("inequivalent arg '")
        .and_then(|(_, rest)| rest.split_once('\''))
        .map(|(a, _)| a.to_owned());
    let (received, current) = match text.split_once("received ") {
        Some((_, rest)) => match rest.split_once(" but current is ") {
            Some((r, c)) => (Some(r.trim().to_owned()), Some(c.trim().to_owned())),
            None => (Some(rest.trim().to_owned()), None),
        },
        None => (None, None),
    };
    (argument, received, current)
}

#[cfg(test)]
mod tests {
    use super::{parse_inequivalent, refused};
    use retry_core::TransportError;

    #[test]
    fn rabbitmq_conflict_replies_are_read() {
        let (a, r, c) = parse_inequivalent(
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q.retry.30s' in vhost '/': received the value '30000' of type 'long' but current is the value '5000' of type 'long'",
        );
        assert_eq!(a.as_deref(), Some("x-message-ttl"));
        assert_eq!(r.as_deref(), Some("the value '30000' of type 'long'"));
        assert_eq!(c.as_deref(), Some("the value '5000' of type 'long'"));
        let (a, r, c) = parse_inequivalent(
            "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'x' in vhost '/': received 'direct' but current is 'fanout'",
        );
        assert_eq!(
            (a.as_deref(), r.as_deref(), c.as_deref()),
            (Some("type"), Some("'direct'"), Some("'fanout'"))
        );
        assert_eq!(parse_inequivalent("garbage"), (None, None, None));
    }

    #[test]
    fn an_invalid_argument_is_not_called_a_conflict() {
        let text = "PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'q.retry.30s' in vhost '/': \"expected integer, got void\"";
        let err = refused("queue", "q.retry.30s", text);
        assert!(matches!(err, TransportError::Other(_)), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("the broker refused to declare queue \"q.retry.30s\": {text}")
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/': received 'true' but current is 'false'";
        let err = refused("queue", "q", text);
        assert!(
            matches!(&err, TransportError::TopologyConflict { argument, .. } if argument == "durable"),
            "{err:?}"
        );
    }
}
