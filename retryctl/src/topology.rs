//! `retryctl topology`: plan, apply and verify a work queue's topology.

use std::fmt::Write as _;

use clap::Subcommand;
use retry_core::{
    HeaderValue, QueueRole, QueueSpec, QueueType, TopologyPlan, format_delay, redact_url,
};
use serde_json::{Value, json};
use transport_nats::{CONSUMER, stream_name};

use crate::error::CliError;
use crate::policy::{PlanArgs, role_ttl};
use crate::protocol::Protocol;
use crate::render::header_json;
use crate::verify::{self, VerifyArgs, refuse_cascade};
use crate::{Broker, DEFAULT_URL, block_on, broker, nats, outln};

/// The `topology` subcommands.
#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Print the exchanges, queues (with their arguments) and bindings a work queue needs
    /// for a policy. Needs no broker.
    Plan {
        #[command(flatten)]
        plan: PlanArgs,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Declare the plan on the broker, idempotently, and say which objects were created and
    /// which already existed as planned. An object that exists with other settings is an
    /// error naming it and the setting. AMQP 0-9-1 or NATS (streams and consumers): RabbitMQ
    /// cannot declare queues over AMQP 1.0.
    Apply {
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Check from outside that the broker matches the plan: every object exists, and a probe
    /// sent through each delay queue comes back where the plan says. Deletes nothing; stop
    /// the work queue's consumers for a conclusive check. Exits 1 on any mismatch. Over AMQP
    /// 1.0 and NATS only the objects are checked: the probes need AMQP 0-9-1.
    Verify(VerifyArgs),
}

/// Runs a `topology` subcommand against `broker` (`plan` does not connect).
pub fn run(command: TopologyCommand, broker: &Broker<'_>) -> Result<(), CliError> {
    let url = broker.url;
    match command {
        // The plan needs no broker: the URL only says which form it takes. A URL no protocol
        // speaks gets the AMQP form, as before NATS.
        TopologyCommand::Plan { plan, json } if broker.protocol().ok() == Some(Protocol::Nats) => {
            let (plan, replicas) = plan.nats_plan()?;
            refuse_cascade(&plan)?;
            if json {
                let text = serde_json::to_string_pretty(&nats_plan_json(&plan, replicas))
                    .map_err(|e| CliError::failure_from("cannot write the plan as JSON", e))?;
                outln!("{text}");
            } else {
                outln!("{}", nats_plan_text(&plan, replicas).trim_end());
            }
            Ok(())
        }
        TopologyCommand::Plan { plan, json } => {
            let plan = plan.plan(url)?;
            if json {
                let text = serde_json::to_string_pretty(&plan_json(&plan))
                    .map_err(|e| CliError::failure_from("cannot write the plan as JSON", e))?;
                outln!("{text}");
            } else {
                outln!("{}", plan_text(&plan).trim_end());
            }
            Ok(())
        }
        TopologyCommand::Apply { plan } => match broker.protocol()? {
            Protocol::Amqp091 => {
                let plan = plan.plan(url)?;
                block_on(apply(&plan, url))
            }
            Protocol::Amqp10 => Err(CliError::usage(format!(
                "topology apply needs AMQP 0-9-1: RabbitMQ cannot declare queues over AMQP \
                 1.0. Run it without --protocol amqp10, on the broker's AMQP 0-9-1 URL \
                 (amqp://USER:PASSWORD@HOST:5672/VHOST, e.g. {}); `topology verify \
                 --protocol amqp10` then checks the result over AMQP 1.0",
                redact_url(DEFAULT_URL)
            ))),
            Protocol::Nats => {
                let (plan, replicas) = plan.nats_plan()?;
                block_on(nats::apply(&plan, url, replicas))
            }
        },
        TopologyCommand::Verify(args) => {
            let protocol = broker.protocol()?;
            if protocol == Protocol::Nats {
                if args.max_probe_ttl.is_some() {
                    return Err(CliError::usage(
                        "--max-probe-ttl does not apply on NATS JetStream: nothing is probed, \
                         as the server holds every delayed copy itself (no queue TTL or \
                         dead-lettering routes it); verify checks the streams and consumers",
                    ));
                }
                let (plan, replicas) = args.plan.nats_plan()?;
                return block_on(nats::verify(&plan, url, replicas));
            }
            let plan = args.plan.plan(url)?;
            match protocol {
                Protocol::Amqp091 => block_on(verify::verify(&plan, &args, url)),
                Protocol::Amqp10 => block_on(verify::verify_amqp10(&plan, url)),
                Protocol::Nats => unreachable!("answered above"),
            }
        }
    }
}

/// Declares `plan` and prints, object by object, what was created and what was verified.
async fn apply(plan: &TopologyPlan, url: &str) -> Result<(), CliError> {
    let transport = broker::connect(url).await?;
    outln!(
        "applying the plan of work queue `{}` on {}",
        plan.work_queue(),
        transport.config().redacted_url()
    );
    let provisioned = transport.provision_inspected(plan).await;
    let _ = transport.close().await;
    let report = provisioned?;
    let objects = plan
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)));
    for object in objects {
        let status = if report.created.contains(&object) {
            "created"
        } else if report.verified.contains(&object) {
            "verified"
        } else {
            "declared"
        };
        outln!("  {status:<9} {object}");
    }
    outln!("  {:<9} {} bindings", "declared", plan.bindings().len());
    outln!(
        "{} created, {} verified",
        report.created.len(),
        report.verified.len()
    );
    Ok(())
}

