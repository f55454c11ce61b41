//! `Admin` on the broker model: depths, a plan applied twice (created, then verified), checks
//! that name what is missing, a conflict, and the registry's transport, which keeps `Admin`
//! and closes. Nothing here waits on the virtual clock.

use std::time::Duration;

use futures::executor::block_on;
use retry_core::{
    Admin, Applied, Checked, Depth, PlanOptions, QueueType, Registry, RetryPolicy, Settlement,
    TopologyPlan, Transport, TransportError,
};
use transport_memory::{Broker, MemoryTransport, Outgoing, QueueOptions};

fn plan(queue: &str, delays: &[u64]) -> TopologyPlan {
    let policy = RetryPolicy::delays(delays.iter().map(|s| Duration::from_secs(*s)))
        .build()
        .expect("a policy");
    TopologyPlan::new(queue, &policy).expect("a plan")
}

/// The plan's exchanges and queues as reports name them, exchanges first.
fn objects(plan: &TopologyPlan) -> Vec<String> {
    plan.exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect()
}

#[test]
fn depth_is_missing_then_counts_the_ready_messages() {
    let broker = Broker::new();
    let t = broker.connect();
    let plan = plan("orders", &[30]);
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Missing);
    block_on(t.apply(&plan)).unwrap();
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Ready(0));
    for body in ["a", "b", "c"] {
        broker
            .publish(Outgoing::to_queue("orders", body.into()))
            .unwrap();
    }
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Ready(3));
    // One handed out and not acked is not ready.
    let delivery = block_on(t.fetch("orders")).unwrap().expect("a message");
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Ready(2));
    block_on(t.settle(&delivery.tag, Settlement::Ack)).unwrap();
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Ready(2));
    assert_eq!(
        block_on(t.depth("orders.retry.30s")).unwrap(),
        Depth::Ready(0)
    );
}

#[test]
fn apply_creates_every_object_then_verifies_it() {
    let broker = Broker::new();
    let t = broker.connect();
    let plan = plan("orders", &[1, 30]);
    let first = block_on(t.apply(&plan)).unwrap();
    let named: Vec<&str> = first.iter().map(|o| o.object.as_str()).collect();
    let objects = objects(&plan);
    assert_eq!(named[..objects.len()], objects);
    assert_eq!(named.len(), objects.len() + plan.bindings().len());
    let b = &plan.bindings()[0];
    assert_eq!(
        named[objects.len()],
        format!(
            "binding {} -> {} (routing key {})",
            b.exchange, b.queue, b.routing_key
        )
    );
    let (declared, rest) = first.split_at(objects.len());
    assert!(
        declared.iter().all(|o| o.applied == Applied::Created),
        "{first:?}"
    );
    assert!(
        rest.iter().all(|o| o.applied == Applied::Declared),
        "{first:?}"
    );

    let again = block_on(t.apply(&plan)).unwrap();
    assert_eq!(
        again.iter().map(|o| o.object.as_str()).collect::<Vec<_>>(),
        named
    );
    let (declared, rest) = again.split_at(objects.len());
    assert!(
        declared.iter().all(|o| o.applied == Applied::Verified),
        "{again:?}"
    );
    assert!(
        rest.iter().all(|o| o.applied == Applied::Declared),
        "{again:?}"
    );

    // A plan with one more delay: only its delay queue is new.
    let more = plan_with_more_delays();
    let third = block_on(t.apply(&more)).unwrap();
    let created: Vec<&str> = third
        .iter()
        .filter(|o| o.applied == Applied::Created)
        .map(|o| o.object.as_str())
        .collect();
    assert_eq!(created, ["queue orders.retry.2m"], "{third:?}");
}

fn plan_with_more_delays() -> TopologyPlan {
    plan("orders", &[1, 30, 120])
}

