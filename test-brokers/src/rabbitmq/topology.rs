//! A test's topology on the broker: queues made to refuse publishes, and deleting what a
//! test declared however it ends.

use std::time::Duration;

use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties};
use retry_proto::{ExchangeSpec, HeaderValue, QueueArguments, QueueSpec, TopologyPlan};

use crate::wait::on_own_thread;

/// `args` plus a length limit of zero with `reject-publish`: a queue declared with them
/// refuses every publish with a negative confirm, which is how tests make a clone's publish
/// fail on a real broker.
///
/// ```
/// use lapin::types::{AMQPValue, FieldTable};
/// use test_brokers::rabbitmq::refusing;
///
/// let args = refusing(FieldTable::default());
/// assert_eq!(
///     args.inner().get("x-overflow"),
///     Some(&AMQPValue::LongString("reject-publish".into()))
/// );
/// ```
pub fn refusing(mut args: FieldTable) -> FieldTable {
    args.insert("x-max-length".into(), AMQPValue::LongInt(0));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    args
}

/// Replaces the queue `queue` of the provisioned `plan`: deletes it, declares it again with
/// its plan arguments passed through `args` (for instance [`refusing`]), and binds it again
/// as the plan does, since deleting a queue drops its bindings. Messages in it are lost.
///
/// Panics if the plan has no queue of that name.
///
/// ```no_run
/// # async fn f(channel: lapin::Channel, plan: retry_proto::TopologyPlan) -> Result<(), lapin::Error> {
/// use test_brokers::rabbitmq::{redeclare, refusing};
///
/// // The first delay queue now refuses every clone sent to it.
/// let delay_queue = plan.delay_routes()[0].1.routing_key.to_string();
/// redeclare(&channel, &plan, &delay_queue, refusing).await?;
/// # Ok(()) }
/// ```
pub async fn redeclare(
    channel: &Channel,
    plan: &TopologyPlan,
    queue: &str,
    args: impl FnOnce(FieldTable) -> FieldTable,
) -> Result<(), lapin::Error> {
    let spec = plan
        .queues()
        .iter()
        .find(|q| q.name == queue)
        .unwrap_or_else(|| panic!("the plan has no queue {queue:?}"));
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await?;
    let options = QueueDeclareOptions {
        durable: spec.durable,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, args(arguments(&spec.arguments)))
        .await?;
    for binding in plan.bindings().iter().filter(|b| b.queue == queue) {
        channel
            .queue_bind(
                queue.into(),
                binding.exchange.as_str().into(),
                binding.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
    }
    Ok(())
}

/// A plan's queue arguments as AMQP 0-9-1 declares them: `x-` arguments are text and
/// integers (64-bit, as a transport writes them; the broker takes any width).
fn arguments(arguments: &QueueArguments) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in arguments.to_headers().iter() {
        let value = match value {
            HeaderValue::Str(s) => AMQPValue::LongString(s.as_str().into()),
            HeaderValue::Int(n) => AMQPValue::LongLongInt(*n),
            HeaderValue::Bool(b) => AMQPValue::Boolean(*b),
            other => panic!("queue argument {name} is neither text nor a number: {other:?}"),
        };
        table.insert(name.into(), value);
    }
    table
}

/// Deletes what a test declared on the broker at the AMQP 0-9-1 `url`: each of `plans`
/// (its queues, then its exchanges), then their delay cascades, then `queues`. It runs on a
/// thread of its own with a runtime of its own and returns when that is done, so a guard's
/// `Drop` can call it (see [`Cleanup`]). Each step waits at most 10 s and its errors are
/// ignored: cleaning up must not fail a test, and a cascade shared by two plans is simply
/// found gone the second time.
///
/// ```no_run
/// use retry_proto::TopologyPlan;
///
/// struct Cleanup(TopologyPlan);
///
/// impl Drop for Cleanup {
///     fn drop(&mut self) {
///         let url = test_brokers::amqp_url();
///         test_brokers::rabbitmq::delete_blocking(&url, std::slice::from_ref(&self.0), &[]);
///     }
/// }
/// ```
pub fn delete_blocking(url: &str, plans: &[TopologyPlan], queues: &[String]) {
    let within = Duration::from_secs(10);
    let url = url.to_owned();
    // Each step's queues, then its exchanges. The plans first: a cascade may be shared by
    // several of them.
    let step = |queues: &[QueueSpec], exchanges: &[ExchangeSpec]| {
        let queues: Vec<String> = queues.iter().map(|q| q.name.clone()).collect();
        let exchanges: Vec<String> = exchanges.iter().map(|e| e.name.clone()).collect();
        (queues, exchanges)
    };
    let mut steps: Vec<_> = plans
        .iter()
        .map(|p| step(p.queues(), p.exchanges()))
        .collect();
    let cascades = plans.iter().filter_map(TopologyPlan::cascade);
    steps.extend(cascades.map(|c| step(c.queues(), c.exchanges())));
    steps.push((queues.to_vec(), Vec::new()));
    on_own_thread(async move {
        let connecting = Connection::connect(&url, ConnectionProperties::default());
        let Ok(Ok(connection)) = tokio::time::timeout(within, connecting).await else {
            return;
        };
        for (queues, exchanges) in steps {
            // A channel per step: a refusal closes the channel, not the cleanup.
            let Ok(Ok(channel)) = tokio::time::timeout(within, connection.create_channel()).await
            else {
                continue;
            };
            for queue in &queues {
                let deleting = channel.queue_delete(queue.as_str().into(), Default::default());
                let _ = tokio::time::timeout(within, deleting).await;
            }
            for exchange in &exchanges {
                let deleting =
                    channel.exchange_delete(exchange.as_str().into(), Default::default());
                let _ = tokio::time::timeout(within, deleting).await;
            }
            let _ = channel.close(200, "cleaned up".into()).await;
        }
        let _ = connection.close(200, "cleaned up".into()).await;
    });
}

/// Deletes the plans (with their delay cascades) and queues a test declared when it is
/// dropped, whether the test passed or panicked ([`delete_blocking`]).
///
/// ```no_run
/// # fn f(plan: retry_proto::TopologyPlan) {
/// let mut cleanup = test_brokers::rabbitmq::Cleanup::new(test_brokers::amqp_url());
/// cleanup.plan(&plan);
/// cleanup.queue("orders-side-queue");
/// // ... the test ...
/// # }
/// ```
#[derive(Debug)]
pub struct Cleanup {
    url: String,
    plans: Vec<TopologyPlan>,
    queues: Vec<String>,
}

impl Cleanup {
    /// A guard that deletes, on the broker at the AMQP 0-9-1 `url`, nothing yet.
    pub fn new(url: impl Into<String>) -> Self {
        Cleanup {
            url: url.into(),
            plans: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// Deletes `plan` and its cascade on drop.
    pub fn plan(&mut self, plan: &TopologyPlan) {
        self.plans.push(plan.clone());
    }

    /// Deletes `plan` and its cascade on drop, as [`plan`](Self::plan), by value.
    pub fn with_plan(mut self, plan: &TopologyPlan) -> Self {
        self.plan(plan);
        self
    }

    /// Deletes the queue `name` on drop, after the plans.
    pub fn queue(&mut self, name: impl Into<String>) {
        self.queues.push(name.into());
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        delete_blocking(&self.url, &self.plans, &self.queues);
    }
}
