//! What operators' tools ask of the in-memory broker ([`Admin`]): a queue's depth, applying a
//! plan object by object, and checking that its objects exist.

use async_trait::async_trait;
use retry_core::{
    Admin, Applied, AppliedObject, CheckReport, Checked, Depth, ExchangeSpec, ObjectCheck,
    PlanOptions, QueueSpec, TopologyPlan, TransportError,
};

use crate::broker::Broker;
use crate::broker::error::BrokerError;
use crate::transport::connection::MemoryTransport;
use crate::transport::provision::{declare, declare_cascade};

/// The exchanges and queues `plan` needs, in the order they are declared: its delay
/// cascade's first, when it has one, then its own.
fn needed(plan: &TopologyPlan) -> (Vec<&ExchangeSpec>, Vec<&QueueSpec>) {
    let cascade = plan.cascade();
    let exchanges = cascade
        .map(|c| c.exchanges())
        .unwrap_or_default()
        .iter()
        .chain(plan.exchanges())
        .collect();
    let queues = cascade
        .map(|c| c.queues())
        .unwrap_or_default()
        .iter()
        .chain(plan.queues())
        .collect();
    (exchanges, queues)
}

/// Whether exchange `name` exists on `broker`.
fn has_exchange(broker: &Broker, name: &str) -> bool {
    broker.shared.with(|s| s.has_exchange(name))
}

