//! On a real three-node NATS JetStream cluster (`stress/nats-cluster.sh up`): with every
//! stream of the plan kept on three servers (R3), killing the server that leads the work
//! stream mid-run, and later the server the consumer is connected to, loses no message, and
//! the consumer keeps consuming through both failovers.
//!
//! The cluster's URLs come from `NATS_CLUSTER_URLS` (`stress/nats-cluster.sh urls`). Without
//! them the test is skipped loudly, unless `REQUIRE_NATS_CLUSTER` is set (as CI does), which
//! makes a missing cluster a failure. It kills and restarts nodes, one at a time, and every
//! node runs again when it ends.
//!
//! A restarted node is given back to the test once every stream of the plan is current on
//! all three servers, so that the second kill cannot take a stream's quorum. (Not every
//! consumer: nats-server 2.9.10 may never bring a restarted node current on a consumer with
//! no traffic, see `stress/nats-cluster.sh`.) The messages are published in two batches, the
//! second once the first node is back, so that messages are in flight when the consumer's
//! server is killed, however long that took.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::message::PublishMessage;
use async_nats::{HeaderMap, ServerAddr};
use retry_core::{
    Consumer, HandlerError, Message, QueueRole, QueueSpec, RetryPolicy, TopologyPlan,
};
use test_brokers::nats::{cluster, cluster_sh, try_cluster_sh};
use transport_nats::{CONSUMER, NatsConfig, NatsTransport, stream_name};

/// How many messages the test publishes.
const MESSAGES: usize = 400;
/// How many of them are published before the first node is back.
const FIRST_BATCH: usize = 2 * MESSAGES / 3;
/// How long the consumer may take to reach each mark (a third handled, three quarters
/// handled, all handled), counted from the moment it could start on it: a node's downtime
/// is included, the wait for a restarted node to be current is not.
const DEADLINE: Duration = Duration::from_secs(90);

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

