//! What operators' tools ask of NATS JetStream ([`Admin`]), and how a plan is laid out on it
//! ([`NatsLayout`]).
//!
//! Every queue of the plan is a stream capturing the subject named after the queue
//! ([`stream_name`]); every stream but the parking one has the durable pull consumer
//! [`CONSUMER`]. Those streams and consumers are the objects [`Admin::apply`] creates and
//! [`Admin::check`] checks, object by object. There is nothing to probe: the server holds
//! every delayed copy itself (a nak with the time left), with no TTL or dead-lettering to
//! route it.

use async_trait::async_trait;
use retry_core::{
    Admin, Applied, AppliedObject, CheckReport, Checked, Depth, Layout, ObjectCheck, PlanError,
    PlanOption, PlanOptions, PlanView, QueueRole, QueueType, RetryPolicy, TopologyPlan, Transport,
    TransportError,
};

use crate::names::{CONSUMER, check_queue_name, stream_name};
use crate::transport::NatsTransport;
use crate::view;

/// The transport's title, as refusals name it.
const TITLE: &str = "NATS JetStream";

/// One object of the plan on NATS, named as [`NatsTransport::missing`] names it.
struct Object {
    name: String,
    /// The plan's queue, for a stream.
    queue: Option<String>,
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
            queue: Some(q.name.clone()),
            stream: None,
        });
        if !matches!(q.role, QueueRole::Parking) {
            out.push(Object {
                name: format!("consumer {CONSUMER} on stream {stream}"),
                queue: None,
                stream: Some(stream_object),
            });
        }
    }
    out
}

/// Streams and consumers, each stream on as many servers as the transport's
/// [`NatsConfig::with_replicas`](crate::NatsConfig::with_replicas) says.
///
/// * [`depth`](Admin::depth) is [`count`](NatsTransport::count) (which first purges copies
///   of acked messages a killed server left), and [`Depth::Missing`] without the stream.
/// * [`apply`](Admin::apply) creates the streams and consumers that are missing, and
///   reports each one `created` (a consumer whose stream was missing was created with it)
///   or `verified`. One that exists with other settings is
///   [`TransportError::TopologyConflict`], naming it and the field.
/// * [`check`](Admin::check) reports each one `ok`, missing, or (a consumer whose stream is
///   missing) failed `missing, with its stream`; nothing is probed, so
///   [`PlanOptions::max_probe_ttl`] has no effect (and [`NatsLayout`] refuses it).
///
/// A plan with a delay cascade is [`TransportError::Unsupported`]: the server holds each
/// delay itself, and a cascade's exchanges have no NATS form.
///
/// ```no_run
/// use retry_core::{Admin, Depth, PlanOptions, RetryPolicy, TopologyPlan};
/// use transport_nats::{NatsConfig, NatsTransport};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let transport = NatsTransport::connect(NatsConfig::new("nats://127.0.0.1:4222")).await?;
/// let plan = TopologyPlan::new("comments", &RetryPolicy::default())?;
/// for line in transport.apply(&plan).await? {
///     println!("{:<9} {}", line.applied.as_str(), line.object);
/// }
/// let report = transport.check(&plan, &PlanOptions::new()).await?;
/// assert_eq!(report.problems(), 0);
/// assert_eq!(transport.depth("comments").await?, Depth::Ready(0));
/// transport.close().await;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[async_trait]
impl Admin for NatsTransport {
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        match self.count(queue).await {
            Ok(n) => Ok(Depth::Ready(n)),
            Err(TransportError::MissingAddress { .. }) => Ok(Depth::Missing),
            Err(e) => Err(e),
        }
    }

    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        let missing = self.missing(plan).await?;
        Transport::provision(self, plan).await?;
        Ok(objects(plan)
            .into_iter()
            .map(|object| {
                // A consumer whose stream was missing is not named by `missing`, and was
                // created with it.
                let new = missing.contains(&object.name)
                    || object.stream.as_ref().is_some_and(|s| missing.contains(s));
                let applied = if new {
                    Applied::Created
                } else {
                    Applied::Verified
                };
                AppliedObject::new(object.name, applied)
            })
            .collect())
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        _options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        let missing = self.missing(plan).await?;
        let checks = objects(plan)
            .into_iter()
            .map(|object| {
                let checked = if missing.contains(&object.name) {
                    Checked::Missing
                } else if object.stream.as_ref().is_some_and(|s| missing.contains(s)) {
                    Checked::Failed("missing, with its stream".into())
                } else {
                    Checked::Ok(String::new())
                };
                let check = ObjectCheck::new(object.name, checked);
                match object.queue {
                    Some(queue) => check.for_queue(queue),
                    None => check,
                }
            })
            .collect();
        Ok(CheckReport::new(checks).with_scope(
            "over NATS JetStream: that every stream and consumer exists with the plan's \
             settings (nothing is probed: the server holds the delays itself)",
        ))
    }
}

