//! On a real three-node NATS JetStream cluster (`tests/nats-cluster.sh up`): with every
//! stream of the plan kept on three servers (R3), killing the server that leads the work
//! stream mid-run, and later the server the consumer is connected to, loses no message, and
//! the consumer keeps consuming through both failovers.
//!
//! The cluster's URLs come from `NATS_CLUSTER_URLS` (`tests/nats-cluster.sh urls`). Without
//! them the test is skipped loudly, unless `REQUIRE_NATS_CLUSTER` is set (as CI does), which
//! makes a missing cluster a failure. It kills and restarts nodes, one at a time, and every
//! node runs again when it ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, ServerAddr};
use retry_core::{Consumer, HandlerError, Message, QueueRole, RetryPolicy, TopologyPlan};
use transport_nats::{NatsConfig, NatsTransport, stream_name};

/// The environment variable with the cluster's comma-separated URLs.
const CLUSTER_URLS: &str = "NATS_CLUSTER_URLS";
/// The environment variable that makes a missing cluster a failure instead of a skip.
const REQUIRE_CLUSTER: &str = "REQUIRE_NATS_CLUSTER";

/// How many messages the test publishes.
const MESSAGES: usize = 400;
/// How long all of them may take to be handled, failover included.
const DEADLINE: Duration = Duration::from_secs(120);

/// Who counts what: per message id, how often the handler ran and how often it succeeded.
#[derive(Default)]
struct Tally {
    runs: HashMap<String, u32>,
    handled: HashMap<String, u32>,
}

type Shared = Arc<Mutex<Tally>>;

fn lock(tally: &Shared) -> std::sync::MutexGuard<'_, Tally> {
    tally.lock().unwrap_or_else(|e| e.into_inner())
}

/// The cluster's URLs, or `None` (a loud skip) when they are not given and not required.
fn cluster_urls() -> Option<String> {
    match std::env::var(CLUSTER_URLS) {
        Ok(urls) if !urls.trim().is_empty() => Some(urls),
        _ if std::env::var_os(REQUIRE_CLUSTER).is_some() => panic!(
            "{REQUIRE_CLUSTER} is set, but {CLUSTER_URLS} is not: start the cluster with \
             `tests/nats-cluster.sh up` and export {CLUSTER_URLS}=$(tests/nats-cluster.sh urls)"
        ),
        _ => {
            eprintln!(
                "\n!!! SKIPPED the NATS cluster failover test: {CLUSTER_URLS} is not set.\n\
                 !!! Run `tests/nats-cluster.sh up` and set {CLUSTER_URLS}=$(tests/nats-cluster.sh urls),\n\
                 !!! or set {REQUIRE_CLUSTER}=1 to make this a failure.\n"
            );
            None
        }
    }
}

/// Runs `tests/nats-cluster.sh` with `args`, and panics if it fails.
async fn cluster_sh(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/nats-cluster.sh");
    let status = tokio::process::Command::new(script)
        .args(args)
        .status()
        .await
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        status.success(),
        "`nats-cluster.sh {}` failed: {status}",
        args.join(" ")
    );
}

fn unique_queue() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("nats-cluster-{}-{nanos}", std::process::id())
}

/// The handler: every fifth message fails transiently on its first run (so its retry goes
/// through the delay stream while the cluster fails over); every run takes a few ms.
fn handler(
    tally: Shared,
) -> impl Fn(Message) -> std::pin::Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>
+ Send
+ Sync
+ 'static {
    move |msg: Message| {
        let tally = Arc::clone(&tally);
        Box::pin(async move {
            let id = String::from_utf8_lossy(msg.body()).into_owned();
            let first = {
                let mut t = lock(&tally);
                let runs = t.runs.entry(id.clone()).or_default();
                *runs += 1;
                *runs == 1
            };
            tokio::time::sleep(Duration::from_millis(5)).await;
            let n: usize = id
                .rsplit('-')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if first && n.is_multiple_of(5) {
                return Err(HandlerError::transient(
                    "the first run of every fifth message fails",
                ));
            }
            *lock(&tally).handled.entry(id).or_default() += 1;
            Ok(())
        })
    }
}

