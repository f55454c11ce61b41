//! Declaring a `TopologyPlan`, idempotently, with conflicts reported by name.
//!
//! Each object is declared with the plan's settings. RabbitMQ refuses an inequivalent
//! redeclaration with `PRECONDITION_FAILED` and closes the channel; that reply names the
//! argument and both values, and becomes a [`TransportError::TopologyConflict`].
//!
//! AMQP 0-9-1 cannot ask whether an object exists without the broker closing the channel
//! when it does not (`NOT_FOUND`), and lapin logs every channel the broker closes at ERROR.
//! So the consumer's start declares at once, and a first start on a fresh broker logs one
//! INFO line, nothing louder. Inspecting first, to tell created objects from verified ones,
//! is for tools ([`AmqpTransport::provision_inspected`](crate::AmqpTransport::provision_inspected)):
//! it passive-declares each object on a channel used for nothing else, where `NOT_FOUND`
//! means "to be created", and logs each creation at INFO.
//!
//! A plan with a delay cascade ([`TopologyPlan::cascade`]) has its cascade declared first:
//! topic exchanges, level queues, each level's binding to its queue and its
//! exchange-to-exchange binding to the level below. Those objects are shared by every work
//! queue of the same cascade: declaring them again verifies them, and tearing one work queue
//! down leaves them alone.

use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind as LapinKind};
use retry_core::{
    BindingSpec, CascadePlan, ExchangeBindingSpec, ExchangeKind, ExchangeSpec, QueueSpec,
    TopologyPlan, TransportError,
};
use tracing::{debug, info};

use crate::convert::table_from_headers;
use crate::error::{amqp_code, connection_error, short};

const PRECONDITION_FAILED: u16 = 406;
const NOT_FOUND: u16 = 404;

/// What provisioning did, object by object (`"queue comments.parking"`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProvisionReport {
    /// Objects that did not exist and were declared (inspected provisioning only).
    pub created: Vec<String>,
    /// Objects that existed with the planned settings (inspected provisioning only).
    pub verified: Vec<String>,
    /// Objects declared without asking first (the consumer's start): each exists now with
    /// the planned settings, created or already there.
    pub declared: Vec<String>,
}

/// Passive declares, on a channel of their own: the `NOT_FOUND` closure of a missing object
/// never touches the channel the plan is declared on.
struct Inspector<'a> {
    conn: &'a Connection,
    /// Open until a `NOT_FOUND` closes it; the next inspection opens another.
    channel: Option<Channel>,
}

impl<'a> Inspector<'a> {
    fn new(conn: &'a Connection) -> Self {
        Inspector {
            conn,
            channel: None,
        }
    }

    async fn take_channel(&mut self) -> Result<Channel, TransportError> {
        match self.channel.take() {
            Some(channel) => Ok(channel),
            None => self.conn.create_channel().await.map_err(connection_error),
        }
    }

    /// Whether exchange `name` exists.
    async fn exchange_exists(
        &mut self,
        name: ShortString,
        kind: LapinKind,
    ) -> Result<bool, TransportError> {
        let channel = self.take_channel().await?;
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..ExchangeDeclareOptions::default()
        };
        let answer = channel
            .exchange_declare(name, kind, passive, FieldTable::default())
            .await;
        self.exists(channel, answer)
    }

    /// Whether queue `name` exists.
    async fn queue_exists(&mut self, name: ShortString) -> Result<bool, TransportError> {
        let channel = self.take_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let answer = channel
            .queue_declare(name, passive, FieldTable::default())
            .await
            .map(drop);
        self.exists(channel, answer)
    }

    /// Reads the broker's `answer` to a passive declare on `channel`, keeping the channel
    /// while it is open.
    fn exists(
        &mut self,
        channel: Channel,
        answer: Result<(), lapin::Error>,
    ) -> Result<bool, TransportError> {
        match answer {
            Ok(()) => {
                self.channel = Some(channel);
                Ok(true)
            }
            // The broker has closed the channel: it is left to drop.
            Err(err) if amqp_code(&err) == Some(NOT_FOUND) => Ok(false),
            Err(err) => Err(connection_error(err)),
        }
    }

    async fn close(self) {
        if let Some(channel) = self.channel {
            let _ = channel.close(200, "inspected".into()).await;
        }
    }
}

pub(crate) fn kind(k: ExchangeKind) -> LapinKind {
    match k {
        ExchangeKind::Direct => LapinKind::Direct,
        ExchangeKind::Fanout => LapinKind::Fanout,
        ExchangeKind::Topic => LapinKind::Topic,
    }
}

