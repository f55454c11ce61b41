//! `Admin` on RabbitMQ: a queue's depth, a plan applied (created, then verified), and a
//! plan checked with probes through its delay queues, against the local broker. Every test
//! uses queue names of its own and deletes what it created, also when it fails.

mod common;

use std::time::Duration;

use common::*;
use lapin::options::QueueDeleteOptions;
use lapin::types::FieldTable;
use retry_core::{
    Admin, Applied, Cascade, CheckReport, Checked, ConnectOptions, DelayStrategy, Depth,
    PlanOptions, QueueType, Registry, RetryPolicy, TopologyPlan, Transport, TransportError,
};

/// A plan whose probes come back quickly: one 200 ms delay and a 200 ms crash delay.
fn quick_plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .with_crash_delay(Duration::from_millis(200))
        .build()
        .unwrap();
    TopologyPlan::builder(queue, &policy)
        .with_queue_type(QueueType::Classic)
        .build()
        .unwrap()
}

/// Probes wait 1 s at most, and come back within 6 s.
fn options() -> PlanOptions {
    PlanOptions::new().with_max_probe_ttl(Duration::from_secs(1))
}

/// The check of `object`, which the report must have.
fn line<'r>(report: &'r CheckReport, object: &str) -> &'r Checked {
    &report
        .objects
        .iter()
        .find(|o| o.object == object)
        .unwrap_or_else(|| panic!("no {object:?} in {report:#?}"))
        .checked
}

/// The delay and crash-delay queues of `plan`: those a probe goes through.
fn probed(plan: &TopologyPlan) -> Vec<String> {
    plan.queues()
        .iter()
        .filter(|q| q.role.ttl().is_some())
        .map(|q| q.name.clone())
        .collect()
}

#[tokio::test]
async fn depth_tells_a_missing_queue_from_one_with_messages() {
    let Some(config) = broker("admin depth").await else {
        return;
    };
    let queue = unique("admin-depth");
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.queue(queue.clone());
    let t = transport(&config).await;

    let before = t.depth(&queue).await.unwrap();
    let (conn, ch) = raw().await;
    declare_durable(&ch, &queue, FieldTable::default()).await;
    let empty = t.depth(&queue).await.unwrap();
    publish(&ch, &queue, b"one", "m1").await;
    publish(&ch, &queue, b"two", "m2").await;
    let two = t.depth(&queue).await.unwrap();
    // Asking takes nothing.
    let again = t.depth(&queue).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
    Transport::close(&t).await;

    assert_eq!(before, Depth::Missing);
    assert_eq!(empty, Depth::Ready(0));
    assert_eq!(two, Depth::Ready(2));
    assert_eq!(again, Depth::Ready(2));
}

#[tokio::test]
async fn apply_creates_the_plan_then_verifies_it() {
    let Some(config) = broker("admin apply").await else {
        return;
    };
    let queue = unique("admin-apply");
    let plan = quick_plan(&queue);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;

    let first = t.apply(&plan).await.unwrap();
    let second = t.apply(&plan).await.unwrap();
    Transport::close(&t).await;

    let objects: Vec<String> = plan
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .chain(plan.bindings().iter().map(|b| {
            format!(
                "binding {} -> {} (routing key {})",
                b.exchange, b.queue, b.routing_key
            )
        }))
        .collect();
    let named = |applied: &[retry_core::AppliedObject]| -> Vec<String> {
        applied.iter().map(|a| a.object.clone()).collect()
    };
    assert_eq!(named(&first), objects, "in the plan's order");
    assert_eq!(named(&second), objects, "in the plan's order");
    let boxes = plan.exchanges().len() + plan.queues().len();
    for (i, (a, b)) in first.iter().zip(&second).enumerate() {
        let (want_first, want_second) = if i < boxes {
            (Applied::Created, Applied::Verified)
        } else {
            (Applied::Declared, Applied::Declared)
        };
        assert_eq!(a.applied, want_first, "{}: {first:#?}", a.object);
        assert_eq!(b.applied, want_second, "{}: {second:#?}", b.object);
    }
}

#[tokio::test]
async fn check_after_apply_sees_every_probe_come_back() {
    let Some(config) = broker("admin check").await else {
        return;
    };
    let queue = unique("admin-check");
    let plan = quick_plan(&queue);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;

    t.apply(&plan).await.unwrap();
    let report = t.check(&plan, &options()).await.unwrap();
    let (conn, ch) = raw().await;
    let left = [
        message_count(&ch, &queue).await.unwrap(),
        message_count(&ch, plan.isolation_queue()).await.unwrap(),
        message_count(&ch, plan.parking_queue()).await.unwrap(),
    ];
    let _ = conn.close(200, "done".into()).await;
    Transport::close(&t).await;

    assert_eq!(report.problems(), 0, "{report:#?}");
    assert!(report.notes.is_empty(), "{report:#?}");
    assert_eq!(report.scope, None);
    assert_eq!(
        report.objects.len(),
        plan.exchanges().len() + plan.queues().len(),
        "{report:#?}"
    );
    for e in plan.exchanges() {
        assert_eq!(
            line(&report, &format!("exchange {}", e.name)),
            &Checked::Ok(String::new())
        );
    }
    for (_, route, destination) in plan.delayed_destinations() {
        let object = format!("queue {}", route.routing_key);
        let Checked::Ok(text) = line(&report, &object) else {
            panic!("{object} failed: {report:#?}");
        };
        let came_back = format!("a probe came back to `{destination}` after ");
        assert!(text.starts_with(&came_back), "{object}: {text:?}");
        assert!(text.ends_with(", dead-lettered as expired"), "{text:?}");
    }
    assert_eq!(probed(&plan).len(), 2);
    for q in plan.queues().iter().filter(|q| q.role.ttl().is_none()) {
        assert_eq!(
            line(&report, &format!("queue {}", q.name)),
            &Checked::Ok("0 ready, 0 consumers".into())
        );
    }
    assert!(
        report
            .objects
            .iter()
            .filter(|o| o.object.starts_with("queue "))
            .all(|o| o.queue.as_deref() == o.object.strip_prefix("queue ")),
        "every queue's line names its queue: {report:#?}"
    );
    assert_eq!(left, [0, 0, 0], "probes were left behind");
}

