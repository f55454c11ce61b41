//! On a real three-node RabbitMQ cluster (`stress/cluster.sh up`): connecting to a node list,
//! refusing bad ones, and failing over while nodes are stopped, killed and restarted.
//!
//! The cluster's node list comes from `AMQP_CLUSTER_URLS` (`stress/cluster.sh urls`). Without
//! it these tests are skipped loudly, unless `REQUIRE_CLUSTER` is set (as `.ci/run` does),
//! which makes a missing cluster a failure. They stop and kill nodes, so they run one at a
//! time, and every node is running again when each ends.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{start, unique};
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicPublishOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use retry_core::{
    HandlerError, Message, QueueType, RetryPolicy, TopologyBuilder, TopologyPlan, Transport,
};
use test_brokers::rabbitmq::{ClusterLease, cluster};
use test_brokers::{LogRecorder, print_uncaptured};
use transport_amqp091::{AmqpConfig, AmqpTransport, NodeListError};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// Every log line of the test process, to show what the transport and lapin did when a
/// failover does not come.
fn logs() -> &'static LogRecorder {
    static LOGS: OnceLock<LogRecorder> = OnceLock::new();
    LOGS.get_or_init(|| {
        let recorder = LogRecorder::up_to(tracing::Level::INFO);
        let _ = tracing::subscriber::set_global_default(recorder.clone());
        recorder
    })
}

/// The cluster for this test alone, with every node running, and the log recorder on.
async fn exclusive() -> ClusterLease {
    logs();
    ClusterLease::take().await
}

/// Runs `stress/cluster.sh` with `args` off the runtime's thread.
async fn cluster_sh(args: &[&str]) {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        test_brokers::rabbitmq::cluster_sh(&args)
    })
    .await
    .unwrap();
}

/// The node name (`rtest1`..) of a node URL of the cluster, from its port (568N).
fn node_name(address: &str) -> String {
    let port = address
        .rsplit_once(':')
        .and_then(|(_, rest)| rest.get(..4))
        .expect("a node address with a port");
    format!("rtest{}", &port[3..])
}

/// A plain lapin connection to the first node of `urls` that answers.
async fn raw(urls: &[String]) -> Connection {
    for url in urls {
        if let Ok(Ok(c)) = tokio::time::timeout(
            secs(5),
            Connection::connect(url, ConnectionProperties::default()),
        )
        .await
        {
            return c;
        }
    }
    panic!("no node of {urls:?} answers");
}

/// The last 60 log lines at INFO or above, timed, for a failure's message.
fn log_tail() -> String {
    let tail = |level| {
        let lines = logs().timed(level);
        lines[lines.len().saturating_sub(40)..].join("\n")
    };
    // Routine lines (a retry scheduled) would push a failover's warnings out of the tail.
    format!(
        "{}\n  warnings and errors:\n{}",
        tail(tracing::Level::INFO),
        tail(tracing::Level::WARN)
    )
}

/// Polls `done` every 50 ms until it holds, or panics naming `what` after `within`, with
/// the last log lines.
async fn wait_for(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}; the last log lines:\n{}",
            log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deletes a plan's queues and exchanges, on whichever node answers.
async fn teardown(urls: &[String], plan: &TopologyPlan) {
    let t = AmqpTransport::connect(AmqpConfig::cluster(urls.to_vec()).unwrap())
        .await
        .unwrap();
    t.teardown(plan).await.unwrap();
    t.close().await.unwrap();
}