fn unique_queue() -> String {
    test_brokers::unique("nats-cluster")
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

/// What `queue`'s stream holds and where its consumer stands, for a failure's message.
async fn describe(js: &async_nats::jetstream::Context, queue: &str) -> String {
    let Ok(mut stream) = js.get_stream(stream_name(queue)).await else {
        return format!("{queue}: the stream does not answer");
    };
    let state = match stream.info().await {
        Ok(info) => format!(
            "{:?}, leader {:?}",
            info.state,
            info.cluster.as_ref().and_then(|c| c.leader.as_ref())
        ),
        Err(e) => format!("no stream info: {e}"),
    };
    let consumer = match stream.consumer_info(CONSUMER).await {
        Ok(c) => format!(
            "delivered {:?}, ack floor {:?}, {} pending, {} awaiting an ack, {} redelivered, \
             leader {:?}",
            c.delivered,
            c.ack_floor,
            c.num_pending,
            c.num_ack_pending,
            c.num_redelivered,
            c.cluster.as_ref().and_then(|c| c.leader.as_ref())
        ),
        Err(e) => format!("no consumer info: {e}"),
    };
    format!("{queue}: stream {state}; consumer {consumer}")
}

/// How long the streams may hold messages once every id has been handled before what they
/// hold is examined (the isolation queue is looked at every 5 s by default).
const SETTLE: Duration = Duration::from_secs(20);

/// What the streams of `queues` still hold once every id was handled: copies of handled
/// messages that the server will never hand out, since the queue's consumer has acked past
/// them. nats-server 2.9.10 can leave such copies in a work-queue stream across a failover
/// (one copy, in the work or the isolation stream, in about one run of ten here), as it
/// does on a single server killed and restarted (`tests/reconnect.rs`). Anything else
/// fails: a message the consumer has yet to hand out or to see acked (the engine left it),
/// or one that was never handled. Returns how many each stream holds.
async fn ghosts(
    js: &async_nats::jetstream::Context,
    queues: &[&String],
    tally: &Shared,
) -> HashMap<String, u64> {
    let mut found = HashMap::new();
    for &queue in queues {
        let mut stream = js
            .get_stream(stream_name(queue))
            .await
            .unwrap_or_else(|e| panic!("the stream of {queue}: {e}"));
        let consumer = stream
            .consumer_info(CONSUMER)
            .await
            .unwrap_or_else(|e| panic!("the consumer of {queue}: {e}"));
        assert!(
            consumer.num_pending == 0 && consumer.num_ack_pending == 0,
            "every id handled, but {queue} still has messages to hand out: {}",
            describe(js, queue).await
        );
        let state = stream
            .info()
            .await
            .unwrap_or_else(|e| panic!("the stream of {queue}: {e}"))
            .state
            .clone();
        let mut count = 0;
        for sequence in state.first_sequence..=state.last_sequence {
            let message = match stream.get_raw_message(sequence).await {
                Ok(m) => m,
                Err(e)
                    if e.kind()
                        == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
                {
                    continue;
                }
                Err(e) => panic!("read message {sequence} of {queue}: {e}"),
            };
            let id = String::from_utf8_lossy(&message.payload).into_owned();
            assert!(
                lock(tally).handled.contains_key(&id),
                "{queue} holds {id} (sequence {sequence}), which was never handled"
            );
            assert!(
                sequence <= consumer.ack_floor.stream_sequence,
                "{queue} holds {id} at sequence {sequence}, above its consumer's ack floor: {}",
                describe(js, queue).await
            );
            count += 1;
        }
        eprintln!(
            "{queue}: {count} copies of handled messages below the consumer's ack floor, which \
             the server never hands out"
        );
        found.insert(queue.clone(), count);
    }
    found
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

/// Waits until `count` messages have been handled, at most [`DEADLINE`] from `since`.
async fn wait_handled(tally: &Shared, count: usize, since: Instant) {
    while handled(tally) < count {
        assert!(
            since.elapsed() < DEADLINE,
            "only {} of {MESSAGES} handled {DEADLINE:?} after the consumer could go on, \
             waiting for {count}",
            handled(tally)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long a restarted node may take to catch up on every stream of the plan.
const CATCH_UP: Duration = Duration::from_secs(60);

/// What a failover works on.
struct Scene<'a> {
    js: &'a async_nats::jetstream::Context,
    /// The consumer's own connection (which server it is on).
    client: &'a async_nats::Client,
    plan: &'a TopologyPlan,
    tally: &'a Shared,
    /// The node this test killed and has not started again.
    killed: &'a Mutex<Option<String>>,
    started: Instant,
}

/// The replicas of `queue`'s stream and consumer (the parking queue has none) that their
/// leaders do not see as current, as `(stream, consumer)` descriptions (empty when all are);
/// an error when the stream does not answer.
async fn behind(
    js: &async_nats::jetstream::Context,
    queue: &QueueSpec,
) -> Result<(String, String), String> {
    fn lagging(cluster: Option<&async_nats::jetstream::stream::ClusterInfo>) -> String {
        let Some(cluster) = cluster else {
            return "no cluster information".into();
        };
        let mut out: Vec<String> = cluster
            .replicas
            .iter()
            .filter(|r| !r.current || r.offline)
            .map(|r| format!("{} (lag {:?})", r.name, r.lag))
            .collect();
        if cluster.leader.is_none() {
            out.push("no leader".into());
        } else if cluster.replicas.len() != 2 {
            out.push(format!(
                "{} replicas besides the leader",
                cluster.replicas.len()
            ));
        }
        out.join(", ")
    }
    let mut stream = js
        .get_stream(stream_name(&queue.name))
        .await
        .map_err(|e| format!("{}: {e}", queue.name))?;
    let replicas = lagging(
        stream
            .info()
            .await
            .map_err(|e| format!("{}: {e}", queue.name))?
            .cluster
            .as_ref(),
    );
    let consumer = if queue.role == QueueRole::Parking {
        String::new()
    } else {
        match stream.consumer_info(CONSUMER).await {
            Ok(c) => lagging(c.cluster.as_ref()),
            Err(e) => e.to_string(),
        }
    };
    Ok((replicas, consumer))
}

/// Waits until every stream of the plan has its three replicas current, as its leader sees
/// them, so that the next kill cannot take a stream's quorum. Consumers are not waited for:
/// nats-server 2.9.10 may never bring a restarted node current on a consumer with no
/// traffic (`stress/nats-cluster.sh`, META_ONLY); those still behind are printed.
async fn wait_replicated(scene: &Scene<'_>) {
    let since = Instant::now();
    loop {
        let mut streams = Vec::new();
        let mut consumers = Vec::new();
        for q in scene.plan.queues() {
            match behind(scene.js, q).await {
                Ok((s, c)) => {
                    if !s.is_empty() {
                        streams.push(format!("{}: {s}", q.name));
                    }
                    if !c.is_empty() {
                        consumers.push(format!("{}: {c}", q.name));
                    }
                }
                Err(e) => streams.push(e),
            }
        }
        if streams.is_empty() {
            if !consumers.is_empty() {
                eprintln!(
                    "{:.1?}: every stream is current on all three servers; consumers still \
                     behind: {consumers:?}",
                    scene.started.elapsed()
                );
            }
            return;
        }
        assert!(
            since.elapsed() < CATCH_UP,
            "streams not current on all three servers {CATCH_UP:?} after the restart: {streams:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Kills `node`, lets the cluster run without it for a few seconds, starts it again and waits
/// until every stream of the plan is current on it.
async fn failover(scene: &Scene<'_>, node: &str, what: &str) {
    let Scene {
        client,
        tally,
        killed,
        started,
        ..
    } = *scene;
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
    wait_replicated(scene).await;
    eprintln!(
        "{:.1?}: {node} is back, every stream current on it (the consumer is connected to {}; \
         {} handled)",
        started.elapsed(),
        client.server_info().server_name,
        handled(tally)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_work_streams_leader_loses_nothing() {
    let Some(nodes) = cluster("the NATS cluster failover test") else {
        return;
    };
    let urls = nodes.join(",");
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
    let nodes: Vec<ServerAddr> = nodes
        .iter()
        .map(|u| u.parse().expect("a cluster URL"))
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

    // Passed or failed: every node runs again, and the plan's streams are gone (deleted even
    // when the node does not come back, so that no later run finds them).
    let down = killed.lock().unwrap_or_else(|e| e.into_inner()).take();
    let restarted = match down {
        Some(node) => try_cluster_sh(&["start", &node]).await,
        None => Ok(()),
    };
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
    if let Err(e) = restarted {
        panic!("{e}");
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

    let scene = Scene {
        js: &js,
        client: &client,
        plan: &plan,
        tally: &tally,
        killed: &killed,
        started,
    };

    // Publishing runs beside consuming, paced, so both go on while the cluster fails over:
    // ids below `released` are published.
    let ids: Vec<String> = (0..MESSAGES).map(|n| format!("{queue}-msg-{n}")).collect();
    let (release, released) = tokio::sync::watch::channel(FIRST_BATCH);
    let publishing = tokio::spawn({
        let (js, queue, ids, mut released) = (js.clone(), queue.clone(), ids.clone(), released);
        async move {
            let mut failed = 0;
            for (n, id) in ids.iter().enumerate() {
                released
                    .wait_for(|&limit| n < limit)
                    .await
                    .expect("the test releases every batch");
                failed += publish(&js, &queue, id).await;
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            failed
        }
    });

    // Once about a third is handled: kill the work stream's leader, and start it again.
    wait_handled(&tally, MESSAGES / 3, started).await;
    let node = leader(&js, &queue).await;
    failover(&scene, &node, "the leader of the work stream").await;
    eprintln!(
        "{:.1?}: the work stream's leader is {}",
        started.elapsed(),
        leader(&js, &queue).await
    );
    // The second batch, and once three quarters are handled (most of the second batch is
    // still to come): kill the node the consumer is connected to now, so that its own
    // connection fails over too (it may have been on the leader, or still be).
    release.send_replace(MESSAGES);
    wait_handled(&tally, 3 * MESSAGES / 4, Instant::now()).await;
    let node = client.server_info().server_name;
    failover(&scene, &node, "the consumer's server").await;

    let publish_failures = publishing.await.expect("the publisher");
    eprintln!(
        "{:.1?}: all {MESSAGES} published ({publish_failures} publishes repeated)",
        started.elapsed()
    );

    // Every id handled, and nothing left in the work, retry or isolation streams but copies
    // the server will never hand out again (see `ghosts`).
    let (drained, parking) = queues(&plan);
    let since = Instant::now();
    let mut all_handled_at = None;
    let ghosts = loop {
        let missing = ids
            .iter()
            .filter(|id| !lock(&tally).handled.contains_key(*id))
            .count();
        let mut left = Vec::new();
        if missing == 0 {
            let at = *all_handled_at.get_or_insert_with(Instant::now);
            for q in &drained {
                match stored(&js, q).await {
                    Some(0) => {}
                    n => left.push((q.clone(), n)),
                }
            }
            if left.is_empty() {
                break HashMap::new();
            }
            if at.elapsed() >= SETTLE && left.iter().all(|(_, n)| n.is_some()) {
                let queues: Vec<&String> = left.iter().map(|(q, _)| q).collect();
                break ghosts(&js, &queues, &tally).await;
            }
        }
        assert!(
            !consuming.is_finished(),
            "the consumer ended with {missing} of {MESSAGES} never handled: {:?}",
            consuming.await
        );
        if since.elapsed() >= DEADLINE {
            let mut streams = Vec::new();
            for q in &drained {
                streams.push(describe(&js, q).await);
            }
            panic!(
                "{DEADLINE:?} after the last node came back: {missing} of {MESSAGES} never \
                 handled; streams not empty: {left:?}\n{}",
                streams.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
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
             successful runs), handler runs {}, copies of handled messages the server never \
             hands out {ghosts:?}; report: {report:?}",
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
        let ghosts = ghosts.get(q).copied().unwrap_or(0);
        assert_eq!(
            stored(&js, q).await,
            Some(ghosts),
            "stream of {q} holds only the {ghosts} copies the server never hands out at the end"
        );
    }
}
