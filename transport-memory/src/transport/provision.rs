//! Declaring the retry engine's [`TopologyPlan`] on the broker, and the delay cascade
//! ([`CascadePlan`]) it may share with other plans.

use retry_core::{BindingSpec, CascadePlan, ExchangeSpec, QueueArguments, QueueSpec, TopologyPlan};

use crate::broker::Broker;
use crate::broker::core::State;
use crate::broker::error::BrokerError;
use crate::broker::queue::{QueueOptions, QueueOverflow};

impl Broker {
    /// Declares everything in `plan`: its [cascade](TopologyPlan::cascade) first, when it
    /// has one (see [`provision_cascade`](Self::provision_cascade)), then its own
    /// exchanges, queues and bindings. Declaring it again is a no-op; an object that exists
    /// with other settings is an error naming the setting, and the objects before it stay
    /// declared.
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
            if let Some(cascade) = plan.cascade() {
                declare_cascade(s, cascade)?;
            }
            declare(s, plan.exchanges(), plan.queues(), plan.bindings())
        })
    }

    /// Declares a delay cascade: its exchanges, its level queues, each level's binding to
    /// its queue and its exchange binding to the level below. [`provision`](Self::provision)
    /// calls it for a plan's cascade; call it yourself to declare a plan's own objects your
    /// way (as a test harness that injects faults into them does).
    ///
    /// A cascade is shared: declaring it again, or for another work queue, is a no-op, and a
    /// plan that needs more levels adds them on top of the ones there. Work queues join it
    /// through their bindings to its delivery exchange, which are the plan's own.
    ///
    /// ```
    /// use retry_core::{Cascade, DelayStrategy, RetryPolicy, TopologyPlan};
    /// use transport_memory::{Broker, Outgoing};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(1)]).build()?;
    /// let plan = TopologyPlan::builder("orders", &policy)
    ///     .with_strategy(DelayStrategy::Cascade(Cascade::new()))
    ///     .build()?;
    /// let cascade = plan.cascade().unwrap();
    /// let broker = Broker::new();
    /// broker.provision_cascade(cascade)?;
    /// assert_eq!(broker.ready("retry.cascade.10ms.06"), Some(0)); // 7 levels hold 1 s
    ///
    /// // 50 ms is 0b101 units of 10 ms: 40 ms in level 2, then 10 ms in level 0.
    /// let (route, _) = plan.route_for(Duration::from_millis(50)).unwrap();
    /// broker.publish(Outgoing::new(&*route.exchange, &*route.routing_key, b"x".to_vec()))?;
    /// assert_eq!(broker.ready("retry.cascade.10ms.02"), Some(1));
    /// broker.advance(Duration::from_millis(40));
    /// assert_eq!(broker.ready("retry.cascade.10ms.00"), Some(1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn provision_cascade(&self, cascade: &CascadePlan) -> Result<(), BrokerError> {
        self.shared.with(|s| declare_cascade(s, cascade))
    }
}

/// Declares `cascade` under the broker's lock: exchanges first, so the level queues'
/// dead-letter exchanges exist before anything can expire into them.
pub(crate) fn declare_cascade(s: &mut State, cascade: &CascadePlan) -> Result<(), BrokerError> {
    declare(s, cascade.exchanges(), cascade.queues(), cascade.bindings())?;
    for b in cascade.exchange_bindings() {
        s.bind_exchange(&b.source, &b.destination, &b.routing_key)?;
    }
    Ok(())
}

/// Declares `exchanges`, then `queues`, then the `bindings` between them.
pub(crate) fn declare(
    s: &mut State,
    exchanges: &[ExchangeSpec],
    queues: &[QueueSpec],
    bindings: &[BindingSpec],
) -> Result<(), BrokerError> {
    for x in exchanges {
        s.declare_exchange(&x.name, x.kind)?;
    }
    for q in queues {
        s.declare_queue(&q.name, QueueOptions::from(&q.arguments))?;
    }
    for b in bindings {
        s.bind(&b.exchange, &b.queue, &b.routing_key)?;
    }
    Ok(())
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
                Some(retry_core::Overflow::RejectPublish) => QueueOverflow::RejectPublish,
                None => QueueOverflow::DropHead,
            },
            delivery_limit: args.delivery_limit,
            at_least_once: args.at_least_once,
        }
    }
}
