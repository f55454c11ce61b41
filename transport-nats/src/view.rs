//! The plan as operators read it on NATS JetStream ([`NatsLayout`](crate::NatsLayout)'s
//! view): a stream per queue, capturing the queue's name as its subject, with its consumer.
//! The words are `retryctl topology plan`'s.

use std::fmt::Write as _;

use retry_core::{QueueRole, QueueSpec, TopologyPlan};
use serde_json::{Value, json};

use crate::names::{CONSUMER, stream_name};

/// Where a waiting queue's due copies go; nowhere for any other.
fn due_copies_go_to<'p>(plan: &'p TopologyPlan, spec: &'p QueueSpec) -> Vec<&'p str> {
    if spec.role.ttl().is_some() {
        plan.dead_letter_destinations(spec)
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
            q.role.describe()
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
                "role": q.role.name(),
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