#[tokio::test]
async fn check_reports_a_deleted_parking_queue_missing() {
    let Some(config) = broker("admin check parking").await else {
        return;
    };
    let queue = unique("admin-noparking");
    let plan = quick_plan(&queue);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;

    t.apply(&plan).await.unwrap();
    let (conn, ch) = raw().await;
    ch.queue_delete(plan.parking_queue().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = conn.close(200, "done".into()).await;
    let report = t.check(&plan, &options()).await.unwrap();
    Transport::close(&t).await;

    let parking = format!("queue {}", plan.parking_queue());
    assert_eq!(line(&report, &parking), &Checked::Missing, "{report:#?}");
    assert!(report.is_missing(plan.parking_queue()));
    assert!(!report.is_missing(&queue));
    assert_eq!(report.problems(), 1, "only the parking queue: {report:#?}");
    for delay in probed(&plan) {
        let Checked::Ok(text) = line(&report, &format!("queue {delay}")) else {
            panic!("{delay}: {report:#?}");
        };
        assert!(text.contains("came back"), "{text:?}");
    }
}

#[tokio::test]
async fn check_takes_no_work_and_probes_nothing_that_would_queue_behind_it() {
    let Some(config) = broker("admin check busy").await else {
        return;
    };
    let queue = unique("admin-busy");
    let plan = quick_plan(&queue);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;

    t.apply(&plan).await.unwrap();
    let (conn, ch) = raw().await;
    publish(&ch, &queue, b"work", "w1").await;
    let report = t.check(&plan, &options()).await.unwrap();
    let (ready, unacked) = ready_and_unacked_settled(&queue).await;
    let _ = conn.close(200, "done".into()).await;
    Transport::close(&t).await;

    assert_eq!((ready, unacked), (1, 0), "the work stays where it was");
    let delay = format!("queue {}", plan.delay_routes()[0].1.routing_key);
    assert_eq!(
        line(&report, &delay),
        &Checked::Failed(format!(
            "not probed: `{queue}` has 1 message(s) ready, and a probe would come back behind \
             them; verify reads probes back without taking work, so run it with `{queue}` \
             drained"
        )),
        "{report:#?}"
    );
    assert_eq!(
        line(&report, &format!("queue {queue}")),
        &Checked::Ok("1 ready, 0 consumers".into())
    );
    // The isolation queue is empty: the crash-delay queue is still probed.
    let crash = plan
        .queues()
        .iter()
        .find(|q| matches!(q.role, retry_core::QueueRole::CrashDelay { .. }))
        .unwrap();
    let Checked::Ok(text) = line(&report, &format!("queue {}", crash.name)) else {
        panic!("{report:#?}");
    };
    assert!(text.contains("came back"), "{text:?}");
    assert_eq!(report.problems(), 1, "{report:#?}");
}

#[tokio::test]
async fn check_of_a_plan_never_applied_reports_every_object_missing() {
    let Some(config) = broker("admin check none").await else {
        return;
    };
    let queue = unique("admin-none");
    let plan = quick_plan(&queue);
    let cascading = {
        let policy = RetryPolicy::delays([Duration::from_secs(1)])
            .build()
            .unwrap();
        TopologyPlan::builder(&queue, &policy)
            .with_strategy(DelayStrategy::Cascade(
                Cascade::new().with_prefix(unique("admin-cascade")),
            ))
            .build()
            .unwrap()
    };
    let t = transport(&config).await;

    let report = t.check(&plan, &options()).await.unwrap();
    let refused = t.check(&cascading, &options()).await.unwrap_err();
    Transport::close(&t).await;

    assert_eq!(
        report.problems(),
        plan.exchanges().len() + plan.queues().len(),
        "{report:#?}"
    );
    assert!(
        report.objects.iter().all(|o| o.checked == Checked::Missing),
        "{report:#?}"
    );
    assert!(report.is_missing(&queue));
    assert!(
        matches!(&refused, TransportError::Unsupported { what, .. }
            if what == "checking a plan with a delay cascade"),
        "{refused:?}"
    );
}

#[tokio::test]
async fn the_registration_hands_out_an_admin_and_takes_auto_recover() {
    let Some(config) = broker("admin registration").await else {
        return;
    };
    let _ = config;
    let registry = Registry::new().with(transport_amqp091::registration());
    let options = ConnectOptions::new().with_setting("auto_recover", "false");
    let t = registry.connect_with(&amqp_url(), options).await.unwrap();
    let depth = t.depth(&unique("admin-nothing")).await;
    t.close().await;

    assert!(t.has_admin());
    let inside = t
        .downcast_ref::<transport_amqp091::AmqpTransport>()
        .unwrap();
    assert!(!inside.config().auto_recover());
    assert_eq!(depth.unwrap(), Depth::Missing);
    let closed = t.depth("anything").await;
    assert!(
        closed.is_err(),
        "a closed transport answers nothing: {closed:?}"
    );
}
