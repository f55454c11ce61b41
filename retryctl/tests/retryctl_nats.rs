//! `retryctl` over NATS JetStream end to end: the built binary against the local server
//! (`NATS_URL`, default nats://127.0.0.1:4222), each test on queues of its own whose streams
//! it deletes at the end; messages parked by a real `retry_core::Consumer` on
//! transport-nats. Without a server the tests skip loudly, or fail under `REQUIRE_NATS=1`.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/console.rs"]
mod console;
#[path = "common/nats.rs"]
mod nats;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cli::{POLICY, PolicyFile, Run, ids, json_lines, plan, retryctl_with_env};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, Terminal, TopologyPlan};
use serde_json::Value;
use transport_nats::{NatsTransport, stream_name};

/// Runs `retryctl --url <NATS URL> args`.
async fn retryctl_nats(args: &[&str]) -> Run {
    let url = nats::url();
    let all = [&["--url", url.as_str()][..], args].concat();
    // AMQP_URL set to something else: `--url` decides.
    retryctl_with_env(&all, "amqp://guest:guest@127.0.0.1:5672/%2f").await
}

/// The policy `POLICY` describes, for the consumer.
fn policy() -> RetryPolicy {
    RetryPolicy::delays([200, 500].map(Duration::from_millis))
        .with_max_attempts(3)
        .with_crash_delay(Duration::from_millis(300))
        .build()
        .unwrap()
}

/// A work queue of its own, its plan, and the guard that deletes the plan's streams.
fn work_queue(prefix: &str) -> (String, TopologyPlan, nats::Cleanup) {
    let queue = common::unique(prefix);
    let plan = plan(&queue);
    let cleanup = nats::Cleanup(plan.clone());
    (queue, plan, cleanup)
}