#[tokio::test]
async fn a_node_list_connects_to_the_first_node_that_answers_and_refuses_bad_lists() {
    let Some(urls) = cluster("node list") else {
        return;
    };
    let _cluster = exclusive().await;

    // A node that does not answer is skipped; the connection goes to the next, in order.
    let mut list = vec!["amqp://guest:guest@127.0.0.1:5689/%2f".to_owned()];
    list.extend(urls.iter().skip(1).cloned());
    let t = AmqpTransport::connect(AmqpConfig::cluster(list.clone()).unwrap())
        .await
        .unwrap();
    assert_eq!(t.node().as_deref(), Some(redact(&urls[1]).as_str()));

    // A replication factor reaches every queue of the plan: two members each, of three nodes.
    let q = unique("cluster-replicas");
    let policy = RetryPolicy::delays([secs(1), secs(5)]).build().unwrap();
    let plan = TopologyPlan::builder(&q, &policy)
        .with_queue_type(QueueType::Quorum)
        .with_replication_factor(2)
        .build()
        .unwrap();
    t.provision(&plan).await.unwrap();
    let members = tokio::task::spawn_blocking(|| {
        let out = std::process::Command::new("rabbitmqctl")
            .args([
                "-n",
                "rtest2@localhost",
                "-q",
                "list_queues",
                "name",
                "type",
                "members",
            ])
            .output()
            .expect("rabbitmqctl runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .await
    .unwrap();
    for spec in plan.queues() {
        let line = members
            .lines()
            .find(|l| l.split('\t').next() == Some(spec.name.as_str()))
            .unwrap_or_else(|| panic!("{} is listed: {members}", spec.name));
        assert!(line.contains("\tquorum\t"), "{line}");
        assert_eq!(line.matches("@localhost").count(), 2, "{line}");
    }
    t.teardown(&plan).await.unwrap();
    t.close().await.unwrap();

    // Every node down: the error names each, and fails at once rather than retrying.
    let dead = AmqpConfig::cluster([
        "amqp://guest:guest@127.0.0.1:5688/%2f",
        "amqp://guest:guest@127.0.0.1:5689/%2f",
    ])
    .unwrap();
    let err = tokio::time::timeout(secs(20), AmqpTransport::connect(dead))
        .await
        .expect("a list of dead nodes fails quickly")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("127.0.0.1:5688") && err.contains("127.0.0.1:5689"),
        "{err}"
    );
    assert!(!err.contains("guest:guest"), "{err}");

    // A node of another cluster: the machine's own broker is not part of this one.
    let mut mixed = urls.clone();
    mixed.push(common::amqp_url());
    let err = AmqpTransport::connect(AmqpConfig::cluster(mixed).unwrap())
        .await
        .unwrap_err();
    let source = match &err {
        retry_core::TransportError::Other(e) => e.downcast_ref::<NodeListError>(),
        _ => None,
    };
    match source {
        Some(NodeListError::DifferentClusters {
            first_cluster,
            node,
            ..
        }) => {
            assert_eq!(first_cluster, "retry-test-cluster");
            assert_eq!(node, &redact(&common::amqp_url()));
        }
        other => panic!("{err}: {other:?}"),
    }

    // Wrong credentials: reported with the node that refused them, never the password.
    let wrong: Vec<String> = urls
        .iter()
        .map(|u| u.replacen("guest:guest", "guest:not-the-password-3141", 1))
        .collect();
    let err = tokio::time::timeout(
        secs(30),
        AmqpTransport::connect(AmqpConfig::cluster(wrong).unwrap()),
    )
    .await
    .expect("a refused login fails quickly")
    .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("not-the-password-3141"), "{text}");
    assert!(text.contains(&redact(&urls[0])), "{text}");

    // An empty list.
    assert_eq!(
        AmqpConfig::cluster(Vec::<String>::new()).unwrap_err(),
        NodeListError::Empty
    );
    let err = AmqpTransport::connect(AmqpConfig::new(" , "))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
}

fn redact(url: &str) -> String {
    AmqpConfig::new(url).redacted_url()
}

/// What the handler saw: successful runs per message id.
#[derive(Clone, Default)]
struct Handled(Arc<Mutex<HashMap<String, u32>>>);

impl Handled {
    fn unique(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn duplicates(&self) -> u32 {
        self.0.lock().unwrap().values().map(|n| n - 1).sum()
    }
    fn ids(&self) -> HashSet<String> {
        self.0.lock().unwrap().keys().cloned().collect()
    }
}

/// Publishes `m-0` .. `m-{n-1}` to `queue` with confirms, pipelined.
async fn publish_all(conn: &Connection, queue: &str, n: usize) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let mut confirms = Vec::with_capacity(n);
    for i in 0..n {
        let props = BasicProperties::default()
            .with_message_id(format!("m-{i}").into())
            .with_delivery_mode(2);
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                format!("body {i}").as_bytes(),
                props,
            )
            .await
            .unwrap(),
        );
    }
    for c in confirms {
        assert!(
            c.await.unwrap().is_ack(),
            "the cluster confirms every publish"
        );
    }
    let _ = ch.close(200, "published".into()).await;
}

