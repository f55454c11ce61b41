//! Declaring the retry engine's [`TopologyPlan`] on the broker.

use retry_core::{QueueArguments, TopologyPlan};

use crate::broker::Broker;
use crate::broker::error::BrokerError;
use crate::broker::queue::{Overflow, QueueOptions};

impl Broker {
    /// Declares everything in `plan`.
    ///
    /// ```
    /// use retry_core::{RetryPolicy, TopologyPlan};
    /// use transport_memory::Broker;
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("comments", &policy)?;
    /// let broker = Broker::new();
    /// broker.provision(&plan)?;
    /// assert_eq!(broker.ready("comments.retry.30s"), Some(0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn provision(&self, plan: &TopologyPlan) -> Result<(), BrokerError> {
        self.shared.with(|s| {
            for x in plan.exchanges() {
                s.declare_exchange(&x.name, x.kind)?;
            }
            for q in plan.queues() {
                s.declare_queue(&q.name, QueueOptions::from(&q.arguments))?;
            }
            for b in plan.bindings() {
                s.bind(&b.exchange, &b.queue, &b.routing_key)?;
            }
            Ok(())
        })
    }
}

impl From<&QueueArguments> for QueueOptions {
    fn from(args: &QueueArguments) -> Self {
        QueueOptions {
            queue_type: args.queue_type,
            message_ttl: args.message_ttl,
            dead_letter_exchange: args.dead_letter_exchange.clone(),
            dead_letter_routing_key: args.dead_letter_routing_key.clone(),
            max_length: None,
            overflow: match args.overflow {
                Some(retry_core::Overflow::RejectPublish) => Overflow::RejectPublish,
                None => Overflow::DropHead,
            },
            delivery_limit: args.delivery_limit,
            at_least_once: args.at_least_once,
        }
    }
}
