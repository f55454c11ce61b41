//! The plan on JetStream: a stream per queue, a durable pull consumer on each one a consumer
//! reads, created when missing and compared field by field when present.

use std::time::Duration;

use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, GetStreamError, GetStreamErrorKind,
};
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{Context, ErrorCode};
use retry_core::{QueueRole, QueueSpec, TopologyPlan, TransportError};

use crate::config::NatsConfig;
use crate::names::{CONSUMER, check_queue_name, stream_name};

/// What the plan needs of one of its queues.
pub(crate) struct Wanted {
    pub queue: String,
    pub stream: stream::Config,
    /// The durable consumer, for every queue a consumer reads (not a parking queue).
    pub consumer: Option<pull::Config>,
}

/// The plan's queues as streams and consumers; a cascade, or a name that cannot be a
/// subject, is refused.
pub(crate) fn wanted(
    plan: &TopologyPlan,
    config: &NatsConfig,
) -> Result<Vec<Wanted>, TransportError> {
    if plan.cascade().is_some() {
        return Err(TransportError::Unsupported {
            what: "a delay cascade on NATS".into(),
            why: "the server holds every delayed clone for exactly its own delay (a nak with the time left), so the per-delay-queue strategy (`DelayStrategy::PerDelayQueue`, the default) already takes any delay without one waiting behind another; a cascade's exchanges have no NATS form".into(),
        });
    }
    plan.queues()
        .iter()
        .map(|spec| {
            check_queue_name(&spec.name)?;
            Ok(wanted_queue(spec, config))
        })
        .collect()
}

fn wanted_queue(spec: &QueueSpec, config: &NatsConfig) -> Wanted {
    let parking = matches!(spec.role, QueueRole::Parking);
    let stream = stream::Config {
        name: stream_name(&spec.name),
        subjects: vec![spec.name.clone()],
        // A parking stream keeps what a walk leaves, and tools browse it: limits. Every
        // other queue loses a message once it is acked: a work queue.
        retention: if parking {
            RetentionPolicy::Limits
        } else {
            RetentionPolicy::WorkQueue
        },
        storage: StorageType::File,
        num_replicas: config.replicas(),
        duplicate_window: config.duplicate_window(),
        discard: DiscardPolicy::Old,
        ..Default::default()
    };
    let consumer = (!parking).then(|| pull::Config {
        durable_name: Some(CONSUMER.to_owned()),
        name: Some(CONSUMER.to_owned()),
        ack_policy: AckPolicy::Explicit,
        ack_wait: config.ack_wait(),
        deliver_policy: DeliverPolicy::All,
        // The engine decides when a message has had enough: the server never gives up on
        // one (a message past `max_deliver` would stay in the stream, never delivered).
        max_deliver: -1,
        // Delayed clones wait on the server as deliveries with a nak delay, each holding
        // a slot: no limit. Subscriptions bound what they hold themselves.
        max_ack_pending: -1,
        ..Default::default()
    });
    Wanted {
        queue: spec.name.clone(),
        stream,
        consumer,
    }
}

fn conflict(object: String, argument: &str, existing: String, wanted: String) -> TransportError {
    TransportError::TopologyConflict {
        object,
        argument: argument.to_owned(),
        existing,
        wanted,
    }
}

/// A conflict on `object` at the first of `fields` (name, the server's value, the plan's)
/// whose values differ.
fn first_difference<const N: usize>(
    object: String,
    fields: [(&str, String, String); N],
) -> Result<(), TransportError> {
    match fields
        .into_iter()
        .find(|(_, existing, wanted)| existing != wanted)
    {
        Some((field, existing, wanted)) => Err(conflict(object, field, existing, wanted)),
        None => Ok(()),
    }
}

fn shown(value: &impl std::fmt::Debug) -> String {
    format!("{value:?}")
}

/// The first field of an existing stream that differs from the plan's.
fn compare_stream(have: &stream::Config, want: &stream::Config) -> Result<(), TransportError> {
    first_difference(
        format!("stream {}", want.name),
        [
            ("subjects", shown(&have.subjects), shown(&want.subjects)),
            ("retention", shown(&have.retention), shown(&want.retention)),
            ("storage", shown(&have.storage), shown(&want.storage)),
            (
                "num_replicas",
                shown(&have.num_replicas),
                shown(&want.num_replicas),
            ),
        ],
    )
}

/// The first field of an existing consumer that differs from the plan's.
fn compare_consumer(
    stream: &str,
    have: &async_nats::jetstream::consumer::Config,
    want: &pull::Config,
) -> Result<(), TransportError> {
    first_difference(
        format!("consumer {CONSUMER} on stream {stream}"),
        [
            (
                "deliver_subject (a push consumer)",
                shown(&have.deliver_subject),
                shown(&None::<String>),
            ),
            (
                "ack_policy",
                shown(&have.ack_policy),
                shown(&want.ack_policy),
            ),
            ("ack_wait", shown(&have.ack_wait), shown(&want.ack_wait)),
            (
                "max_deliver",
                shown(&have.max_deliver),
                shown(&want.max_deliver),
            ),
            (
                "filter_subject",
                shown(&have.filter_subject),
                shown(&want.filter_subject),
            ),
        ],
    )
}

pub(crate) fn stream_missing(e: &GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(err) if err.error_code() == ErrorCode::STREAM_NOT_FOUND)
}

fn consumer_missing(e: &ConsumerInfoError) -> bool {
    match e.kind() {
        ConsumerInfoErrorKind::NotFound => true,
        ConsumerInfoErrorKind::JetStream(err) => err.error_code() == ErrorCode::CONSUMER_NOT_FOUND,
        _ => false,
    }
}