/// Publishes message `n` with its id as `Nats-Msg-Id` and waits for the stream's
/// acknowledgement; a publish that fails (the stream's leader is gone, the connection moves)
/// is repeated with the same id, which the stream stores once.
async fn publish(js: &async_nats::jetstream::Context, queue: &str, id: &str) -> u32 {
    let started = Instant::now();
    let mut failures = 0;
    loop {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id);
        let message = PublishMessage::build()
            .payload(id.as_bytes().to_vec().into())
            .headers(headers)
            .expected_stream(stream_name(queue));
        let sent = match js.send_publish(queue.to_owned(), message).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(_) => return failures,
            Err(e) => {
                failures += 1;
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "publishing {id} still fails after 60 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// The server (`n1`..`n3`) that leads `queue`'s stream, once the stream has a leader.
async fn leader(js: &async_nats::jetstream::Context, queue: &str) -> String {
    let started = Instant::now();
    loop {
        if let Ok(mut stream) = js.get_stream(stream_name(queue)).await
            && let Ok(info) = stream.info().await
            && let Some(name) = info.cluster.as_ref().and_then(|c| c.leader.clone())
        {
            return name;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the stream of {queue} has no leader after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Messages stored in `queue`'s stream, or `None` when the cluster does not answer now.
async fn stored(js: &async_nats::jetstream::Context, queue: &str) -> Option<u64> {
    let mut stream = js.get_stream(stream_name(queue)).await.ok()?;
    let info = stream.info().await.ok()?;
    Some(info.state.messages)
}

/// Every queue of `plan` but the parking queue, and the parking queue.
fn queues(plan: &TopologyPlan) -> (Vec<String>, String) {
    let drained = plan
        .queues()
        .iter()
        .filter(|q| q.role != QueueRole::Parking)
        .map(|q| q.name.clone())
        .collect();
    (drained, plan.parking_queue().to_owned())
}

/// How many distinct messages have been handled.
fn handled(tally: &Shared) -> usize {
    lock(tally).handled.len()
}

/// Waits until `count` messages have been handled.
async fn wait_handled(tally: &Shared, count: usize, started: Instant) {
    while handled(tally) < count {
        assert!(
            started.elapsed() < DEADLINE,
            "only {} of {MESSAGES} handled after {DEADLINE:?}, waiting for {count}",
            handled(tally)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `count` messages have been handled, then names the work stream's leader.
async fn leader_at(
    js: &async_nats::jetstream::Context,
    queue: &str,
    tally: &Shared,
    count: usize,
    started: Instant,
) -> String {
    wait_handled(tally, count, started).await;
    leader(js, queue).await
}

/// Kills `node`, lets the cluster run without it for a few seconds, and starts it again.
async fn failover(
    node: &str,
    what: &str,
    client: &async_nats::Client,
    tally: &Shared,
    killed: &Mutex<Option<String>>,
    started: Instant,
) {
    eprintln!(
        "{:.1?}: {} of {MESSAGES} handled; killing {node}, {what} (the consumer is connected \
         to {})",
        started.elapsed(),
        handled(tally),
        client.server_info().server_name
    );
    *killed.lock().unwrap_or_else(|e| e.into_inner()) = Some(node.to_owned());
    cluster_sh(&["kill", node]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    eprintln!(
        "{:.1?}: {} handled while {node} was down; starting it again",
        started.elapsed(),
        handled(tally)
    );
    cluster_sh(&["start", node]).await;
    *killed.lock().unwrap_or_else(|e| e.into_inner()) = None;
    eprintln!(
        "{:.1?}: {node} is back (the consumer is connected to {})",
        started.elapsed(),
        client.server_info().server_name
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_work_streams_leader_loses_nothing() {
    let Some(urls) = cluster_urls() else {
        return;
    };
    let started = Instant::now();
    let queue = unique_queue();
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .build()
        .expect("a policy");
    let transport = NatsTransport::connect(
        NatsConfig::new(urls.clone())
            .with_replicas(3)
            .with_ack_wait(Duration::from_secs(2))
            .with_pull_wait(Duration::from_millis(500)),
    )
    .await
    .unwrap_or_else(|e| panic!("connect to the NATS cluster at {urls}: {e}"));
    let nodes: Vec<ServerAddr> = urls
        .split(',')
        .map(|u| u.trim().parse().expect("a cluster URL"))
        .collect();
    let admin = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_secs(5)))
        .connect(nodes)
        .await
        .expect("an admin connection to the cluster");
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(5))
        .build(admin.clone());

    let tally: Shared = Arc::default();
    let consumer = Consumer::builder(
        transport,
        queue.clone(),
        policy,
        handler(Arc::clone(&tally)),
    )
    .build()
    .expect("a consumer");
    let plan = consumer.plan().clone();
    // A node this test killed and has not started again.
    let killed: Arc<Mutex<Option<String>>> = Arc::default();

    let body = tokio::spawn(run(
        consumer,
        queue.clone(),
        plan.clone(),
        js.clone(),
        Arc::clone(&tally),
        Arc::clone(&killed),
    ));
    let outcome = body.await;

    // Passed or failed: every node runs again, and the plan's streams are gone.
    let down = killed.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(node) = down {
        cluster_sh(&["start", &node]).await;
    }
    for q in plan.queues() {
        let name = stream_name(&q.name);
        let mut deleted = false;
        for _ in 0..20 {
            if js.delete_stream(&name).await.is_ok() {
                deleted = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if !deleted {
            eprintln!("could not delete stream {name}");
        }
    }
    eprintln!("the test took {:.1?}", started.elapsed());
    if let Err(e) = outcome {
        if e.is_panic() {
            std::panic::resume_unwind(e.into_panic());
        }
        panic!("the test's task ended: {e}");
    }
}

async fn run(
    consumer: Consumer<NatsTransport, impl retry_core::Handler>,
    queue: String,
    plan: TopologyPlan,
    js: async_nats::jetstream::Context,
    tally: Shared,
    killed: Arc<Mutex<Option<String>>>,
) {
    let started = Instant::now();
    let client = consumer.transport().client().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consuming = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));

    // The consumer provisions the plan: publish once the work stream is there.
    while stored(&js, &queue).await.is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the consumer has not provisioned {queue} after 30 s"
        );
        assert!(
            !consuming.is_finished(),
            "the consumer ended before it consumed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replicas = js
        .get_stream(stream_name(&queue))
        .await
        .expect("the work stream")
        .info()
        .await
        .expect("the work stream's info")
        .config
        .num_replicas;
    assert_eq!(replicas, 3, "the work stream is kept on three servers");

    // Publishing runs beside consuming, paced, so both go on while the cluster fails over.
    let ids: Vec<String> = (0..MESSAGES).map(|n| format!("{queue}-msg-{n}")).collect();
    let publishing = tokio::spawn({
        let (js, queue, ids) = (js.clone(), queue.clone(), ids.clone());
        async move {
            let mut failed = 0;
            for id in &ids {
                failed += publish(&js, &queue, id).await;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            failed
        }
    });

    // Once about a third is handled: kill the work stream's leader, and start it again.
    let node = leader_at(&js, &queue, &tally, MESSAGES / 3, started).await;
    failover(
        &node,
        "the leader of the work stream",
        &client,
        &tally,
        &killed,
        started,
    )
    .await;
    eprintln!(
        "{:.1?}: the work stream's leader is {}",
        started.elapsed(),
        leader(&js, &queue).await
    );
    // Once two thirds are: kill the node the consumer is connected to now, so that its own
    // connection fails over too (it may have been on the leader, or still be).
    wait_handled(&tally, 2 * MESSAGES / 3, started).await;
    let node = client.server_info().server_name;
    failover(
        &node,
        "the consumer's server",
        &client,
        &tally,
        &killed,
        started,
    )
    .await;

    let publish_failures = publishing.await.expect("the publisher");
    eprintln!(
        "{:.1?}: all {MESSAGES} published ({publish_failures} publishes repeated)",
        started.elapsed()
    );

    // Every id handled, and nothing left in the work, retry or isolation streams.
    let (drained, parking) = queues(&plan);
    loop {
        let missing = ids
            .iter()
            .filter(|id| !lock(&tally).handled.contains_key(*id))
            .count();
        let mut left = Vec::new();
        if missing == 0 {
            for q in &drained {
                match stored(&js, q).await {
                    Some(0) => {}
                    n => left.push(format!("{q}: {n:?}")),
                }
            }
            if left.is_empty() {
                break;
            }
        }
        assert!(
            !consuming.is_finished(),
            "the consumer ended with {missing} of {MESSAGES} never handled: {:?}",
            consuming.await
        );
        assert!(
            started.elapsed() < DEADLINE,
            "after {DEADLINE:?}: {missing} of {MESSAGES} never handled; streams not empty: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let all_handled = started.elapsed();

    // A graceful stop.
    let _ = stop.send(());
    let report = tokio::time::timeout(Duration::from_secs(60), consuming)
        .await
        .expect("the consumer stops within 60 s")
        .expect("the consumer's task")
        .expect("the consumer's run");

    {
        let tally = lock(&tally);
        let lost: Vec<&String> = ids
            .iter()
            .filter(|id| !tally.handled.contains_key(*id))
            .collect();
        let duplicates = tally.handled.values().filter(|&&n| n > 1).count();
        let extra_runs: u32 = tally.handled.values().map(|n| n - 1).sum();
        eprintln!(
            "{all_handled:.1?}: all handled. lost {}, duplicates {duplicates} ({extra_runs} extra \
             successful runs), handler runs {}; report: {report:?}",
            lost.len(),
            tally.runs.values().sum::<u32>()
        );
        assert!(lost.is_empty(), "{} messages lost: {lost:?}", lost.len());
        assert!(
            tally.handled.keys().all(|id| ids.contains(id)),
            "a message nobody published was handled"
        );
    }

    assert_eq!(
        stored(&js, &parking).await,
        Some(0),
        "the parking stream is empty: nothing was dead-lettered"
    );
    for q in &drained {
        assert_eq!(
            stored(&js, q).await,
            Some(0),
            "stream of {q} is empty at the end"
        );
    }
}
