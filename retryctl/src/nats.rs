//! `retryctl topology apply` and `verify` on NATS JetStream, through transport-nats.
//!
//! Every queue of the plan is a stream capturing the subject named after the queue
//! ([`stream_name`]); every stream but the parking one has the durable pull consumer
//! [`CONSUMER`]. Those streams and consumers are the objects `apply` creates and `verify`
//! checks, object by object. There is nothing to probe: the server holds every delayed clone
//! itself (a nak with the time left), with no TTL or dead-lettering to route it.

use retry_core::{QueueRole, TopologyPlan};
use transport_nats::{CONSUMER, stream_name};

use crate::error::CliError;
use crate::outln;
use crate::protocol;
use crate::verify::{no_work_queue, refuse_cascade};

/// One object of the plan on NATS, named as `NatsTransport::missing` names it.
struct Object {
    name: String,
    /// For a consumer, the name of its stream's object: it cannot exist without it.
    stream: Option<String>,
}

/// The streams and consumers of `plan`, in the plan's order of queues.
fn objects(plan: &TopologyPlan) -> Vec<Object> {
    let mut out = Vec::new();
    for q in plan.queues() {
        let stream = stream_name(&q.name);
        let stream_object = format!("stream {stream} (queue {})", q.name);
        out.push(Object {
            name: stream_object.clone(),
            stream: None,
        });
        if !matches!(q.role, QueueRole::Parking) {
            out.push(Object {
                name: format!("consumer {CONSUMER} on stream {stream}"),
                stream: Some(stream_object),
            });
        }
    }
    out
}

/// Creates the streams and consumers of `plan` that are missing, each stream on `replicas`
/// servers, and says object by object which it created and which already existed as
/// planned. One that exists with other settings is an error naming it and the field.
pub async fn apply(plan: &TopologyPlan, url: &str, replicas: usize) -> Result<(), CliError> {
    refuse_cascade(plan)?;
    let transport = protocol::connect_nats(url, replicas).await?;
    outln!(
        "applying the plan of work queue `{}` on {} (NATS JetStream, {replicas} replica{})",
        plan.work_queue(),
        transport.config().url(),
        if replicas == 1 { "" } else { "s" }
    );
    let result = async {
        let missing = transport
            .missing(plan)
            .await
            .map_err(|e| CliError::failure_from("cannot apply the plan", e))?;
        retry_core::Transport::provision(&transport, plan)
            .await
            .map_err(|e| CliError::failure_from("cannot apply the plan", e))?;
        Ok::<_, CliError>(missing)
    }
    .await;
    transport.close().await;
    let missing = result?;
    let objects = objects(plan);
    let mut created = 0;
    for object in &objects {
        // A consumer whose stream was missing is not named by `missing`, and was created
        // with it.
        let new = missing.contains(&object.name)
            || object.stream.as_ref().is_some_and(|s| missing.contains(s));
        created += usize::from(new);
        let status = if new { "created" } else { "verified" };
        outln!("  {status:<9} {}", object.name);
    }
    outln!("{created} created, {} verified", objects.len() - created);
    Ok(())
}

/// Checks that every stream and consumer of `plan` exists with the plan's settings (each
/// stream on `replicas` servers); prints one line per object and fails (exit 1) when one is
/// missing, or exists with other settings.
pub async fn verify(plan: &TopologyPlan, url: &str, replicas: usize) -> Result<(), CliError> {
    refuse_cascade(plan)?;
    let transport = protocol::connect_nats(url, replicas).await?;
    let at = transport.config().url();
    let checked = transport.missing(plan).await;
    transport.close().await;
    let missing = checked.map_err(|e| CliError::failure_from("cannot verify the plan", e))?;
    let work = plan.work_queue();
    if missing.contains(&format!("stream {} (queue {work})", stream_name(work))) {
        return Err(no_work_queue(work, &at));
    }
    outln!(
        "verifying work queue `{work}` on {at} over NATS JetStream: that every stream and \
         consumer exists with the plan's settings (nothing is probed: the server holds the \
         delays itself)"
    );
    let objects = objects(plan);
    let mut failed = 0;
    for object in &objects {
        if missing.contains(&object.name) {
            failed += 1;
            outln!("  FAIL  {}: missing", object.name);
        } else if object.stream.as_ref().is_some_and(|s| missing.contains(s)) {
            failed += 1;
            outln!("  FAIL  {}: missing, with its stream", object.name);
        } else {
            outln!("  ok    {}", object.name);
        }
    }
    if failed > 0 {
        return Err(CliError::failure(format!(
            "{failed} of {} checks failed: the server does not match the plan of `{work}`",
            objects.len()
        )));
    }
    outln!("every stream and consumer of the plan of `{work}` exists as planned");
    Ok(())
}