/// Quorum queues replicated to all three nodes.
fn on_three_nodes(builder: TopologyBuilder<'_>) -> TopologyBuilder<'_> {
    builder
        .with_queue_type(QueueType::Quorum)
        .with_replication_factor(3)
}

/// A work queue named after `prefix` on the cluster, with its topology (quorum, on three
/// nodes, one 1 s delay level), `n` messages `m-0`.. published to it, and a transport that
/// follows the node list; returns the transport, the queue, the policy and the plan.
async fn loaded_queue(
    urls: &[String],
    prefix: &str,
    n: usize,
) -> (Arc<AmqpTransport>, String, RetryPolicy, TopologyPlan) {
    let q = unique(prefix);
    let policy = RetryPolicy::delays([secs(1)]).build().unwrap();
    let plan = on_three_nodes(TopologyPlan::builder(&q, &policy))
        .build()
        .unwrap();
    let config = AmqpConfig::cluster(urls.to_vec())
        .unwrap()
        .with_connection_name(q.clone())
        .with_reconnect_delay(Duration::from_millis(100), secs(2));
    assert_eq!(config.queue_type(), QueueType::Quorum);
    let t = Arc::new(AmqpTransport::connect(config).await.unwrap());
    t.provision(&plan).await.unwrap();
    let conn = raw(urls).await;
    publish_all(&conn, &q, n).await;
    let _ = conn.close(200, "published".into()).await;
    (t, q, policy, plan)
}

/// Takes every message off `queue` and returns their ids.
async fn drain_ids(conn: &Connection, queue: &str) -> Vec<String> {
    let ch = conn.create_channel().await.unwrap();
    let mut ids = Vec::new();
    while let Some(got) = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
    {
        let props = got.delivery.properties.clone();
        ids.push(
            props
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
        );
        got.delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    ids
}

/// `queue`'s `column` in `rabbitmqctl list_queues`, as the first running node of the cluster
/// lists it; `None` when no node lists the queue.
async fn queue_column(queue: &str, column: &'static str) -> Option<String> {
    let queue = queue.to_owned();
    tokio::task::spawn_blocking(move || {
        for node in ["rtest1", "rtest2", "rtest3"] {
            let node = format!("{node}@localhost");
            let args = ["-n", &node, "-q", "list_queues", "name", column];
            let Ok(out) = std::process::Command::new("rabbitmqctl")
                .args(args)
                .output()
            else {
                continue;
            };
            if out.status.success() {
                return String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter_map(|l| l.split_once('\t'))
                    .find(|(name, _)| *name == queue)
                    .map(|(_, value)| value.trim().to_owned());
            }
        }
        None
    })
    .await
    .unwrap()
}

/// How many messages `queue` holds, ready or not, as a node of the cluster counts them.
async fn depth(queue: &str) -> u64 {
    queue_column(queue, "messages")
        .await
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The node holding the leader of quorum queue `queue`, as `rtestN`.
async fn leader(queue: &str) -> String {
    let leader = queue_column(queue, "leader").await;
    let leader = leader.unwrap_or_else(|| panic!("no node knows the leader of {queue}"));
    leader.trim_end_matches("@localhost").to_owned()
}

/// Waits for the transport's recovery count to pass `from`, and returns how long it took.
async fn failover(t: &AmqpTransport, from: u64, started: Instant) -> Duration {
    let deadline = started + secs(120);
    while t.recoveries() <= from {
        if Instant::now() > deadline {
            panic!(
                "no failover within 120 s; connection {:?}; the last log lines:\n{}",
                t.connection().status(),
                log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

#[tokio::test]
async fn five_thousand_messages_survive_stopping_and_killing_nodes_with_nothing_lost() {
    const N: usize = 5_000;
    let Some(urls) = cluster("failover") else {
        return;
    };
    let _cluster = exclusive().await;
    let (t, q, policy, plan) = loaded_queue(&urls, "cluster-failover", N).await;

    // One in ten fails once (a delayed retry through the delay queue), one in a hundred is
    // permanent (parked); each run takes 50 ms, ten at a time: about 200 a second, so that
    // the run outlasts three node restarts.
    let handled = Handled::default();
    let runs = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    // While a stopped or killed node starts again, the handlers wait: on a slow machine a
    // restart outlasts the rest of the work, and step 3 needs work left to kill under.
    let paused = Arc::new(AtomicBool::new(false));
    let (h, r, p) = (handled.clone(), Arc::clone(&runs), Arc::clone(&paused));
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            let id = m.properties().message_id.clone().unwrap_or_default();
            let n: usize = id.trim_start_matches("m-").parse().unwrap_or(0);
            let run = {
                let mut runs = r.lock().unwrap();
                let e = runs.entry(id.clone()).or_default();
                *e += 1;
                *e
            };
            let (h, p) = (h.clone(), Arc::clone(&p));
            async move {
                while p.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                if n % 100 == 7 {
                    return Err(HandlerError::permanent("invalid order"));
                }
                if n % 10 == 3 && run == 1 {
                    return Err(HandlerError::transient("downstream timeout"));
                }
                *h.0.lock().unwrap().entry(id).or_default() += 1;
                Ok(())
            }
        },
        &q,
        |b| b.with_topology(on_three_nodes),
    );
    let progress = |at: usize| {
        let h = handled.clone();
        move || h.unique() >= at
    };
    let mut figures = Vec::new();

    // 1. Stop the node the consumer is on, gracefully, then start it again: it rejoins.
    wait_for("500 handled", secs(120), progress(500)).await;
    let first = t.node().expect("connected");
    let from = t.recoveries();
    let started = Instant::now();
    cluster_sh(&["stop", &node_name(&first)]).await;
    let took = failover(&t, from, started).await;
    let reached = t.node().unwrap();
    assert_ne!(reached, first, "the consumer moved to another node");
    figures.push(format!(
        "stop {}: {:.1} s",
        node_name(&first),
        took.as_secs_f64()
    ));
    let restart = tokio::spawn(async move { cluster_sh(&["start", &node_name(&first)]).await });
    wait_for("1,500 handled", secs(120), progress(1_500)).await;
    paused.store(true, Ordering::SeqCst);
    restart.await.unwrap();
    paused.store(false, Ordering::SeqCst);

    // 2. Kill -9 the VM of the node the consumer is on now.
    let second = t.node().unwrap();
    let from = t.recoveries();
    let started = Instant::now();
    cluster_sh(&["kill", &node_name(&second)]).await;
    let took = failover(&t, from, started).await;
    assert_ne!(t.node().unwrap(), second);
    figures.push(format!(
        "kill -9 {}: {:.1} s",
        node_name(&second),
        took.as_secs_f64()
    ));
    let restart = tokio::spawn(async move { cluster_sh(&["start", &node_name(&second)]).await });
    wait_for("2,500 handled", secs(120), progress(2_500)).await;
    paused.store(true, Ordering::SeqCst);
    restart.await.unwrap();
    paused.store(false, Ordering::SeqCst);

    // 3. Kill -9 the node holding the work queue's leader while the delay queue holds
    //    retries that dead-letter into it.
    let delay_queue = plan.delay_routes()[0].1.routing_key.to_string();
    let deadline = Instant::now() + secs(30);
    while depth(&delay_queue).await == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let waiting = depth(&delay_queue).await;
    assert!(
        waiting > 0,
        "retries wait in {delay_queue} when its target's leader is killed; handled {}; on \
         {:?} after {} recoveries; {}; the last log lines:\n{}",
        handled.unique(),
        t.node(),
        t.recoveries(),
        figures.join("; "),
        log_tail()
    );
    let leader_node = leader(&q).await;
    let from = t.recoveries();
    let started = Instant::now();
    cluster_sh(&["kill", &leader_node]).await;
    figures.push(format!(
        "kill -9 {leader_node} (work queue leader, {waiting} retries waiting in the delay queue)"
    ));
    let restart = tokio::spawn({
        let node = leader_node.clone();
        async move { cluster_sh(&["start", &node]).await }
    });

    // Every message ends handled or parked.
    let permanent: HashSet<String> = (0..N)
        .filter(|n| n % 100 == 7)
        .map(|n| format!("m-{n}"))
        .collect();
    let deadline = Instant::now() + secs(240);
    while handled.unique() < N - permanent.len() {
        if Instant::now() > deadline {
            let mut depths = Vec::new();
            for queue in [
                q.as_str(),
                delay_queue.as_str(),
                plan.isolation_queue(),
                plan.parking_queue(),
            ] {
                depths.push(format!("{queue}: {}", depth(queue).await));
            }
            panic!(
                "timed out: handled {} of {}; on {:?} after {} recoveries; {}; {}",
                handled.unique(),
                N - permanent.len(),
                t.node(),
                t.recoveries(),
                depths.join(", "),
                figures.join("; ")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    restart.await.unwrap();
    // Copies of messages held across a failover come back as suspects and are handled
    // again: wait until every queue but the parking queue is empty.
    let queues = [
        q.clone(),
        delay_queue.clone(),
        plan.isolation_queue().to_owned(),
    ];
    let deadline = Instant::now() + secs(120);
    loop {
        let mut total = 0;
        for queue in &queues {
            total += depth(queue).await;
        }
        if total == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{total} messages still in {queues:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if t.recoveries() > from {
        figures.push(format!(
            "  the consumer was on it and failed over in {:.1} s",
            failover(&t, from, started).await.as_secs_f64()
        ));
    }
    let report = running.stop().await;
    (*t).close().await.unwrap();

    let conn = raw(&urls).await;
    let parked = drain_ids(&conn, plan.parking_queue()).await;
    let parked_set: HashSet<String> = parked.iter().cloned().collect();
    let handled_set = handled.ids();
    let all: HashSet<String> = (0..N).map(|n| format!("m-{n}")).collect();
    let lost: Vec<&String> = all
        .iter()
        .filter(|id| !handled_set.contains(*id) && !parked_set.contains(*id))
        .collect();
    let summary = format!(
        "cluster failover: {N} messages, handled {}, parked {} ({} copies), lost {}, duplicate handler successes {}, recoveries {}; {}\n  report: {report:?}\n",
        handled_set.len(),
        parked_set.len(),
        parked.len(),
        lost.len(),
        handled.duplicates(),
        t.recoveries(),
        figures.join("; "),
    );
    print_uncaptured(&summary);
    // Each failover is logged with the node it left and the node it reached; no line shows
    // the password.
    let failovers = logs().containing("failed over to another node");
    let stalls = logs().containing("recovery made no attempt");
    print_uncaptured(&format!(
        "{}\n{}\n",
        failovers.join("\n"),
        stalls.join("\n")
    ));
    assert!(failovers.len() >= 2, "{failovers:?}");
    for line in &failovers {
        assert!(
            line.contains(" left=amqp://guest:****@127.0.0.1:568"),
            "{line}"
        );
        assert!(
            line.contains(" reached=amqp://guest:****@127.0.0.1:568"),
            "{line}"
        );
    }
    assert!(
        logs().containing("guest:guest").is_empty(),
        "a password in the logs"
    );
    assert!(lost.is_empty(), "lost {lost:?}\n{summary}");
    assert_eq!(handled_set.len() + parked_set.len(), N, "{summary}");
    assert_eq!(
        parked_set, permanent,
        "exactly the permanent failures are parked\n{summary}"
    );
    // The restarted nodes serve again: each holds a replica of the work queue.
    for url in &urls {
        let c = Connection::connect(url, ConnectionProperties::default())
            .await
            .unwrap_or_else(|e| panic!("{} is usable again: {e}", redact(url)));
        let ch = c.create_channel().await.unwrap();
        ch.queue_declare(
            q.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
        let _ = c.close(200, "checked".into()).await;
    }
    let _ = conn.close(200, "done".into()).await;
    teardown(&urls, &plan).await;
}

#[tokio::test]
async fn the_consumer_recovers_by_itself_after_every_node_was_down_for_ten_seconds() {
    const N: usize = 500;
    let Some(urls) = cluster("whole cluster down") else {
        return;
    };
    let _cluster = exclusive().await;
    let (t, q, policy, plan) = loaded_queue(&urls, "cluster-down", N).await;
    let handled = Handled::default();
    let h = handled.clone();
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            let id = m.properties().message_id.clone().unwrap_or_default();
            let h = h.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                *h.0.lock().unwrap().entry(id).or_default() += 1;
                Ok::<(), HandlerError>(())
            }
        },
        &q,
        |b| b.with_topology(on_three_nodes),
    );
    let seen = {
        let h = handled.clone();
        move || h.unique() >= 100
    };
    wait_for("100 handled", secs(60), seen).await;
    let from = t.recoveries();
    for node in ["rtest3", "rtest2", "rtest1"] {
        cluster_sh(&["stop", node]).await;
    }
    let down_at = Instant::now();
    let during = Arc::new(AtomicU64::new(0));
    tokio::time::sleep(secs(10)).await;
    during.store(handled.unique() as u64, Ordering::Relaxed);
    cluster_sh(&["start-all"]).await;
    let took = failover(&t, from, down_at).await;
    let all = {
        let h = handled.clone();
        move || h.unique() >= N
    };
    wait_for("every message handled after the restart", secs(180), all).await;
    let report = running.stop().await;
    print_uncaptured(&format!(
        "whole cluster down 10 s: {N} messages, handled {}, duplicates {}, back {:.1} s after the stop; report {report:?}\n",
        handled.unique(),
        handled.duplicates(),
        took.as_secs_f64()
    ));
    assert_eq!(handled.unique(), N);
    assert_eq!(depth(&q).await, 0);
    (*t).close().await.unwrap();
    teardown(&urls, &plan).await;
}