/// The broker model as operators' tools see it, through this connection (which must be open,
/// or recover).
///
/// * [`depth`](Admin::depth): the queue's ready messages ([`Broker::ready`]), or
///   [`Depth::Missing`].
/// * [`apply`](Admin::apply): declares the plan as [`provision`](retry_core::Transport::provision)
///   does, and reports each exchange and queue (a delay cascade's first) `created` when it
///   did not exist before, `verified` when it did, and each of the plan's own bindings
///   `declared`. An object that exists with other settings is
///   [`TransportError::TopologyConflict`], and the objects before it stay declared.
/// * [`check`](Admin::check): each exchange and queue is there (a queue with its ready
///   messages and consumers) or [`Checked::Missing`]. Nothing is probed, and bindings are
///   not looked at.
///
/// ```
/// use retry_core::{Admin, Applied, Depth, PlanOptions, RetryPolicy, TopologyPlan};
/// use transport_memory::{Broker, Outgoing};
///
/// # futures::executor::block_on(async {
/// let broker = Broker::new();
/// let transport = broker.connect();
/// let plan = TopologyPlan::new("orders", &RetryPolicy::default())?;
/// assert_eq!(transport.depth("orders").await?, Depth::Missing);
///
/// let applied = transport.apply(&plan).await?;
/// assert_eq!(applied[0].object, "exchange orders.retry");
/// assert_eq!(applied[0].applied, Applied::Created);
/// broker.publish(Outgoing::to_queue("orders", b"hi".to_vec()))?;
/// assert_eq!(transport.depth("orders").await?, Depth::Ready(1));
///
/// let report = transport.check(&plan, &PlanOptions::new()).await?;
/// assert_eq!(report.problems(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[async_trait]
impl Admin for MemoryTransport {
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        self.ensure_open()?;
        Ok(self
            .broker()
            .ready(queue)
            .map_or(Depth::Missing, |n| Depth::Ready(n as u64)))
    }

    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        self.ensure_open()?;
        let (exchanges, queues) = needed(plan);
        // Under one lock: what existed before is what this declaration found.
        let (exchanges_there, queues_there) = self.broker().shared.with(|s| {
            let exchanges_there: Vec<bool> =
                exchanges.iter().map(|e| s.has_exchange(&e.name)).collect();
            let queues_there: Vec<bool> = queues
                .iter()
                .map(|q| s.queues().find(&q.name).is_some())
                .collect();
            if let Some(cascade) = plan.cascade() {
                declare_cascade(s, cascade)?;
            }
            declare(s, plan.exchanges(), plan.queues(), plan.bindings())?;
            Ok::<_, BrokerError>((exchanges_there, queues_there))
        })?;
        let applied = |there: bool| {
            if there {
                Applied::Verified
            } else {
                Applied::Created
            }
        };
        let mut out = Vec::with_capacity(exchanges.len() + queues.len() + plan.bindings().len());
        for (e, there) in exchanges.iter().zip(exchanges_there) {
            out.push(AppliedObject::new(
                format!("exchange {}", e.name),
                applied(there),
            ));
        }
        for (q, there) in queues.iter().zip(queues_there) {
            out.push(AppliedObject::new(
                format!("queue {}", q.name),
                applied(there),
            ));
        }
        for b in plan.bindings() {
            out.push(AppliedObject::new(
                format!(
                    "binding {} -> {} (routing key {})",
                    b.exchange, b.queue, b.routing_key
                ),
                Applied::Declared,
            ));
        }
        Ok(out)
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        _options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        self.ensure_open()?;
        let broker = self.broker();
        let (exchanges, queues) = needed(plan);
        let mut objects = Vec::with_capacity(exchanges.len() + queues.len());
        for e in exchanges {
            let checked = if has_exchange(broker, &e.name) {
                Checked::Ok(String::new())
            } else {
                Checked::Missing
            };
            objects.push(ObjectCheck::new(format!("exchange {}", e.name), checked));
        }
        let own: Vec<&str> = plan.queues().iter().map(|q| q.name.as_str()).collect();
        for q in queues {
            let checked = match broker.stats(&q.name) {
                Some(stats) => Checked::Ok(format!(
                    "{} ready, {} consumers",
                    stats.ready, stats.consumers
                )),
                None => Checked::Missing,
            };
            let check = ObjectCheck::new(format!("queue {}", q.name), checked);
            // A cascade's level queues are shared, not the plan's.
            objects.push(if own.contains(&q.name.as_str()) {
                check.for_queue(&q.name)
            } else {
                check
            });
        }
        Ok(CheckReport::new(objects).with_scope(
            "in memory: that every exchange and queue exists (nothing is probed, and bindings \
             are not looked at)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::executor::block_on;
    use retry_core::{Cascade, DelayStrategy, RetryPolicy};

    use super::*;

    #[test]
    fn a_cascade_is_applied_and_checked_before_the_plans_own_objects() {
        let policy = RetryPolicy::delays([Duration::from_secs(1)])
            .build()
            .unwrap();
        let plan = TopologyPlan::builder("orders", &policy)
            .with_strategy(DelayStrategy::Cascade(Cascade::new()))
            .build()
            .unwrap();
        let cascade = plan.cascade().unwrap();
        let broker = Broker::new();
        let t = broker.connect();
        let applied = block_on(t.apply(&plan)).unwrap();
        let first = &applied[0];
        assert_eq!(
            first.object,
            format!("exchange {}", cascade.exchanges()[0].name)
        );
        assert_eq!(first.applied, Applied::Created);
        // A second plan on the same cascade finds it there.
        let other = TopologyPlan::builder("billing", &policy)
            .with_strategy(DelayStrategy::Cascade(Cascade::new()))
            .build()
            .unwrap();
        let applied = block_on(t.apply(&other)).unwrap();
        let (exchanges, _) = needed(&other);
        let levels = exchanges.len()..exchanges.len() + cascade.queues().len();
        assert!(
            applied[..cascade.exchanges().len()]
                .iter()
                .chain(&applied[levels.clone()])
                .all(|o| o.applied == Applied::Verified),
            "{applied:?}"
        );
        assert!(
            applied[levels.end..]
                .iter()
                .all(|o| o.applied != Applied::Verified),
            "the plan's own objects are new: {applied:?}"
        );
        let report = block_on(t.check(&other, &PlanOptions::new())).unwrap();
        assert_eq!(report.problems(), 0, "{report:?}");
        let level = &report.objects[levels.start];
        assert!(
            level.object.starts_with("queue retry.cascade."),
            "{level:?}"
        );
        assert_eq!(
            level.queue, None,
            "a level is the cascade's, not the plan's"
        );
    }
}