/// Declares every exchange, queue and binding of `plan`, its delay cascade's first; with
/// `inspect`, asks first which objects exist.
pub(crate) async fn provision(
    conn: &Connection,
    plan: &TopologyPlan,
    inspect: bool,
) -> Result<ProvisionReport, TransportError> {
    let mut inspector = inspect.then(|| Inspector::new(conn));
    let channel = conn.create_channel().await.map_err(connection_error)?;
    let mut report = ProvisionReport::default();
    let mut declaring = Declaring {
        channel: &channel,
        inspector: &mut inspector,
        report: &mut report,
    };
    // The cascade first: the plan binds its work queue to the cascade's delivery exchange.
    // Its objects are shared with every work queue that uses the same cascade, so declaring
    // them again for another work queue verifies them (and adds any levels above).
    let cascade = plan.cascade();
    if let Some(cascade) = cascade {
        declaring.exchanges(cascade.exchanges()).await?;
        declaring.queues(cascade.queues()).await?;
        declaring.bindings(cascade.bindings()).await?;
        declaring
            .exchange_bindings(cascade.exchange_bindings())
            .await?;
    }
    declaring.exchanges(plan.exchanges()).await?;
    declaring.queues(plan.queues()).await?;
    declaring.bindings(plan.bindings()).await?;
    if let Some(inspector) = inspector {
        inspector.close().await;
    }
    let _ = channel.close(200, "provisioned".into()).await;
    let cascade_levels = cascade.map_or(0, CascadePlan::levels);
    let bindings = plan.bindings().len()
        + cascade.map_or(0, |c| c.bindings().len() + c.exchange_bindings().len());
    if inspect {
        info!(
            queue = plan.work_queue(),
            created = report.created.len(),
            verified = report.verified.len(),
            bindings,
            cascade_levels,
            "topology provisioned"
        );
    } else {
        let exchanges = plan.exchanges().len() + cascade.map_or(0, |c| c.exchanges().len());
        let queues = plan.queues().len() + cascade.map_or(0, |c| c.queues().len());
        info!(
            queue = plan.work_queue(),
            exchanges, queues, bindings, cascade_levels, "topology declared"
        );
    }
    Ok(report)
}

/// Declarations on one channel, each object inspected first when there is an inspector,
/// and recorded in the report.
struct Declaring<'a, 'c> {
    channel: &'a Channel,
    inspector: &'a mut Option<Inspector<'c>>,
    report: &'a mut ProvisionReport,
}

impl Declaring<'_, '_> {
    async fn exchanges(&mut self, exchanges: &[ExchangeSpec]) -> Result<(), TransportError> {
        for e in exchanges {
            let name = short(&e.name)?;
            let exists = match self.inspector.as_mut() {
                Some(inspector) => Some(
                    inspector
                        .exchange_exists(name.clone(), kind(e.kind))
                        .await?,
                ),
                None => None,
            };
            let options = ExchangeDeclareOptions {
                durable: e.durable,
                ..ExchangeDeclareOptions::default()
            };
            if let Err(err) = self
                .channel
                .exchange_declare(name, kind(e.kind), options, FieldTable::default())
                .await
            {
                return Err(conflict_or(err, "exchange", &e.name));
            }
            record(self.report, exists, "exchange", &e.name);
        }
        Ok(())
    }

    async fn queues(&mut self, queues: &[QueueSpec]) -> Result<(), TransportError> {
        for q in queues {
            let name = short(&q.name)?;
            let exists = match self.inspector.as_mut() {
                Some(inspector) => Some(inspector.queue_exists(name.clone()).await?),
                None => None,
            };
            let options = QueueDeclareOptions {
                durable: q.durable,
                ..QueueDeclareOptions::default()
            };
            let args = table_from_headers(&q.arguments.to_headers());
            if let Err(err) = self.channel.queue_declare(name, options, args).await {
                return Err(conflict_or(err, "queue", &q.name));
            }
            record(self.report, exists, "queue", &q.name);
        }
        Ok(())
    }

    async fn bindings(&mut self, bindings: &[BindingSpec]) -> Result<(), TransportError> {
        for b in bindings {
            self.channel
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
        Ok(())
    }

    async fn exchange_bindings(
        &mut self,
        bindings: &[ExchangeBindingSpec],
    ) -> Result<(), TransportError> {
        for b in bindings {
            self.channel
                .exchange_bind(
                    short(&b.destination)?,
                    short(&b.source)?,
                    short(&b.routing_key)?,
                    ExchangeBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(connection_error)?;
        }
        Ok(())
    }
}

/// Deletes every queue and exchange of `plan`, messages included; never its delay
/// cascade's, which other work queues share. The plan's binding to the cascade's delivery
/// exchange goes with its queue.
pub(crate) async fn teardown(conn: &Connection, plan: &TopologyPlan) -> Result<(), TransportError> {
    delete(conn, plan.queues(), plan.exchanges()).await
}

/// Deletes every queue and exchange of `cascade`, messages included, and so every binding
/// into and out of it.
pub(crate) async fn teardown_cascade(
    conn: &Connection,
    cascade: &CascadePlan,
) -> Result<(), TransportError> {
    delete(conn, cascade.queues(), cascade.exchanges()).await
}

async fn delete(
    conn: &Connection,
    queues: &[QueueSpec],
    exchanges: &[ExchangeSpec],
) -> Result<(), TransportError> {
    let channel = conn.create_channel().await.map_err(connection_error)?;
    for q in queues {
        channel
            .queue_delete(short(&q.name)?, QueueDeleteOptions::default())
            .await
            .map_err(connection_error)?;
    }
    for e in exchanges {
        channel
            .exchange_delete(short(&e.name)?, ExchangeDeleteOptions::default())
            .await
            .map_err(connection_error)?;
    }
    let _ = channel.close(200, "torn down".into()).await;
    Ok(())
}

/// Adds the exchange or queue (`kind`) `name` to `report`, and logs it: at INFO if it was
/// created, at DEBUG if it `existed` or was declared without asking (`None`).
fn record(report: &mut ProvisionReport, existed: Option<bool>, kind: &'static str, name: &str) {
    let object = format!("{kind} {name}");
    match existed {
        Some(true) => {
            debug!(kind, name, "verified");
            report.verified.push(object);
        }
        Some(false) => {
            info!(kind, name, "created");
            report.created.push(object);
        }
        None => {
            debug!(kind, name, "declared");
            report.declared.push(object);
        }
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