#[test]
fn check_names_each_missing_object() {
    let broker = Broker::new();
    let t = broker.connect();
    let more = plan_with_more_delays();

    // Nothing there: every object is missing, the work queue among them.
    let report = block_on(t.check(&more, &PlanOptions::new())).unwrap();
    assert_eq!(report.problems(), report.objects.len(), "{report:?}");
    assert!(report.is_missing("orders"), "{report:?}");

    block_on(t.apply(&plan("orders", &[1, 30]))).unwrap();
    broker
        .publish(Outgoing::to_queue("orders", "waiting".into()))
        .unwrap();
    let report = block_on(t.check(&more, &PlanOptions::new())).unwrap();
    assert_eq!(
        report
            .objects
            .iter()
            .map(|o| o.object.clone())
            .collect::<Vec<_>>(),
        objects(&more)
    );
    assert_eq!(report.problems(), 1, "{report:?}");
    assert!(report.is_missing("orders.retry.2m"), "{report:?}");
    assert!(!report.is_missing("orders"), "{report:?}");
    let work = report
        .objects
        .iter()
        .find(|o| o.queue.as_deref() == Some("orders"))
        .expect("the work queue");
    assert_eq!(work.checked, Checked::Ok("1 ready, 0 consumers".into()));
    assert!(
        report.scope.as_deref().unwrap().starts_with("in memory:"),
        "{report:?}"
    );

    block_on(t.apply(&more)).unwrap();
    let report = block_on(t.check(&more, &PlanOptions::new())).unwrap();
    assert_eq!(report.problems(), 0, "{report:?}");
}

#[test]
fn a_queue_with_other_settings_is_a_conflict_naming_it() {
    let broker = Broker::new();
    broker
        .declare_queue(
            "orders",
            QueueOptions::new().with_queue_type(QueueType::Quorum),
        )
        .unwrap();
    let t = broker.connect();
    match block_on(t.apply(&plan("orders", &[30]))) {
        Err(TransportError::TopologyConflict {
            object, argument, ..
        }) => {
            assert!(object.contains("orders"), "{object}");
            assert_eq!(argument, "x-queue-type");
        }
        other => panic!("not a conflict: {other:?}"),
    }
}

#[test]
fn close_ends_the_connection_for_good() {
    let broker = Broker::new();
    let t = broker.connect();
    let plan = plan("orders", &[30]);
    block_on(t.apply(&plan)).unwrap();
    broker
        .publish(Outgoing::to_queue("orders", "held".into()))
        .unwrap();
    let held = block_on(t.fetch("orders")).unwrap().expect("a message");
    assert!(!held.facts.redelivered);
    block_on(Transport::close(&t));
    assert!(!t.is_open());
    // What it held goes back, redelivered, and nothing after the close works.
    assert_eq!(broker.ready("orders"), Some(1));
    assert!(block_on(t.depth("orders")).is_err());
    assert!(block_on(t.fetch("orders")).is_err());
    let other = broker.connect();
    let again = block_on(other.fetch("orders"))
        .unwrap()
        .expect("it is back");
    assert!(again.facts.redelivered);
}

#[test]
fn the_registrations_transport_administers_and_closes() {
    let registry = Registry::new().with(transport_memory::registration());
    let t = block_on(registry.connect("memory://")).unwrap();
    assert!(t.has_admin());
    assert!(!t.may_hide_headers());
    let plan = plan("orders", &[30]);
    assert_eq!(block_on(t.depth("orders")).unwrap(), Depth::Missing);
    let applied = block_on(t.apply(&plan)).unwrap();
    assert!(
        applied
            .iter()
            .any(|o| o.object == "queue orders" && o.applied == Applied::Created)
    );
    assert_eq!(
        block_on(t.check(&plan, &PlanOptions::new()))
            .unwrap()
            .problems(),
        0
    );
    block_on(Transport::close(&t));
    assert!(
        !t.downcast_ref::<MemoryTransport>().unwrap().is_open(),
        "closed through the erasure"
    );
    assert!(block_on(t.depth("orders")).is_err());
}