fn failed(what: String, e: impl std::error::Error + Send + Sync + 'static) -> TransportError {
    TransportError::connection_failed(what, e)
}

/// Declares (with `declare`) or checks every stream and consumer of `wanted`. Returns the
/// objects missing (always empty when declaring); a conflict is an error.
pub(crate) async fn apply(
    js: &Context,
    wanted: &[Wanted],
    declare: bool,
    timeout: Duration,
) -> Result<Vec<String>, TransportError> {
    let mut missing = Vec::new();
    for w in wanted {
        let name = &w.stream.name;
        let found = bounded(timeout, "looking up a stream", js.get_stream(name)).await?;
        let stream = match found {
            Ok(s) => {
                // The lookup brought the stream's configuration along.
                compare_stream(&s.cached_info().config, &w.stream)?;
                s
            }
            Err(e) if stream_missing(&e) => {
                if !declare {
                    missing.push(format!("stream {name} (queue {})", w.queue));
                    continue;
                }
                bounded(
                    timeout,
                    "creating a stream",
                    js.create_stream(w.stream.clone()),
                )
                .await?
                .map_err(|e| creation_failed(format!("stream {name} for queue {}", w.queue), e))?
            }
            Err(e) => return Err(failed(format!("looking up stream {name}"), e)),
        };
        let Some(consumer) = &w.consumer else {
            continue;
        };
        let info = bounded(
            timeout,
            "looking up a consumer",
            stream.consumer_info(CONSUMER),
        )
        .await?;
        match info {
            Ok(info) => compare_consumer(name, &info.config, consumer)?,
            Err(e) if consumer_missing(&e) => {
                if !declare {
                    missing.push(format!("consumer {CONSUMER} on stream {name}"));
                    continue;
                }
                bounded(
                    timeout,
                    "creating a consumer",
                    stream.create_consumer(consumer.clone()),
                )
                .await?
                .map_err(|e| creation_failed(format!("consumer {CONSUMER} on stream {name}"), e))?;
            }
            Err(e) => {
                return Err(failed(
                    format!("looking up consumer {CONSUMER} on {name}"),
                    e,
                ));
            }
        }
    }
    Ok(missing)
}

/// A refused creation: the server's words, which name the field (a subject another stream
/// has, a replica count the cluster cannot hold).
fn creation_failed(object: String, e: impl std::fmt::Display) -> TransportError {
    TransportError::Unsupported {
        what: format!("creating {object}"),
        why: format!("the server refused it: {e}"),
    }
}

pub(crate) async fn bounded<F: std::future::Future>(
    timeout: Duration,
    operation: &'static str,
    future: F,
) -> Result<F::Output, TransportError> {
    tokio::time::timeout(timeout, future)
        .await
        .map_err(|_| TransportError::Timeout {
            operation,
            after: timeout,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use retry_core::{CrashAction, RetryPolicy};

    #[test]
    fn every_queue_is_a_stream_of_its_own_subject_and_parking_keeps_what_it_holds() {
        let policy = RetryPolicy::builder()
            .with_on_crash(CrashAction::Divert)
            .with_crash_delay(Duration::from_secs(5))
            .build()
            .unwrap();
        let plan = TopologyPlan::new("orders", &policy).unwrap();
        let config = NatsConfig::new("nats://127.0.0.1:4222");
        let wanted = wanted(&plan, &config).unwrap();
        let streams: Vec<(&str, &str, bool)> = wanted
            .iter()
            .map(|w| {
                (
                    w.stream.name.as_str(),
                    w.stream.subjects[0].as_str(),
                    w.consumer.is_some(),
                )
            })
            .collect();
        assert!(streams.contains(&("orders", "orders", true)));
        assert!(streams.contains(&("orders_suspect", "orders.suspect", true)));
        assert!(streams.contains(&("orders_crash_5s", "orders.crash.5s", true)));
        assert!(streams.contains(&("orders_parking", "orders.parking", false)));
        for w in &wanted {
            let parking = w.queue == "orders.parking";
            assert_eq!(
                w.stream.retention == RetentionPolicy::Limits,
                parking,
                "{}",
                w.queue
            );
        }
    }

    #[test]
    fn a_cascade_and_a_wildcard_name_are_refused() {
        let policy = RetryPolicy::default();
        let config = NatsConfig::new("nats://127.0.0.1:4222");
        let cascade = TopologyPlan::builder("orders", &policy)
            .with_strategy(retry_core::DelayStrategy::Cascade(
                retry_core::Cascade::new(),
            ))
            .build()
            .unwrap();
        let err = wanted(&cascade, &config).err().unwrap();
        assert!(err.to_string().contains("cascade"), "{err}");
        let plan = TopologyPlan::new("orders.>", &policy).unwrap();
        let err = wanted(&plan, &config).err().unwrap();
        assert!(err.to_string().contains("wildcard"), "{err}");
    }

    #[test]
    fn a_stream_with_other_settings_is_named_with_its_field() {
        let config = NatsConfig::new("nats://127.0.0.1:4222");
        let policy = RetryPolicy::default();
        let plan = TopologyPlan::new("orders", &policy).unwrap();
        let want = &wanted(&plan, &config).unwrap()[0].stream;
        let mut have = want.clone();
        have.retention = RetentionPolicy::Limits;
        let err = compare_stream(&have, want).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("stream orders") && text.contains("retention"),
            "{text}"
        );
    }
}