/// What a queue is for, in words.
pub fn role_text(role: QueueRole) -> String {
    match role {
        QueueRole::Work => "work queue".into(),
        QueueRole::Delay { ttl } => format!("delay queue, {}", format_delay(ttl)),
        QueueRole::Isolation => "isolation queue, where suspects run alone".into(),
        QueueRole::CrashDelay { ttl } => format!("crash-delay queue, {}", format_delay(ttl)),
        QueueRole::Parking => "parking queue".into(),
        QueueRole::CascadeLevel { level, ttl } => {
            format!("cascade level {level}, {}", format_delay(ttl))
        }
    }
}

/// The role's short name, as JSON gives it.
fn role_name(role: QueueRole) -> &'static str {
    match role {
        QueueRole::Work => "work",
        QueueRole::Delay { .. } => "delay",
        QueueRole::Isolation => "isolation",
        QueueRole::CrashDelay { .. } => "crash-delay",
        QueueRole::Parking => "parking",
        QueueRole::CascadeLevel { .. } => "cascade-level",
    }
}

/// The queues of `plan` that a message dead-lettered from `spec` reaches: through the default
/// exchange, the queue named by the routing key; through another exchange of the plan, the
/// queues bound to it with that key.
pub fn dead_letter_destinations<'p>(plan: &'p TopologyPlan, spec: &'p QueueSpec) -> Vec<&'p str> {
    let args = &spec.arguments;
    let (Some(exchange), Some(key)) = (&args.dead_letter_exchange, &args.dead_letter_routing_key)
    else {
        return Vec::new();
    };
    if exchange.is_empty() {
        return vec![key.as_str()];
    }
    plan.bindings()
        .iter()
        .filter(|b| &b.exchange == exchange && &b.routing_key == key)
        .map(|b| b.queue.as_str())
        .collect()
}

fn queue_type_name(t: QueueType) -> &'static str {
    match t {
        QueueType::Classic => "classic",
        QueueType::Quorum => "quorum",
    }
}

/// An argument's value as an operator reads it.
fn argument_text(name: &str, value: &HeaderValue) -> String {
    match value {
        HeaderValue::Str(s) if s.is_empty() && name == "x-dead-letter-exchange" => {
            "\"\" (the default exchange)".into()
        }
        HeaderValue::Str(s) => s.clone(),
        HeaderValue::Int(ms) if name == "x-message-ttl" => {
            let ttl = std::time::Duration::from_millis(u64::try_from(*ms).unwrap_or(0));
            format!("{ms} ({})", format_delay(ttl))
        }
        HeaderValue::Int(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

/// The plan as text: exchanges, queues with their arguments, bindings.
fn plan_text(plan: &TopologyPlan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan for work queue `{}` ({} queues)",
        plan.work_queue(),
        queue_type_name(plan.queue_type())
    );
    let _ = writeln!(out, "\nexchanges");
    let width = plan.exchanges().iter().map(|e| e.name.len()).max();
    for e in plan.exchanges() {
        let durable = if e.durable { ", durable" } else { "" };
        let _ = writeln!(
            out,
            "  {:<w$}  {}{durable}",
            e.name,
            e.kind.as_str(),
            w = width.unwrap_or(0)
        );
    }
    let _ = writeln!(out, "\nqueues");
    for q in plan.queues() {
        let durable = if q.durable { ", durable" } else { "" };
        let _ = write!(out, "  {}  ({}{durable}", q.name, role_text(q.role));
        let destinations = dead_letter_destinations(plan, q);
        if !destinations.is_empty() {
            let verb = if role_ttl(q.role).is_some() {
                "expires into"
            } else {
                "dead-letters into"
            };
            let _ = write!(out, "; {verb} {}", destinations.join(", "));
        }
        let _ = writeln!(out, ")");
        let headers = q.arguments.to_headers();
        let width = headers.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (name, value) in headers.iter() {
            let _ = writeln!(out, "      {name:<width$}  {}", argument_text(name, value));
        }
    }
    let _ = writeln!(out, "\nbindings");
    for b in plan.bindings() {
        let _ = writeln!(
            out,
            "  {} -> {}  (routing key {})",
            b.exchange, b.queue, b.routing_key
        );
    }
    out
}

/// What a queue's stream keeps on NATS: a parking stream what nobody deleted (limits, so
/// `retryctl parked` can read it by sequence), every other one a message until it is acked.
fn nats_retention(role: QueueRole) -> &'static str {
    match role {
        QueueRole::Parking => "limits",
        _ => "work-queue",
    }
}

/// The consumer a queue's stream has on NATS: none on a parking stream.
fn nats_consumer(role: QueueRole) -> Option<&'static str> {
    (!matches!(role, QueueRole::Parking)).then_some(CONSUMER)
}

