//! `retryctl parked` end to end: the built binary against the local broker, on a work queue
//! of its own whose parking queue holds four messages parked for different reasons, one
//! without the engine's headers and one with a malformed counter.

#[path = "common/cli.rs"]
mod cli;
mod common;

use std::time::Duration;

use cli::{ids, json_lines, retryctl, text};
use lapin::types::AMQPValue;
use lapin::{BasicProperties, Channel};
use retry_core::{HeaderValue, RetryPolicy, TopologyPlan, Transport};
use serde_json::Value;

const T0: i64 = 1_796_117_400_000;

/// Publishes a message straight into `queue`, with these headers, and waits for the confirm.
async fn park(ch: &Channel, queue: &str, id: &str, body: &[u8], headers: Vec<(&str, AMQPValue)>) {
    let properties = BasicProperties::default()
        .with_message_id(id.into())
        .with_content_type("text/plain".into())
        .with_delivery_mode(2)
        .with_headers(common::table(headers));
    common::publish_with(ch, queue, body, properties).await;
}

#[tokio::test]
async fn list_show_replay_and_purge_parked_messages() {
    let Some(config) = common::broker("retryctl parked").await else {
        return;
    };
    let queue = common::unique("retryctl-parked");
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&queue, &policy).unwrap();
    let mut cleanup = common::Cleanup::new(common::amqp_url());
    cleanup.plan(&plan);
    let transport = common::transport(&config).await;
    transport.provision(&plan).await.unwrap();
    let (conn, ch) = common::raw().await;
    let parking = plan.parking_queue();
    park(
        &ch,
        parking,
        "p-perm",
        b"spam",
        vec![
            ("x-retry-reason", text("permanent")),
            ("x-retry-attempts", AMQPValue::LongLongInt(1)),
            ("x-retry-crashes", AMQPValue::LongLongInt(0)),
            ("x-retry-last-failure", AMQPValue::LongLongInt(T0)),
            (
                "x-retry-last-error",
                text("spam is never accepted\nat line 2"),
            ),
            ("x-retry-origin-queue", text(&queue)),
            ("tenant", text("acme")),
        ],
    )
    .await;
    park(
        &ch,
        parking,
        "p-exh",
        b"flaky",
        vec![
            ("x-retry-reason", text("attempts-exhausted")),
            ("x-retry-attempts", AMQPValue::LongLongInt(4)),
            ("x-retry-last-failure", AMQPValue::LongLongInt(T0 + 1000)),
            ("x-retry-last-error", text("db timeout")),
        ],
    )
    .await;
    // Parked by something else: no engine header at all, and a body that is not text.
    park(&ch, parking, "p-stray", &[0xff, 0x00, 0x01], vec![]).await;
    park(
        &ch,
        parking,
        "p-bad",
        b"bad",
        vec![
            ("x-retry-reason", text("crash-loop")),
            ("x-retry-attempts", text("many")),
            ("x-retry-crashes", AMQPValue::LongLongInt(3)),
        ],
    )
    .await;
    let all = ["p-perm", "p-exh", "p-stray", "p-bad"];

    // list --json: every message, in queue order, with every diagnostic field.
    let listed = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&listed), all);
    let by_id = |id: &str| listed.iter().find(|l| l["id"] == id).unwrap().clone();
    let perm = by_id("p-perm");
    assert_eq!(perm["reason"], "permanent");
    assert_eq!(perm["attempts"], 1);
    assert_eq!(perm["crashes"], 0);
    assert_eq!(perm["parked_at"], "2026-12-01T09:30:00.000Z");
    assert_eq!(perm["last_error"], "spam is never accepted\nat line 2");
    assert_eq!(perm["origin_queue"], queue.as_str());
    assert_eq!(perm["malformed"], Value::Array(vec![]));
    let stray = by_id("p-stray");
    assert_eq!(stray["reason"], "unknown");
    assert_eq!(stray["attempts"], Value::Null);
    assert_eq!(stray["parked_at"], Value::Null);
    let bad = by_id("p-bad");
    assert_eq!(bad["reason"], "crash-loop");
    assert_eq!(bad["attempts"], "malformed");
    assert_eq!(bad["crashes"], 3);
    assert_eq!(bad["malformed"][0], "x-retry-attempts");
    assert_eq!(by_id("p-exh")["reason"], "attempts-exhausted");

    // list: a line each, the last error cut to one line; unknown and malformed said so.
    let table = retryctl(&["parked", "list", &queue]).await;
    assert_eq!(table.code, 0, "{table:?}");
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{table:?}");
    assert!(lines[0].starts_with("ID "), "{table:?}");
    let line = |id: &str| *lines.iter().find(|l| l.starts_with(id)).unwrap();
    assert!(line("p-perm").contains(" permanent "), "{table:?}");
    assert!(
        line("p-perm").ends_with("spam is never accepted…"),
        "{table:?}"
    );
    assert!(line("p-stray").contains(" unknown "), "{table:?}");
    assert!(line("p-bad").contains(" malformed "), "{table:?}");
    assert!(
        line("p-exh").contains("2026-12-01T09:30:01.000Z"),
        "{table:?}"
    );
    assert_eq!(
        lines[5],
        format!("4 listed; 4 parked in {parking}"),
        "{table:?}"
    );

    // Filters and a limit.
    let permanent =
        json_lines(&retryctl(&["parked", "list", &queue, "--reason", "permanent", "--json"]).await);
    assert_eq!(ids(&permanent), ["p-perm"]);
    let unknown =
        json_lines(&retryctl(&["parked", "list", &queue, "--reason", "unknown", "--json"]).await);
    assert_eq!(ids(&unknown), ["p-stray"]);
    let first_two =
        json_lines(&retryctl(&["parked", "list", &queue, "--limit", "2", "--json"]).await);
    assert_eq!(ids(&first_two), ["p-perm", "p-exh"]);

    // show: headers, properties, and the body as text or hex.
    let shown = retryctl(&["parked", "show", &queue, "--id", "p-stray", "--json"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    let shown: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(shown["body"]["hex"], "ff0001");
    assert_eq!(shown["properties"]["content_type"], "text/plain");
    assert_eq!(shown["record"]["reason"], "unknown");
    let shown = retryctl(&["parked", "show", &queue, "--id", "p-perm"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    assert!(shown.stdout.contains("  tenant "), "{shown:?}");
    assert!(
        shown.stdout.contains("body (4 bytes, UTF-8)\n  spam"),
        "{shown:?}"
    );
    let missing = retryctl(&["parked", "show", &queue, "--id", "p-none"]).await;
    assert_eq!(missing.code, 1, "{missing:?}");
    assert!(missing.stderr.contains("\"p-none\""), "{missing:?}");

    // purge without --yes: a usage error, and nothing removed.
    let refused = retryctl(&["parked", "purge", &queue, "--all"]).await;
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("--yes"), "{refused:?}");
    let still = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&still), all, "the refused purge removed messages");

    // replay by reason: the copy in the work queue has reset counters and its history.
    let replayed = retryctl(&["parked", "replay", &queue, "--reason", "permanent"]).await;
    assert_eq!(replayed.code, 0, "{replayed:?}");
    assert_eq!(
        replayed.stdout.trim(),
        format!("replayed 1 to {queue}, left 3 in {parking}")
    );
    let copy = common::wait_get(&ch, &queue, Duration::from_secs(5))
        .await
        .expect("the copy in the work queue");
    assert_eq!(copy.message_id.as_deref(), Some("p-perm"));
    assert_eq!(copy.body, b"spam");
    let h = &copy.headers;
    assert_eq!(h.get("tenant"), Some(&HeaderValue::from("acme")));
    assert_eq!(h.get("x-retry-replays"), Some(&HeaderValue::Int(1)));
    assert_eq!(
        h.get("x-retry-previous-reason"),
        Some(&HeaderValue::from("permanent"))
    );
    assert_eq!(
        h.get("x-retry-previous-error"),
        Some(&HeaderValue::from("spam is never accepted\nat line 2"))
    );
    for reset in [
        "x-retry-reason",
        "x-retry-last-failure",
        "x-retry-last-error",
    ] {
        assert_eq!(h.get(reset), None, "{reset} kept: {h:?}");
    }
    assert_eq!(
        h.get("x-retry-attempts")
            .and_then(HeaderValue::as_u64)
            .unwrap_or(0),
        0
    );
    let rest = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&rest), ["p-exh", "p-stray", "p-bad"]);
    assert_eq!(
        rest,
        listed[1..],
        "the messages not replayed changed while parked"
    );

    // purge by id.
    let purged = retryctl(&["parked", "purge", &queue, "--id", "p-exh", "--yes"]).await;
    assert_eq!(purged.code, 0, "{purged:?}");
    assert_eq!(
        purged.stdout.trim(),
        format!("purged 1, left 2 in {parking}")
    );
    let rest = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&rest), ["p-stray", "p-bad"]);

    // Bad input: a usage error (2), or a failure naming the queue (1).
    for args in [
        vec!["parked", "list", &queue, "--reason", "crashed"],
        vec!["parked", "replay", &queue, "--all", "--rate", "0"],
        vec!["parked", "replay", &queue],
        vec!["parked", "replay", &queue, "--all", "--reason", "permanent"],
    ] {
        let run = retryctl(&args).await;
        assert_eq!(run.code, 2, "{args:?}: {run:?}");
        assert!(run.stdout.is_empty(), "{args:?}: {run:?}");
    }
    let nowhere = format!("{queue}-nowhere");
    let unknown = retryctl(&["parked", "list", &nowhere]).await;
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(
        unknown.stderr.contains(&format!(
            "parking queue \"{nowhere}.parking\" does not exist"
        )),
        "{unknown:?}"
    );

    let left = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(
        ids(&left),
        ["p-stray", "p-bad"],
        "bad input changed the queue"
    );
    let _ = conn.close(200, "done".into()).await;
    transport.close().await.unwrap();
}