/// Publishes `ids` to `queue` and runs a `Consumer` (which provisions the plan) whose handler
/// fails each of them permanently, until every one is parked with the engine's headers.
async fn park_with_consumer(transport: &NatsTransport, queue: &str, ids: &[&str]) {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let done_tx = Mutex::new(Some(done_tx));
    let parked = Arc::new(Mutex::new(0usize));
    let wanted = ids.len();
    let consumer = Consumer::builder(
        transport.clone(),
        queue,
        policy(),
        |m: Message| async move {
            Err::<(), _>(HandlerError::permanent(format!(
                "spam is never accepted: {}",
                String::from_utf8_lossy(m.body())
            )))
        },
    )
    .with_on_terminal(move |_, terminal| {
        if matches!(terminal, Terminal::DeadLettered { .. }) {
            let mut n = parked.lock().unwrap();
            *n += 1;
            if *n == wanted {
                done_tx.lock().unwrap().take().map(|tx| tx.send(()));
            }
        }
    })
    .build()
    .expect("a consumer");
    // The first run provisions the streams; the messages go in once they exist.
    let running = tokio::spawn(consumer.run(async {
        let _ = done_rx.await;
    }));
    let client = transport.client().clone();
    for _ in 0..100 {
        if transport.count(queue).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in ids {
        nats::publish(
            &client,
            queue,
            id,
            &format!("body of {id}"),
            &[("tenant", "acme")],
        )
        .await;
    }
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("every message parked within 30 s")
        .expect("the consumer task")
        .expect("the consumer ran");
}

/// A work queue whose parking stream holds `p-1` and `p-2`, parked permanently by a
/// consumer, and then `raw-1`, published there without the engine's headers.
async fn parked_three(
    prefix: &str,
) -> Option<(NatsTransport, String, TopologyPlan, nats::Cleanup)> {
    let transport = nats::connect(prefix).await?;
    let (queue, plan, cleanup) = work_queue(prefix);
    park_with_consumer(&transport, &queue, &["p-1", "p-2"]).await;
    nats::publish(
        transport.client(),
        plan.parking_queue(),
        "raw-1",
        "not parked by the engine",
        &[],
    )
    .await;
    assert_eq!(transport.count(plan.parking_queue()).await.unwrap(), 3);
    assert_eq!(transport.count(&queue).await.unwrap(), 0);
    Some((transport, queue, plan, cleanup))
}

/// Every object `topology verify` checks on NATS, as it names them.
fn objects(plan: &TopologyPlan) -> Vec<String> {
    let mut out = Vec::new();
    for q in plan.queues() {
        let stream = stream_name(&q.name);
        out.push(format!("stream {stream} (queue {})", q.name));
        if q.name != plan.parking_queue() {
            out.push(format!("consumer retry-engine on stream {stream}"));
        }
    }
    out
}

#[tokio::test]
async fn topology_apply_then_verify_passes_object_by_object() {
    let Some(transport) = nats::connect("retryctl topology apply over NATS").await else {
        return;
    };
    let (queue, plan, _cleanup) = work_queue("retryctl-nats-apply");
    let policy = PolicyFile::new(POLICY);
    let objects = objects(&plan);
    assert_eq!(objects.len(), 11);
    let at = transport.config().url();

    let applied = retryctl_nats(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(
        applied.stdout.lines().next(),
        Some(format!("applied the plan of work queue `{queue}` on {at} (NATS JetStream)").as_str()),
        "{applied:?}"
    );
    for object in &objects {
        let line = format!("  created   {object}\n");
        assert!(applied.stdout.contains(&line), "no {line:?} in {applied:?}");
    }
    assert!(
        applied.stdout.ends_with("11 created, 0 verified\n"),
        "{applied:?}"
    );
    for q in plan.queues() {
        assert_eq!(transport.count(&q.name).await.unwrap(), 0, "{}", q.name);
    }
    // Again: everything is there as planned.
    let again = retryctl_nats(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(again.code, 0, "{again:?}");
    assert_eq!(
        again.stdout.matches("  verified  ").count(),
        11,
        "{again:?}"
    );
    assert!(
        again.stdout.ends_with("0 created, 11 verified\n"),
        "{again:?}"
    );

    let verified = retryctl_nats(&["topology", "verify", &queue, "--policy", policy.path()]).await;
    assert_eq!(verified.code, 0, "{verified:?}");
    assert!(verified.stderr.is_empty(), "{verified:?}");
    assert!(
        verified.stdout.starts_with(&format!(
            "verifying work queue `{queue}` on {at} over NATS JetStream: that every stream and \
             consumer exists with the plan's settings"
        )),
        "{verified:?}"
    );
    for object in &objects {
        let line = format!("  ok    {object}\n");
        assert!(
            verified.stdout.contains(&line),
            "no {line:?} in {verified:?}"
        );
    }
    assert!(
        verified
            .stdout
            .ends_with(&format!("the broker matches the plan of `{queue}`\n")),
        "{verified:?}"
    );
    transport.close().await;
}

#[tokio::test]
async fn topology_verify_exits_1_naming_a_deleted_stream() {
    let Some(transport) = nats::connect("retryctl topology verify over NATS").await else {
        return;
    };
    let (queue, _, _cleanup) = work_queue("retryctl-nats-verify");
    let policy = PolicyFile::new(POLICY);
    let verify = ["topology", "verify", &queue, "--policy", policy.path()];
    // Applied as an operator does (the test's own connection has a shorter ack wait, which
    // verify would name as the consumers' setting that differs).
    let applied = retryctl_nats(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(applied.code, 0, "{applied:?}");
    let passed = retryctl_nats(&verify).await;
    assert_eq!(passed.code, 0, "{passed:?}");

    let slow = format!("{queue}.retry.500ms");
    let js = async_nats::jetstream::new(transport.client().clone());
    assert!(js.delete_stream(stream_name(&slow)).await.unwrap().success);
    let failed = retryctl_nats(&verify).await;
    assert_eq!(failed.code, 1, "{failed:?}");
    let stream = stream_name(&slow);
    let lines: Vec<&str> = failed.stdout.lines().collect();
    assert!(
        lines.contains(&format!("  FAIL  stream {stream} (queue {slow}): missing").as_str()),
        "{failed:?}"
    );
    assert!(
        lines.contains(
            &format!("  FAIL  consumer retry-engine on stream {stream}: missing, with its stream")
                .as_str()
        ),
        "{failed:?}"
    );
    assert_eq!(failed.stdout.matches("  ok    ").count(), 9, "{failed:?}");
    assert_eq!(
        failed.stderr.trim(),
        format!("retryctl: 2 of 11 checks failed: the broker does not match the plan of `{queue}`")
    );

    // The work stream deleted too: named before any line.
    assert!(js.delete_stream(stream_name(&queue)).await.unwrap().success);
    let gone = retryctl_nats(&verify).await;
    assert_eq!(gone.code, 1, "{gone:?}");
    assert!(gone.stdout.is_empty(), "{gone:?}");
    assert!(
        gone.stderr.starts_with(&format!(
            "retryctl: there is no queue `{queue}` on {}:",
            transport.config().url()
        )),
        "{gone:?}"
    );
    transport.close().await;
}

#[tokio::test]
async fn parked_list_and_show_what_a_consumer_parked_and_what_it_did_not() {
    let Some((transport, queue, plan, _cleanup)) = parked_three("retryctl-nats-list").await else {
        return;
    };
    let parking = plan.parking_queue();

    let listed = json_lines(&retryctl_nats(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&listed), ["p-1", "p-2", "raw-1"], "{listed:?}");
    for line in &listed[..2] {
        assert_eq!(line["reason"], "permanent", "{line}");
        assert_eq!(line["attempts"], 1, "{line}");
        assert_eq!(line["crashes"], 0, "{line}");
        assert_eq!(line["origin_queue"], queue.as_str(), "{line}");
        assert!(line["parked_at"].is_string(), "{line}");
    }
    assert_eq!(
        listed[0]["last_error"],
        "spam is never accepted: body of p-1"
    );
    assert_eq!(listed[2]["reason"], "unknown", "{listed:?}");
    assert_eq!(listed[2]["attempts"], Value::Null, "{listed:?}");

    let permanent = json_lines(
        &retryctl_nats(&["parked", "list", &queue, "--reason", "permanent", "--json"]).await,
    );
    assert_eq!(ids(&permanent), ["p-1", "p-2"]);
    let table = retryctl_nats(&["parked", "list", &queue]).await;
    assert_eq!(table.code, 0, "{table:?}");
    assert!(
        table.stdout.lines().any(|l| l.starts_with("p-2 ")
            && l.contains(" permanent ")
            && l.ends_with("  spam is never accepted: body of p-2")),
        "{table:?}"
    );
    assert_eq!(
        table.stdout.lines().last(),
        Some(format!("3 listed; 3 parked in {parking}").as_str()),
        "{table:?}"
    );

    let shown = retryctl_nats(&["parked", "show", &queue, "--id", "p-1", "--json"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    let shown: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(shown["body"]["text"], "body of p-1", "{shown:#}");
    assert_eq!(shown["headers"]["tenant"], "acme", "{shown:#}");
    assert_eq!(shown["headers"]["x-retry-reason"], "permanent", "{shown:#}");
    assert_eq!(shown["properties"]["message_id"], "p-1", "{shown:#}");
    let raw = retryctl_nats(&["parked", "show", &queue, "--id", "raw-1"]).await;
    assert_eq!(raw.code, 0, "{raw:?}");
    assert!(
        raw.stdout
            .starts_with(&format!("message raw-1 in {parking}\n\nrecord\n")),
        "{raw:?}"
    );
    assert!(
        raw.stdout.contains("  reason              unknown\n"),
        "{raw:?}"
    );
    assert!(raw.stdout.contains("  not parked by the engine"), "{raw:?}");
    let missing = retryctl_nats(&["parked", "show", &queue, "--id", "nope"]).await;
    assert_eq!(missing.code, 1, "{missing:?}");
    assert_eq!(
        missing.stderr.trim(),
        format!("retryctl: no message with id \"nope\" in {parking}")
    );

    // Reading took nothing.
    assert_eq!(transport.count(parking).await.unwrap(), 3);
    // A queue with no streams is named.
    let nowhere = format!("{queue}-nowhere");
    let unknown = retryctl_nats(&["parked", "list", &nowhere]).await;
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(
        unknown.stderr.contains(&format!(
            "parking queue \"{nowhere}.parking\" does not exist"
        )),
        "{unknown:?}"
    );
    transport.close().await;
}

#[tokio::test]
async fn parked_replay_by_reason_moves_the_copies_to_the_work_stream() {
    let Some((transport, queue, plan, _cleanup)) = parked_three("retryctl-nats-replay").await
    else {
        return;
    };
    let parking = plan.parking_queue();

    let dry = retryctl_nats(&[
        "parked",
        "replay",
        &queue,
        "--reason",
        "permanent",
        "--dry-run",
    ])
    .await;
    assert_eq!(dry.code, 0, "{dry:?}");
    assert_eq!(
        transport.count(&queue).await.unwrap(),
        0,
        "a dry run replayed"
    );

    let replayed = retryctl_nats(&["parked", "replay", &queue, "--reason", "permanent"]).await;
    assert_eq!(replayed.code, 0, "{replayed:?}");
    assert_eq!(
        replayed.stdout.trim(),
        format!("replayed 2 to {queue}, left 1 in {parking}")
    );
    // The work stream holds the copies, the parking stream only what was not selected.
    assert_eq!(transport.count(&queue).await.unwrap(), 2);
    assert_eq!(transport.count(parking).await.unwrap(), 1);
    let left = json_lines(&retryctl_nats(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&left), ["raw-1"], "{left:?}");
    // The copies, read in the work stream (`--parking` names it), have their counters reset
    // and their history.
    let copies =
        json_lines(&retryctl_nats(&["parked", "list", "-", "--parking", &queue, "--json"]).await);
    assert_eq!(ids(&copies), ["p-1", "p-2"], "{copies:?}");
    for copy in &copies {
        assert_eq!(copy["reason"], "unknown", "{copy}");
        assert_eq!(copy["replays"], 1, "{copy}");
        assert_eq!(copy["previous_reason"], "permanent", "{copy}");
        assert_eq!(copy["attempts"], 0, "{copy}");
    }
    let copy = retryctl_nats(&[
        "parked",
        "show",
        "-",
        "--parking",
        &queue,
        "--id",
        "p-1",
        "--json",
    ])
    .await;
    assert_eq!(copy.code, 0, "{copy:?}");
    let copy: Value = serde_json::from_str(&copy.stdout).unwrap();
    assert_eq!(copy["body"]["text"], "body of p-1", "{copy:#}");
    assert_eq!(copy["headers"]["tenant"], "acme", "{copy:#}");

    // A replay to a work queue with no stream fails naming it; the message stays.
    let nowhere = format!("{queue}-nowhere");
    let elsewhere =
        retryctl_nats(&["parked", "replay", &nowhere, "--parking", parking, "--all"]).await;
    assert_eq!(elsewhere.code, 1, "{elsewhere:?}");
    assert_eq!(
        elsewhere.stderr.trim(),
        format!("retryctl: work queue \"{nowhere}\" does not exist: replays go to it")
    );
    assert_eq!(transport.count(parking).await.unwrap(), 1);
    transport.close().await;
}

#[tokio::test]
async fn parked_purge_by_id_deletes_that_message_only() {
    let Some((transport, queue, plan, _cleanup)) = parked_three("retryctl-nats-purge").await else {
        return;
    };
    let parking = plan.parking_queue();
    let unconfirmed = retryctl_nats(&["parked", "purge", &queue, "--id", "p-2"]).await;
    assert_eq!(unconfirmed.code, 2, "{unconfirmed:?}");
    assert_eq!(transport.count(parking).await.unwrap(), 3);

    let purged = retryctl_nats(&["parked", "purge", &queue, "--id", "p-2", "--yes"]).await;
    assert_eq!(purged.code, 0, "{purged:?}");
    assert_eq!(
        purged.stdout.trim(),
        format!("purged 1, left 2 in {parking}")
    );
    assert_eq!(transport.count(parking).await.unwrap(), 2);
    let rest = json_lines(&retryctl_nats(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&rest), ["p-1", "raw-1"], "{rest:?}");
    assert_eq!(transport.count(&queue).await.unwrap(), 0, "purge replayed");
    transport.close().await;
}

#[tokio::test]
async fn what_nats_cannot_do_and_unknown_schemes_exit_2() {
    let policy = PolicyFile::new(POLICY);
    // An unknown scheme: named, with the accepted ones.
    let run = retryctl_with_env(&["parked", "list", "comments"], "redis://u:s3cret@h:6379").await;
    assert_eq!(run.code, 2, "{run:?}");
    assert_eq!(
        run.stderr.trim(),
        "retryctl: URL scheme \"redis://\" in --url (or AMQP_URL): retryctl accepts amqp:// \
         (amqp091 or amqp10), amqps:// (amqp091 or amqp10), nats:// (nats), tls:// (nats), \
         memory:// (memory)"
    );
    assert!(!run.all().contains("s3cret"), "{run:?}");
    // A protocol that does not speak the scheme.
    for (protocol, url, scheme) in [
        ("amqp10", "nats://u:s3cret@127.0.0.1:4222", "nats"),
        ("nats", "amqp://guest:s3cret@127.0.0.1:5672/%2f", "amqp"),
    ] {
        let run = retryctl_with_env(&["--protocol", protocol, "parked", "list", "q"], url).await;
        assert_eq!(run.code, 2, "{run:?}");
        assert!(
            run.stderr.starts_with(&format!(
                "retryctl: --protocol {protocol} does not speak {scheme}:// URLs"
            )),
            "{run:?}"
        );
        assert!(!run.all().contains("s3cret"), "{run:?}");
    }
    // What has no meaning on NATS: refused before connecting (the server is unreachable).
    let nowhere = "nats://u:s3cret@127.0.0.1:1";
    for (args, why) in [
        (
            vec![
                "topology",
                "verify",
                "q",
                "--policy",
                policy.path(),
                "--max-probe-ttl",
                "2s",
            ],
            "retryctl: --max-probe-ttl does not apply on NATS JetStream: nothing is probed",
        ),
        (
            vec![
                "topology",
                "apply",
                "q",
                "--policy",
                policy.path(),
                "--quorum",
            ],
            "retryctl: --quorum does not apply on NATS JetStream: queue types are RabbitMQ's",
        ),
        (
            vec![
                "topology",
                "plan",
                "q",
                "--policy",
                policy.path(),
                "--classic",
            ],
            "retryctl: --classic does not apply on NATS JetStream",
        ),
        (
            vec![
                "topology",
                "apply",
                "q",
                "--policy",
                policy.path(),
                "--replication-factor",
                "7",
            ],
            "retryctl: --replication-factor 7: a NATS JetStream stream has 1 to 5 replicas",
        ),
        (
            vec!["topology", "apply", "orders.*", "--policy", policy.path()],
            "retryctl: no plan for queue \"orders.*\" on NATS JetStream: the queue name",
        ),
    ] {
        let run = retryctl_with_env(&args, nowhere).await;
        assert_eq!(run.code, 2, "{args:?}: {run:?}");
        assert!(run.stdout.is_empty(), "{run:?}");
        assert!(run.stderr.starts_with(why), "{args:?}: {run:?}");
        assert!(!run.all().contains("s3cret"), "{run:?}");
    }
    // A server that does not answer: exit 1, the URL's password masked.
    let run = retryctl_with_env(&["parked", "list", "q"], nowhere).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr
            .starts_with("retryctl: connecting to nats://u:****@127.0.0.1:1"),
        "{run:?}"
    );
    assert!(!run.all().contains("s3cret"), "{run:?}");
    // `topology plan` needs no server, and shows the streams with their subjects.
    let planned = retryctl_with_env(
        &[
            "topology",
            "plan",
            "comments",
            "--policy",
            policy.path(),
            "--replication-factor",
            "3",
        ],
        nowhere,
    )
    .await;
    assert_eq!(planned.code, 0, "{planned:?}");
    assert!(
        planned.stdout.starts_with(
            "plan for work queue `comments` on NATS JetStream (6 streams, 3 replicas each)\n"
        ),
        "{planned:?}"
    );
    assert!(
        planned.stdout.contains(
            "  comments_retry_500ms  (subject comments.retry.500ms; delay queue, 500ms; due \
             copies go to comments)\n"
        ),
        "{planned:?}"
    );
    let json = retryctl_with_env(
        &[
            "topology",
            "plan",
            "comments",
            "--policy",
            policy.path(),
            "--json",
        ],
        "tls://127.0.0.1:1",
    )
    .await;
    assert_eq!(json.code, 0, "{json:?}");
    let json: Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(json["protocol"], "nats");
    assert_eq!(json["streams"][5]["name"], "comments_parking", "{json:#}");
    assert_eq!(json["streams"][5]["retention"], "limits", "{json:#}");
    assert_eq!(json["streams"][5]["consumer"], Value::Null, "{json:#}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_groups_and_replays_parked_messages_on_nats() {
    let Some((transport, queue, plan, _cleanup)) = parked_three("retryctl-nats-console").await
    else {
        return;
    };
    let url = nats::url();
    let console = console::Console::start(&[&queue], &["--url", &url]);
    let q = console.index_after(&queue, 0);
    assert_eq!(q["parked"], 3, "{q}");
    assert_eq!(q["by_reason"]["permanent"], 2);
    assert_eq!(q["by_reason"]["unknown"], 1);
    let parking = q["depths"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["role"] == "parking")
        .unwrap()
        .clone();
    assert_eq!(parking["ready"], 3, "a parking stream is counted: {q}");
    let group = &q["groups"][0];
    assert_eq!(group["count"], 2, "{q}");
    assert_eq!(group["error"], "spam is never accepted: body of p-<n>");

    let body = format!(r#"{{"reason": "permanent", "group": {}}}"#, group["error"]);
    let job = console.act(&queue, "replay", &body);
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(job["report"]["replayed"], 2, "{job}");
    assert_eq!(transport.count(&queue).await.unwrap(), 2);
    assert_eq!(transport.count(plan.parking_queue()).await.unwrap(), 1);
}