/// The plan as NATS JetStream has it: a stream per queue, capturing the queue's name as its
/// subject, with its consumer.
fn nats_plan_text(plan: &TopologyPlan, replicas: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan for work queue `{}` on NATS JetStream ({} streams, {replicas} replica{} each)",
        plan.work_queue(),
        plan.queues().len(),
        if replicas == 1 { "" } else { "s" }
    );
    let _ = writeln!(
        out,
        "
streams"
    );
    for q in plan.queues() {
        let _ = write!(
            out,
            "  {}  (subject {}; {}",
            stream_name(&q.name),
            q.name,
            role_text(q.role)
        );
        let destinations = dead_letter_destinations(plan, q);
        if role_ttl(q.role).is_some() && !destinations.is_empty() {
            let _ = write!(out, "; due copies go to {}", destinations.join(", "));
        }
        let _ = writeln!(out, ")");
        let _ = writeln!(out, "      retention  {}", nats_retention(q.role));
        let consumer = nats_consumer(q.role).map_or_else(
            || "none (retryctl parked reads it by sequence)".to_owned(),
            |c| format!("{c} (durable pull, explicit acks)"),
        );
        let _ = writeln!(out, "      consumer   {consumer}");
    }
    out
}

/// The plan on NATS as JSON.
fn nats_plan_json(plan: &TopologyPlan, replicas: usize) -> Value {
    let streams: Vec<Value> = plan
        .queues()
        .iter()
        .map(|q| {
            let due_to = if role_ttl(q.role).is_some() {
                dead_letter_destinations(plan, q)
            } else {
                Vec::new()
            };
            json!({
                "name": stream_name(&q.name),
                "subject": q.name,
                "role": role_name(q.role),
                "ttl_ms": role_ttl(q.role).map(|d| d.as_millis() as u64),
                "retention": nats_retention(q.role),
                "replicas": replicas,
                "consumer": nats_consumer(q.role),
                "due_copies_go_to": due_to,
            })
        })
        .collect();
    json!({
        "work_queue": plan.work_queue(),
        "protocol": "nats",
        "replicas": replicas,
        "streams": streams,
    })
}

/// The plan as JSON.
fn plan_json(plan: &TopologyPlan) -> Value {
    let exchanges: Vec<Value> = plan
        .exchanges()
        .iter()
        .map(|e| json!({ "name": e.name, "type": e.kind.as_str(), "durable": e.durable }))
        .collect();
    let queues: Vec<Value> = plan
        .queues()
        .iter()
        .map(|q| {
            let arguments = Value::Object(
                q.arguments
                    .to_headers()
                    .iter()
                    .map(|(k, v)| (k.to_owned(), header_json(v)))
                    .collect(),
            );
            json!({
                "name": q.name,
                "role": role_name(q.role),
                "ttl_ms": role_ttl(q.role).map(|d| d.as_millis() as u64),
                "durable": q.durable,
                "arguments": arguments,
                "dead_letters_to": dead_letter_destinations(plan, q),
            })
        })
        .collect();
    let bindings: Vec<Value> = plan
        .bindings()
        .iter()
        .map(|b| json!({ "exchange": b.exchange, "queue": b.queue, "routing_key": b.routing_key }))
        .collect();
    json!({
        "work_queue": plan.work_queue(),
        "queue_type": queue_type_name(plan.queue_type()),
        "exchanges": exchanges,
        "queues": queues,
        "bindings": bindings,
    })
}