/// How a plan is laid out on NATS JetStream, known without connecting: what the
/// [`registration`](crate::registration) gives `retryctl topology`.
///
/// * [`plan`](Layout::plan): the plan with classic queues and no replication factor of its
///   own (a queue type is RabbitMQ's); a replication factor of 1 to 5 is the streams'
///   replica count, which [`settings`](Layout::settings) hands the connection as
///   `replicas`. A queue type, a replication factor outside 1 to 5 and a probe TTL are
///   refused, and so is a queue name that cannot be a subject
///   ([`check_queue_name`]).
/// * [`view`](Layout::view): the streams, their subjects, retention and consumer, as text
///   and JSON.
///
/// ```
/// use retry_core::{Layout, PlanError, PlanOptions, QueueType, RetryPolicy};
/// use transport_nats::NatsLayout;
///
/// let policy = RetryPolicy::default();
/// let options = PlanOptions::new().with_replication_factor(3);
/// let plan = NatsLayout.plan("nats://127.0.0.1:4222", "comments", &policy, &options)?;
/// let view = NatsLayout.view(&plan, &options).unwrap();
/// assert!(view.text.starts_with("plan for work queue `comments` on NATS JetStream ("));
/// assert!(view.text.contains("3 replicas each"));
/// assert_eq!(NatsLayout.settings(&options), [("replicas".to_owned(), "3".to_owned())]);
///
/// let quorum = PlanOptions::new().with_queue_type(QueueType::Quorum);
/// let err = NatsLayout.plan("nats://127.0.0.1:4222", "comments", &policy, &quorum).unwrap_err();
/// assert!(matches!(err, PlanError::Unsupported { .. }));
/// # Ok::<(), PlanError>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct NatsLayout;

impl Layout for NatsLayout {
    fn plan(
        &self,
        _url: &str,
        queue: &str,
        policy: &RetryPolicy,
        options: &PlanOptions,
    ) -> Result<TopologyPlan, PlanError> {
        if options.max_probe_ttl.is_some() {
            return Err(PlanError::Unsupported {
                option: PlanOption::MaxProbeTtl,
                transport: TITLE.into(),
                why: "nothing is probed, as the server holds every delayed copy itself (no \
                      queue TTL or dead-lettering routes it); the check looks at the streams \
                      and consumers"
                    .into(),
            });
        }
        if let Some(queue_type) = options.queue_type {
            return Err(PlanError::Unsupported {
                option: match queue_type {
                    QueueType::Quorum => PlanOption::Quorum,
                    QueueType::Classic => PlanOption::Classic,
                },
                transport: TITLE.into(),
                why: "queue types are RabbitMQ's, and every queue is a stream; a replication \
                      factor of N keeps each stream on N servers"
                    .into(),
            });
        }
        if let Some(n) = options.replication_factor
            && !(1..=5).contains(&n)
        {
            return Err(PlanError::OutOfRange {
                option: PlanOption::ReplicationFactor,
                value: n.to_string(),
                transport: TITLE.into(),
                why: "a NATS JetStream stream has 1 to 5 replicas".into(),
            });
        }
        let plan = TopologyPlan::builder(queue, policy)
            .build()
            .map_err(|source| PlanError::Topology {
                queue: queue.to_owned(),
                source,
            })?;
        if plan.cascade().is_some() {
            return Err(PlanError::Refused {
                queue: queue.to_owned(),
                transport: TITLE.into(),
                why: "the server holds every delayed copy for exactly its own delay, so the \
                      per-delay-queue strategy takes any delay without one waiting behind \
                      another; a cascade's exchanges have no NATS form"
                    .into(),
            });
        }
        for q in plan.queues() {
            check_queue_name(&q.name).map_err(|e| PlanError::BadName {
                queue: queue.to_owned(),
                transport: TITLE.into(),
                source: Box::new(e),
            })?;
        }
        Ok(plan)
    }

    fn view(&self, plan: &TopologyPlan, options: &PlanOptions) -> Option<PlanView> {
        let replicas = replicas(options);
        let json = serde_json::to_string_pretty(&view::plan_json(plan, replicas))
            .unwrap_or_else(|e| format!("{{\"error\": {:?}}}", e.to_string()));
        Some(PlanView::new(view::plan_text(plan, replicas), json))
    }

    fn settings(&self, options: &PlanOptions) -> Vec<(String, String)> {
        options
            .replication_factor
            .map(|n| ("replicas".to_owned(), n.to_string()))
            .into_iter()
            .collect()
    }
}

