//! `retryctl topology`: plan, apply and verify a work queue's topology, through the
//! transport's [`Layout`](retry_core::Layout) (the plan) and [`Admin`] (apply, verify).

use std::fmt::Write as _;
use std::time::Duration;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use retry_core::{
    Admin, Applied, Checked, HeaderValue, PlanOptions, QueueType, TopologyPlan, format_delay,
};
use serde_json::{Value, json};

use crate::broker::Broker;
use crate::error::CliError;
use crate::policy::PlanArgs;
use crate::render::header_json;
use crate::runtime::{block_on, outln};

/// The `topology` subcommands.
#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Print the exchanges, queues (with their arguments) and bindings a work queue needs
    /// for a policy, or the objects the transport lays them out in (streams, on NATS).
    /// Needs no broker.
    Plan {
        #[command(flatten)]
        plan: PlanArgs,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Create the plan's objects on the broker, idempotently, and say which were created
    /// and which already existed as planned. An object that exists with other settings is
    /// an error naming it and the setting. Refused by a transport that cannot create them
    /// (AMQP 1.0: RabbitMQ cannot declare queues over it).
    Apply {
        #[command(flatten)]
        plan: PlanArgs,
    },
    /// Check from outside that the broker matches the plan: every object exists and, over
    /// AMQP 0-9-1, a probe sent through each delay queue comes back where the plan says.
    /// Deletes nothing; stop the work queue's consumers for a conclusive check. Exits 1 on
    /// any mismatch.
    Verify(VerifyArgs),
}

/// `retryctl topology verify`'s arguments.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    #[command(flatten)]
    pub plan: PlanArgs,

    /// The longest a probe waits in a delay queue (default 10s): each probe expires after its
    /// queue's TTL or this, whichever is shorter, and is waited for this long plus 5 s at
    /// most. For a transport that sends probes (AMQP 0-9-1); NATS refuses it.
    #[arg(long, value_name = "DURATION", value_parser = parse_probe_ttl)]
    pub max_probe_ttl: Option<Duration>,
}

fn parse_probe_ttl(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(1) {
        return Err("must be at least 1ms (broker expirations are milliseconds)".into());
    }
    Ok(d)
}

/// Runs a `topology` subcommand against `broker` (`plan` does not connect).
pub fn run(command: TopologyCommand, broker: &Broker) -> Result<(), CliError> {
    match command {
        TopologyCommand::Plan { plan: args, json } => {
            let options = args.options(None);
            let plan = args.plan(broker, &options)?;
            let view = broker.registration()?.layout().view(&plan, &options);
            let text = match (view, json) {
                (Some(view), false) => view.text,
                (Some(view), true) => view.json,
                (None, false) => plan_text(&plan),
                (None, true) => serde_json::to_string_pretty(&plan_json(&plan))
                    .map_err(|e| CliError::failure_from("cannot write the plan as JSON", e))?,
            };
            outln!("{}", text.trim_end());
            Ok(())
        }
        TopologyCommand::Apply { plan: args } => {
            let options = args.options(None);
            let plan = args.plan(broker, &options)?;
            block_on(apply(&plan, &options, broker))
        }
        TopologyCommand::Verify(args) => {
            let options = args.plan.options(args.max_probe_ttl);
            let plan = args.plan.plan(broker, &options)?;
            block_on(verify(&plan, &options, broker))
        }
    }
}

/// Creates `plan`'s objects and prints, object by object, what was created and what was
/// verified.
async fn apply(
    plan: &TopologyPlan,
    options: &PlanOptions,
    broker: &Broker,
) -> Result<(), CliError> {
    let registration = broker.registration()?;
    let settings = registration.layout().settings(options);
    let title = registration.title().to_owned();
    let report = broker
        .with_transport(&settings, async |transport| {
            transport
                .apply(plan)
                .await
                .map_err(|e| CliError::from_transport("cannot apply the plan", e))
        })
        .await?;
    outln!(
        "applied the plan of work queue `{}` on {} ({title})",
        plan.work_queue(),
        broker.shown()
    );
    let count = |applied| report.iter().filter(|o| o.applied == applied).count();
    for object in &report {
        outln!("  {:<9} {}", object.applied.as_str(), object.object);
    }
    outln!(
        "{} created, {} verified",
        count(Applied::Created),
        count(Applied::Verified)
    );
    Ok(())
}

/// Checks the broker against `plan`; prints one line per object and fails (exit 1) on any
/// mismatch.
async fn verify(
    plan: &TopologyPlan,
    options: &PlanOptions,
    broker: &Broker,
) -> Result<(), CliError> {
    let settings = broker.registration()?.layout().settings(options);
    let work = plan.work_queue();
    let at = broker.shown();
    let spinner = ProgressBar::new_spinner()
        .with_style(
            ProgressStyle::with_template("{spinner} {msg} ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        )
        .with_message(format!("checking the broker against the plan of `{work}`"));
    spinner.enable_steady_tick(Duration::from_millis(100));
    let checked = broker
        .with_transport(&settings, async |transport| {
            transport
                .check(plan, options)
                .await
                .map_err(|e| CliError::from_transport("cannot verify the plan", e))
        })
        .await;
    spinner.finish_and_clear();
    let report = checked?;
    if report.is_missing(work) {
        return Err(CliError::failure(format!(
            "there is no queue `{work}` on {at}: check the name, or create its topology with \
             `retryctl topology apply {work} --policy FILE`"
        )));
    }
    match &report.scope {
        Some(scope) => outln!("verifying work queue `{work}` on {at} {scope}"),
        None => outln!("verifying work queue `{work}` on {at}"),
    }
    for object in &report.objects {
        match &object.checked {
            Checked::Ok(detail) if detail.is_empty() => outln!("  ok    {}", object.object),
            Checked::Ok(detail) => outln!("  ok    {}: {detail}", object.object),
            Checked::Missing => outln!("  FAIL  {}: missing", object.object),
            Checked::Failed(problem) => outln!("  FAIL  {}: {problem}", object.object),
        }
    }
    for note in &report.notes {
        outln!("  note  {note}");
    }
    let failed = report.problems();
    if failed > 0 {
        return Err(CliError::failure(format!(
            "{failed} of {} checks failed: the broker does not match the plan of `{work}`",
            report.objects.len()
        )));
    }
    outln!("the broker matches the plan of `{work}`");
    Ok(())
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
        let _ = write!(out, "  {}  ({}{durable}", q.name, q.role.describe());
        let destinations = plan.dead_letter_destinations(q);
        if !destinations.is_empty() {
            let verb = if q.role.ttl().is_some() {
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
                "role": q.role.name(),
                "ttl_ms": q.role.ttl().map(|d| d.as_millis() as u64),
                "durable": q.durable,
                "arguments": arguments,
                "dead_letters_to": plan.dead_letter_destinations(q),
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
