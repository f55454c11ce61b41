//! Building blocks for scenarios: the skip check, a topology of the scenario's own, and the
//! check that nothing was left behind. The scenarios in [`scenarios`](crate::scenarios)
//! and the other workloads ([`storm`](crate::storm), and the `stress` crate's differential
//! check) are written with them.

use std::time::Duration;

use retry_core::{
    Cascade, ConsumerBuilder, DelayStrategy, QueueType, RetryPolicy, SoloGate, TopologyBuilder,
    TopologyPlan, Transport,
};

use crate::harness::{Harness, Need, Timing, TopologyFaults};
use crate::journal::{Journal, ScriptedHandler};
use crate::verdict::Verdict;

/// The skip verdict for the first of `needs` the harness lacks, if any.
pub fn unmet<H: Harness>(h: &H, needs: &[Need]) -> Option<Verdict> {
    needs.iter().find_map(|need| {
        h.unsupported(*need).map(|why| Verdict::Skipped {
            reason: format!("needs {need}: {why}"),
        })
    })
}

/// Milliseconds.
pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// How long a scenario waits for what should happen within a second or two. Generous,
/// because on a real broker scenarios run side by side (one test thread each) on a small
/// machine; it bounds a broken scenario, it does not measure one.
pub const WITHIN: Duration = Duration::from_secs(30);

/// A scenario's topology: its unique work queue, policy and plan.
#[derive(Clone, Debug)]
pub struct Setup {
    /// The work queue.
    pub queue: String,
    /// The policy.
    pub policy: RetryPolicy,
    /// The plan the harness declared.
    pub plan: TopologyPlan,
    /// Whether the plan uses quorum queues.
    pub quorum: bool,
    /// How the plan realises delays.
    pub strategy: DelayStrategy,
}

/// Names a work queue for `scenario`, makes the plan for `policy` and has the harness
/// declare it.
pub async fn setup<H: Harness>(h: &H, scenario: &str, policy: RetryPolicy, quorum: bool) -> Setup {
    setup_with_faults(h, scenario, policy, quorum, |_| TopologyFaults::default()).await
}

/// [`setup`], with the faults `faults` picks for the plan applied when it is declared.
pub async fn setup_with_faults<H: Harness>(
    h: &H,
    scenario: &str,
    policy: RetryPolicy,
    quorum: bool,
    faults: impl FnOnce(&TopologyPlan) -> TopologyFaults,
) -> Setup {
    let queue = h.unique_queue(scenario);
    setup_plan(h, queue, policy, quorum, DelayStrategy::default(), faults).await
}

/// [`setup`] with classic queues and a delay cascade of the scenario's own: its names start
/// with the work queue's, so scenarios never share one and its cleanup can delete it.
pub async fn setup_cascade<H: Harness>(
    h: &H,
    scenario: &str,
    policy: RetryPolicy,
    cascade: Cascade,
) -> Setup {
    let queue = h.unique_queue(scenario);
    let strategy = DelayStrategy::Cascade(cascade.with_prefix(format!("{queue}.cascade")));
    setup_plan(h, queue, policy, false, strategy, |_| {
        TopologyFaults::default()
    })
    .await
}

async fn setup_plan<H: Harness>(
    h: &H,
    queue: String,
    policy: RetryPolicy,
    quorum: bool,
    strategy: DelayStrategy,
    faults: impl FnOnce(&TopologyPlan) -> TopologyFaults,
) -> Setup {
    let plan = customize(quorum, strategy.clone())(TopologyPlan::builder(&queue, &policy))
        .build()
        .expect("the scenario's plan is valid");
    h.provision(&plan, &faults(&plan)).await;
    Setup {
        queue,
        policy,
        plan,
        quorum,
        strategy,
    }
}

fn customize(
    quorum: bool,
    strategy: DelayStrategy,
) -> impl for<'a> FnOnce(TopologyBuilder<'a>) -> TopologyBuilder<'a> {
    move |b| {
        let b = b.with_strategy(strategy);
        if quorum {
            b.with_queue_type(QueueType::Quorum)
        } else {
            b
        }
    }
}

impl Setup {
    /// A consumer builder for this topology on `transport`, recording terminals in
    /// `journal`. The handler timeout is long, so a hanging handler is still running when
    /// its consumer is killed.
    pub fn consumer<T: Transport>(
        &self,
        transport: T,
        journal: &Journal,
        handler: ScriptedHandler,
        prefetch: u16,
    ) -> ConsumerBuilder<T, ScriptedHandler> {
        retry_core::Consumer::builder(transport, self.queue.clone(), self.policy.clone(), handler)
            .with_prefetch(prefetch)
            .with_handler_timeout(Duration::from_secs(60))
            .with_shutdown_grace(Duration::from_secs(5))
            // Crash-delayed suspects come back within a second; on a real broker, notice
            // them soon.
            .with_suspect_poll(ms(100))
            .with_topology(customize(self.quorum, self.strategy.clone()))
            .with_on_terminal(journal.observer())
            // Each consumer a scenario starts stands for a process of its own, and scenarios
            // run side by side in one test binary: none waits on another's suspects.
            .with_solo_gate(SoloGate::new())
    }

    /// The delay queue a clone with `delay` goes to.
    pub fn delay_queue(&self, delay: Duration) -> String {
        delay_queue(&self.plan, delay)
    }
}

/// The delay queue of `plan` a clone with `delay` goes to: each delay queue is bound with
/// its own name as the routing key.
pub fn delay_queue(plan: &TopologyPlan, delay: Duration) -> String {
    let (route, _) = plan.route_for(delay).expect("the plan has delay levels");
    route.routing_key.to_string()
}

/// Asserts every queue of the plan is empty: nothing left behind, nothing stuck.
///
/// No broker answers an ack, and its count is read on a connection of its own: a message
/// whose ack is still on its way when the consumer stops counts for a moment (JetStream
/// applies acks apart from the stream's info requests). So a queue is counted again, every
/// 100 ms for up to 2 s, until it is empty. A message whose ack was lost stays far longer:
/// RabbitMQ puts it back when its consumer's connection closes, JetStream after the ack
/// wait (30 s). On the in-memory broker, whose count is exact, there is no second count.
pub async fn assert_nothing_left<H: Harness>(h: &H, plan: &TopologyPlan) {
    let cascade = plan.cascade().map(|c| c.queues()).unwrap_or_default();
    for q in plan.queues().iter().chain(cascade) {
        let mut left = h.ready(&q.name).await;
        for _ in 0..20 {
            if left == 0 || matches!(h.capabilities().timing, Timing::Virtual) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            left = h.ready(&q.name).await;
        }
        assert_eq!(left, 0, "messages left in {}", q.name);
    }
}
