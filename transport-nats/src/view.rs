//! The plan as operators read it on NATS JetStream ([`NatsLayout`](crate::NatsLayout)'s
//! view): a stream per queue, capturing the queue's name as its subject, with its consumer.
//! The words are `retryctl topology plan`'s.

use std::fmt::Write as _;

use retry_core::{QueueRole, QueueSpec, TopologyPlan, format_delay};
use serde_json::{Value, json};

use crate::names::{CONSUMER, stream_name};

/// What a queue is for, in words.
fn role_text(role: QueueRole) -> String {
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

/// The queues of `plan` that a message dead-lettered from `spec` reaches on RabbitMQ: where
/// the transport publishes a delay queue's copies once they are due. Through the default
/// exchange, the queue named by the routing key; through another exchange of the plan, the
/// queues bound to it with that key.
fn dead_letter_destinations<'p>(plan: &'p TopologyPlan, spec: &'p QueueSpec) -> Vec<&'p str> {
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

/// Where a waiting queue's due copies go; nowhere for any other.
fn due_copies_go_to<'p>(plan: &'p TopologyPlan, spec: &'p QueueSpec) -> Vec<&'p str> {
    if spec.role.ttl().is_some() {
        dead_letter_destinations(plan, spec)
    } else {
        Vec::new()
    }
}

/// What a queue's stream keeps: a parking stream what nobody deleted (limits, so tools can
/// read it by sequence), every other one a message until it is acked.
fn retention(role: QueueRole) -> &'static str {
    match role {
        QueueRole::Parking => "limits",
        _ => "work-queue",
    }
}

/// The consumer a queue's stream has: none on a parking stream.
fn consumer(role: QueueRole) -> Option<&'static str> {
    (!matches!(role, QueueRole::Parking)).then_some(CONSUMER)
}

/// The plan as text, each stream on `replicas` servers, without a newline at the end.
pub(crate) fn plan_text(plan: &TopologyPlan, replicas: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan for work queue `{}` on NATS JetStream ({} streams, {replicas} replica{} each)",
        plan.work_queue(),
        plan.queues().len(),
        if replicas == 1 { "" } else { "s" }
    );
    let _ = writeln!(out, "\nstreams");
    for q in plan.queues() {
        let _ = write!(
            out,
            "  {}  (subject {}; {}",
            stream_name(&q.name),
            q.name,
            role_text(q.role)
        );
        let destinations = due_copies_go_to(plan, q);
        if !destinations.is_empty() {
            let _ = write!(out, "; due copies go to {}", destinations.join(", "));
        }
        let _ = writeln!(out, ")");
        let _ = writeln!(out, "      retention  {}", retention(q.role));
        let consumer = consumer(q.role).map_or_else(
            || "none (retryctl parked reads it by sequence)".to_owned(),
            |c| format!("{c} (durable pull, explicit acks)"),
        );
        let _ = writeln!(out, "      consumer   {consumer}");
    }
    out.truncate(out.trim_end().len());
    out
}

/// The plan as a JSON value, each stream on `replicas` servers.
pub(crate) fn plan_json(plan: &TopologyPlan, replicas: usize) -> Value {
    let streams: Vec<Value> = plan
        .queues()
        .iter()
        .map(|q| {
            json!({
                "name": stream_name(&q.name),
                "subject": q.name,
                "role": role_name(q.role),
                "ttl_ms": q.role.ttl().map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
                "retention": retention(q.role),
                "replicas": replicas,
                "consumer": consumer(q.role),
                "due_copies_go_to": due_copies_go_to(plan, q),
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