/// The streams' replica count `options` ask for: 1 without a replication factor.
fn replicas(options: &PlanOptions) -> usize {
    options
        .replication_factor
        .map_or(1, |n| usize::try_from(n).unwrap_or(usize::MAX))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use retry_core::{CrashAction, RetryPolicy};

    use super::*;

    const URL: &str = "nats://127.0.0.1:4222";

    fn policy() -> RetryPolicy {
        RetryPolicy::delays([Duration::from_millis(500), Duration::from_secs(30)])
            .build()
            .unwrap()
    }

    #[test]
    fn objects_are_named_as_missing_names_them_and_parking_has_no_consumer() {
        let policy = RetryPolicy::builder()
            .with_on_crash(CrashAction::Divert)
            .with_crash_delay(Duration::from_secs(5))
            .build()
            .unwrap();
        let plan = TopologyPlan::new("orders", &policy).unwrap();
        let objects = objects(&plan);
        let names: Vec<&str> = objects.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names[0], "stream orders (queue orders)");
        assert_eq!(names[1], "consumer retry-engine on stream orders");
        assert!(names.contains(&"stream orders_parking (queue orders.parking)"));
        assert!(!names.contains(&"consumer retry-engine on stream orders_parking"));
        assert_eq!(objects[1].stream.as_deref(), Some(names[0]));
        assert_eq!(objects[0].queue.as_deref(), Some("orders"));
        assert!(objects[1].queue.is_none());
    }

    #[test]
    fn options_with_no_meaning_on_nats_are_refused_by_name() {
        let refusal = |options: PlanOptions| {
            NatsLayout
                .plan(URL, "q", &policy(), &options)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            refusal(PlanOptions::new().with_queue_type(QueueType::Quorum)),
            "a quorum queue type does not apply on NATS JetStream: queue types are RabbitMQ's, \
             and every queue is a stream; a replication factor of N keeps each stream on N \
             servers"
        );
        assert!(
            refusal(PlanOptions::new().with_queue_type(QueueType::Classic))
                .starts_with("a classic queue type does not apply on NATS JetStream")
        );
        assert_eq!(
            refusal(PlanOptions::new().with_replication_factor(0)),
            "a replication factor of 0 on NATS JetStream: a NATS JetStream stream has 1 to 5 \
             replicas"
        );
        assert!(
            refusal(PlanOptions::new().with_max_probe_ttl(Duration::from_secs(2)))
                .starts_with("a probe TTL does not apply on NATS JetStream: nothing is probed")
        );
        let err = NatsLayout
            .plan(URL, "orders.*", &policy(), &PlanOptions::new())
            .unwrap_err();
        assert!(matches!(err, PlanError::BadName { .. }), "{err:?}");
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert!(source.contains("wildcard"), "{source}");
    }

    #[test]
    fn a_replication_factor_is_the_streams_replicas_not_the_plans() {
        let options = PlanOptions::new().with_replication_factor(5);
        let plan = NatsLayout.plan(URL, "q", &policy(), &options).unwrap();
        assert_eq!(plan.queue_type(), QueueType::Classic);
        assert_eq!(plan, TopologyPlan::new("q", &policy()).unwrap());
        assert_eq!(
            NatsLayout.settings(&options),
            [("replicas".to_owned(), "5".to_owned())]
        );
        assert!(NatsLayout.settings(&PlanOptions::new()).is_empty());
    }

    #[test]
    fn the_view_shows_each_stream_its_subject_and_consumer() {
        let options = PlanOptions::new();
        let plan = NatsLayout
            .plan(URL, "comments", &policy(), &options)
            .unwrap();
        let view = NatsLayout.view(&plan, &options).unwrap();
        assert!(
            view.text.starts_with(
                "plan for work queue `comments` on NATS JetStream (6 streams, 1 replica each)\n\
                 \nstreams\n  comments  (subject comments; work queue)\n      retention  \
                 work-queue\n      consumer   retry-engine (durable pull, explicit acks)\n"
            ),
            "{}",
            view.text
        );
        assert!(
            view.text.contains(
                "  comments_retry_500ms  (subject comments.retry.500ms; delay queue, 500ms; \
                 due copies go to comments)\n"
            ),
            "{}",
            view.text
        );
        assert!(
            view.text.ends_with(
                "  comments_parking  (subject comments.parking; parking queue)\n      \
                 retention  limits\n      consumer   none (retryctl parked reads it by sequence)"
            ),
            "{}",
            view.text
        );
        let json: serde_json::Value = serde_json::from_str(&view.json).unwrap();
        assert_eq!(json["protocol"], "nats");
        assert_eq!(json["replicas"], 1);
        let streams = json["streams"].as_array().unwrap();
        assert_eq!(streams.len(), 6);
        assert_eq!(streams[1]["ttl_ms"], 500, "{json:#}");
        assert_eq!(streams[1]["due_copies_go_to"][0], "comments", "{json:#}");
        assert_eq!(streams[4]["role"], "crash-delay", "{json:#}");
        assert_eq!(streams[4]["due_copies_go_to"][0], "comments.suspect");
        assert_eq!(streams[5]["name"], "comments_parking");
        assert_eq!(streams[5]["retention"], "limits");
        assert_eq!(streams[5]["consumer"], serde_json::Value::Null);
        assert_eq!(streams[5]["due_copies_go_to"], serde_json::json!([]));
    }
}
