//! What provisioning logs: a consumer's first start on a broker that has none of the
//! topology logs one INFO line and nothing louder; inspected provisioning, for tools, logs
//! each object it creates at INFO.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber: lapin
//! logs from its I/O thread and this crate from tokio tasks, which only the global
//! subscriber sees.

mod common;

use std::time::Duration;

use common::*;
use retry_core::{RetryPolicy, TopologyPlan, Transport};
use test_brokers::LogRecorder;
use tracing::Level;

/// Long enough for the events of a channel the broker closed to reach the connection's
/// listener, which logs them from a task of its own.
const SETTLE: Duration = Duration::from_millis(500);

/// The INFO events carrying every one of `tokens`.
fn info_with(logs: &LogRecorder, tokens: &[String]) -> Vec<String> {
    logs.at_least(Level::INFO)
        .into_iter()
        .filter(|l| {
            let words: Vec<&str> = l.split(' ').collect();
            words[0] == "INFO" && tokens.iter().all(|t| words.contains(&t.as_str()))
        })
        .collect()
}

#[tokio::test]
async fn provisioning_on_a_fresh_broker_is_quiet() {
    let logs = LogRecorder::default();
    tracing::subscriber::set_global_default(logs.clone()).expect("the only subscriber");
    let Some(config) = broker("provision-logs").await else {
        return;
    };
    let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)])
        .build()
        .unwrap();
    let start = TopologyPlan::new(&unique("fresh"), &policy).unwrap();
    let tool = TopologyPlan::new(&unique("inspected"), &policy).unwrap();
    let t = transport(&config).await;

    // A consumer's start, twice.
    let first = t.provision(&start).await;
    let second = t.provision(&start).await;
    tokio::time::sleep(SETTLE).await;
    let loud_start = logs.at_least(Level::WARN);
    let declared = t.last_provision_report();
    // A tool, on a fresh plan, then again.
    let inspected = t.provision_inspected(&tool).await;
    let again = t.provision_inspected(&tool).await;
    tokio::time::sleep(SETTLE).await;
    let loud_tool = logs.at_least(Level::WARN);
    t.teardown(&start).await.unwrap();
    t.teardown(&tool).await.unwrap();
    t.close().await.unwrap();

    first.unwrap();
    second.unwrap();
    let objects = start.exchanges().len() + start.queues().len();
    assert!(
        loud_start.is_empty(),
        "a consumer's start logged:\n{}",
        loud_start.join("\n")
    );
    assert_eq!(declared.unwrap().declared.len(), objects);
    let queue = format!("queue={}", start.work_queue());
    let summary: Vec<String> = logs
        .at_least(Level::INFO)
        .into_iter()
        .filter(|l| {
            l.starts_with("INFO ") && l.contains("message=topology declared") && l.contains(&queue)
        })
        .collect();
    assert_eq!(summary.len(), 2, "one INFO line per start: {summary:#?}");

    let report = inspected.unwrap();
    assert_eq!(report.created.len(), objects, "{report:?}");
    let again = again.unwrap();
    assert!(again.created.is_empty(), "{again:?}");
    assert_eq!(again.verified.len(), objects, "{again:?}");
    // lapin 4 logs every channel the broker closes at ERROR, from its I/O thread: the
    // passive declare of each missing object is one. Those are the only lines inspected
    // provisioning may add at WARN or above, one per created object, and never a
    // "connection lost".
    let closed_by_inspection = |line: &str| {
        line.starts_with("ERROR lapin::channel message=Channel closed ")
            && line.contains("reply_code: 404")
            && report.created.iter().any(|created| {
                let (kind, name) = created.split_once(' ').unwrap();
                line.contains(&format!("NOT_FOUND - no {kind} '{name}' in vhost"))
            })
    };
    let added = &loud_tool[loud_start.len()..];
    let unexpected: Vec<&String> = added.iter().filter(|l| !closed_by_inspection(l)).collect();
    assert!(unexpected.is_empty(), "inspecting logged:\n{unexpected:#?}");
    assert!(added.len() <= objects, "{added:#?}");
    assert_eq!(logs.containing("connection lost"), Vec::<String>::new());

    // One INFO event per created object, naming its kind and name.
    for created in &report.created {
        let (kind, name) = created.split_once(' ').unwrap();
        let tokens = [
            "message=created".to_owned(),
            format!("kind={kind}"),
            format!("name={name}"),
        ];
        assert_eq!(info_with(&logs, &tokens).len(), 1, "{created}");
    }
}
