//! `retryctl --protocol amqp10` end to end: the built binary against the local broker's AMQP
//! 1.0 plugin, on queues of its own declared over AMQP 0-9-1 (as a deployment does: RabbitMQ
//! cannot declare them over AMQP 1.0); and the URL schemes no protocol speaks.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/console.rs"]
mod console;

use std::time::Duration;

use cli::{POLICY, PolicyFile, Run, ids, json_lines, plan, retryctl, retryctl_with_env, text};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, LongString};
use retry_core::{RetryPolicy, TopologyPlan, Transport};
use serde_json::Value;

/// Runs `retryctl --protocol amqp10 --url <AMQP 1.0 URL> args`.
async fn retryctl10(args: &[&str]) -> Run {
    let url = common::amqp10_url();
    let all = [&["--protocol", "amqp10", "--url", url.as_str()][..], args].concat();
    retryctl(&all).await
}

/// `url` as transport-amqp10 shows it, its password masked.
fn redacted10(url: &str) -> String {
    transport_amqp10::Amqp10Config::new(url).redacted_url()
}

/// An AMQP 1.0 `application-properties` section holding these strings and longs, encoded as
/// RabbitMQ 3.x stores it for a message published over AMQP 1.0: in the AMQP 0-9-1 header
/// `x-amqp-1.0-app-properties`, which it hands AMQP 1.0 readers back as the section.
fn app_properties(entries: &[(&str, Result<&str, i64>)]) -> AMQPValue {
    let str8 = |out: &mut Vec<u8>, s: &str| {
        out.extend([0xa1, u8::try_from(s.len()).unwrap()]);
        out.extend(s.as_bytes());
    };
    let mut elements = Vec::new();
    for (name, value) in entries {
        str8(&mut elements, name);
        match value {
            Ok(text) => str8(&mut elements, text),
            Err(n) => {
                elements.push(0x81);
                elements.extend(n.to_be_bytes());
            }
        }
    }
    // Described section 0x74, a map32: size (count and elements), count (keys and values).
    let mut section = vec![0x00, 0x53, 0x74, 0xd1];
    section.extend(u32::try_from(4 + elements.len()).unwrap().to_be_bytes());
    section.extend(u32::try_from(entries.len() * 2).unwrap().to_be_bytes());
    section.extend(elements);
    AMQPValue::LongString(LongString::from(section))
}

/// A work queue of its own, provisioned over AMQP 0-9-1, deleted with its plan when the
/// returned guard drops.
async fn work_queue(prefix: &str) -> Option<(String, TopologyPlan, common::Cleanup)> {
    let config = common::broker(prefix).await?;
    let queue = common::unique(prefix);
    let policy = RetryPolicy::delays([Duration::from_millis(200)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&queue, &policy).unwrap();
    let mut cleanup = common::Cleanup::new(common::amqp_url());
    cleanup.plan(&plan);
    let transport = common::transport(&config).await;
    transport.provision(&plan).await.unwrap();
    transport.close().await.unwrap();
    Some((queue, plan, cleanup))
}

#[tokio::test]
async fn parked_over_amqp10_lists_and_replays_what_an_amqp10_consumer_parked() {
    let Some((queue, plan, _cleanup)) = work_queue("retryctl-parked10").await else {
        return;
    };
    let parking = plan.parking_queue();
    // Parked through AMQP 0-9-1 as RabbitMQ stores what an AMQP 1.0 consumer parks: the
    // engine's record in the application properties.
    let (conn, ch) = common::raw().await;
    for (id, reason, error) in [
        ("p-perm", "permanent", "spam is never accepted"),
        ("p-exh", "attempts-exhausted", "db timeout"),
        ("p-perm2", "permanent", "also spam"),
    ] {
        let section = app_properties(&[
            ("x-retry-reason", Ok(reason)),
            ("x-retry-attempts", Err(2)),
            ("x-retry-last-error", Ok(error)),
            ("tenant", Ok("acme")),
        ]);
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2)
            .with_headers(common::table([("x-amqp-1.0-app-properties", section)]));
        common::publish_with(&ch, parking, id.as_bytes(), properties).await;
    }

    // list: every message, in queue order, with the engine's record.
    let listed = json_lines(&retryctl10(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&listed), ["p-perm", "p-exh", "p-perm2"]);
    assert_eq!(listed[0]["reason"], "permanent", "{listed:?}");
    assert_eq!(listed[0]["attempts"], 2, "{listed:?}");
    assert_eq!(listed[1]["last_error"], "db timeout", "{listed:?}");
    let permanent = json_lines(
        &retryctl10(&["parked", "list", &queue, "--reason", "permanent", "--json"]).await,
    );
    assert_eq!(ids(&permanent), ["p-perm", "p-perm2"]);
    let table = retryctl10(&["parked", "list", &queue]).await;
    assert_eq!(table.code, 0, "{table:?}");
    assert!(
        table
            .stdout
            .lines()
            .any(|l| l.starts_with("p-exh ") && l.ends_with("  db timeout")),
        "{table:?}"
    );
    assert_eq!(
        table.stdout.lines().last(),
        Some(format!("3 listed; 3 parked in {parking}").as_str()),
        "{table:?}"
    );
    // With a limit the walk stops early, and AMQP 1.0 gives no count.
    let limited = retryctl10(&["parked", "list", &queue, "--limit", "1"]).await;
    assert_eq!(limited.code, 0, "{limited:?}");
    assert_eq!(
        limited.stdout.lines().last(),
        Some(format!("1 listed; 1 read in {parking}, which may hold more").as_str()),
        "{limited:?}"
    );
    let shown = retryctl10(&["parked", "show", &queue, "--id", "p-exh", "--json"]).await;
    assert_eq!(shown.code, 0, "{shown:?}");
    let shown: Value = serde_json::from_str(&shown.stdout).unwrap();
    assert_eq!(shown["body"]["text"], "p-exh");
    assert_eq!(shown["headers"]["tenant"], "acme");

    // replay by reason: the copies reach the work queue with reset counters and their
    // history, read back here over AMQP 0-9-1 (`--parking` names the work queue).
    let replayed = retryctl10(&["parked", "replay", &queue, "--reason", "permanent"]).await;
    assert_eq!(replayed.code, 0, "{replayed:?}");
    assert_eq!(
        replayed.stdout.trim(),
        format!("replayed 2 to {queue}, left 1 in {parking}")
    );
    let copies = retryctl(&["parked", "list", "-", "--parking", &queue, "--json"]).await;
    let copies = json_lines(&copies);
    assert_eq!(ids(&copies), ["p-perm", "p-perm2"], "{copies:?}");
    let copy = retryctl(&[
        "parked",
        "show",
        "-",
        "--parking",
        &queue,
        "--id",
        "p-perm",
        "--json",
    ])
    .await;
    assert_eq!(copy.code, 0, "{copy:?}");
    let copy: Value = serde_json::from_str(&copy.stdout).unwrap();
    assert_eq!(copy["body"]["text"], "p-perm");
    assert_eq!(copy["headers"]["tenant"], "acme", "{copy:#}");
    assert_eq!(copy["record"]["replays"], 1, "{copy:#}");
    assert_eq!(copy["record"]["previous_reason"], "permanent", "{copy:#}");
    assert_eq!(copy["record"]["reason"], "unknown", "{copy:#}");

    // A replay to a work queue that does not exist fails naming it, and the message stays.
    let nowhere = format!("{queue}-nowhere");
    let elsewhere =
        retryctl10(&["parked", "replay", &nowhere, "--parking", parking, "--all"]).await;
    assert_eq!(elsewhere.code, 1, "{elsewhere:?}");
    assert_eq!(
        elsewhere.stderr.trim(),
        format!("retryctl: work queue \"{nowhere}\" does not exist: replays go to it"),
        "{elsewhere:?}"
    );
    let still = common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(100),
        || common::ready_and_unacked(parking),
        |c| *c == (1, 0),
    )
    .await;
    assert_eq!(still, (1, 0), "the failed replay took the message");

    // purge by id, confirmed.
    let purged = retryctl10(&["parked", "purge", &queue, "--id", "p-exh", "--yes"]).await;
    assert_eq!(purged.code, 0, "{purged:?}");
    assert_eq!(
        purged.stdout.trim(),
        format!("purged 1, left 0 in {parking}")
    );
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn parked_over_amqp10_purges_but_will_not_replay_what_an_amqp091_consumer_parked() {
    let Some((queue, plan, _cleanup)) = work_queue("retryctl-parked091").await else {
        return;
    };
    let parking = plan.parking_queue();
    // Parked as an AMQP 0-9-1 consumer parks: the record in AMQP 0-9-1 headers, which
    // RabbitMQ 3.x does not show AMQP 1.0 clients.
    let (conn, ch) = common::raw().await;
    for id in ["p-1", "p-2", "p-3"] {
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2)
            .with_headers(common::table([
                ("x-retry-reason", text("permanent")),
                ("tenant", text("acme")),
            ]));
        common::publish_with(&ch, parking, id.as_bytes(), properties).await;
    }

    // Listed in queue order, but without their record.
    let listed = json_lines(&retryctl10(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&listed), ["p-1", "p-2", "p-3"]);
    assert!(
        listed.iter().all(|l| l["reason"] == "unknown"),
        "{listed:?}"
    );

    // A replay would send copies without their headers: refused, nothing taken.
    for dry_run in [false, true] {
        let mut args = vec!["parked", "replay", &queue, "--id", "p-2"];
        args.extend(dry_run.then_some("--dry-run"));
        let refused = retryctl10(&args).await;
        assert_eq!(refused.code, 2, "{refused:?}");
        assert!(refused.stdout.is_empty(), "{refused:?}");
        assert!(
            refused.stderr.starts_with(&format!(
                "retryctl: nothing replayed: 1 of the selected messages in {parking} show no \
                 headers over AMQP 1.0"
            )),
            "{refused:?}"
        );
        assert!(
            refused
                .stderr
                .contains("replay over AMQP 0-9-1 (protocol amqp091)"),
            "{refused:?}"
        );
    }
    assert_eq!(
        common::message_count(&ch, &queue).await.unwrap(),
        0,
        "replayed"
    );

    // Purged by id like any other.
    let purged = retryctl10(&["parked", "purge", &queue, "--id", "p-2", "--yes"]).await;
    assert_eq!(purged.code, 0, "{purged:?}");
    assert_eq!(
        purged.stdout.trim(),
        format!("purged 1, left 2 in {parking}")
    );
    // Over AMQP 0-9-1 the rest still has its headers.
    let rest = json_lines(&retryctl(&["parked", "list", &queue, "--json"]).await);
    assert_eq!(ids(&rest), ["p-1", "p-3"]);
    assert!(rest.iter().all(|l| l["reason"] == "permanent"), "{rest:?}");

    // Missing queues fail as over AMQP 0-9-1, naming them; nothing is taken.
    let nowhere = format!("{queue}-nowhere");
    let unknown = retryctl10(&["parked", "list", &nowhere]).await;
    assert_eq!(unknown.code, 1, "{unknown:?}");
    assert!(unknown.stdout.is_empty(), "{unknown:?}");
    assert!(
        unknown.stderr.contains(&format!(
            "parking queue \"{nowhere}.parking\" does not exist"
        )),
        "{unknown:?}"
    );
    let purge_missing = retryctl10(&["parked", "purge", &nowhere, "--all", "--yes"]).await;
    assert_eq!(purge_missing.code, 1, "{purge_missing:?}");
    assert!(
        purge_missing.stderr.contains("does not exist"),
        "{purge_missing:?}"
    );
    let still = common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(100),
        || common::ready_and_unacked(parking),
        |c| *c == (2, 0),
    )
    .await;
    assert_eq!(still, (2, 0));
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn topology_apply_over_amqp10_is_refused_naming_amqp091() {
    let policy = PolicyFile::new(POLICY);
    let queue = common::unique("retryctl-apply10");
    // Nothing is created; should something be, it goes.
    let _cleanup = common::broker("retryctl apply amqp10")
        .await
        .map(|_| common::Cleanup::new(common::amqp_url()).with_plan(&plan(&queue)));
    let run = retryctl10(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    assert!(
        run.stderr.starts_with(
            "retryctl: creating queues over AMQP 1.0 is not supported here: RabbitMQ cannot \
             declare queues over AMQP 1.0"
        ),
        "{run:?}"
    );
    assert!(
        run.stderr
            .contains("apply the topology over AMQP 0-9-1 (protocol amqp091"),
        "{run:?}"
    );
}

#[tokio::test]
async fn topology_verify_over_amqp10_checks_every_object_and_names_a_missing_one() {
    if common::broker("retryctl verify amqp10").await.is_none() {
        return;
    }
    let queue = common::unique("retryctl-verify10");
    let plan = plan(&queue);
    let mut cleanup = common::Cleanup::new(common::amqp_url());
    cleanup.plan(&plan);
    let policy = PolicyFile::new(POLICY);
    let apply = retryctl(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(apply.code, 0, "{apply:?}");

    let verify = ["topology", "verify", &queue, "--policy", policy.path()];
    let passed = retryctl10(&verify).await;
    assert_eq!(passed.code, 0, "{passed:?}");
    let redacted = redacted10(&common::amqp10_url());
    assert_eq!(
        passed.stdout.lines().next(),
        Some(
            format!(
                "verifying work queue `{queue}` on {redacted} over AMQP 1.0: that every object \
                 exists (the probes through the delay queues need AMQP 0-9-1)"
            )
            .as_str()
        ),
        "{passed:?}"
    );
    let objects: Vec<String> = plan
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)))
        .collect();
    for object in &objects {
        let line = format!("  ok    {object}\n");
        assert!(passed.stdout.contains(&line), "no {line:?} in {passed:?}");
    }
    assert!(
        passed
            .stdout
            .ends_with(&format!("the broker matches the plan of `{queue}`\n")),
        "{passed:?}"
    );
    // Nothing was sent: no probe waits in a delay queue.
    let (conn, ch) = common::raw().await;
    for q in plan.queues() {
        assert_eq!(
            common::message_count(&ch, &q.name).await.unwrap(),
            0,
            "{}",
            q.name
        );
    }

    // One delay queue deleted: named, and exit 1.
    let slow = format!("{queue}.retry.500ms");
    ch.queue_delete(slow.as_str().into(), Default::default())
        .await
        .unwrap();
    let failed = retryctl10(&verify).await;
    let _ = conn.close(200, "done".into()).await;
    assert_eq!(failed.code, 1, "{failed:?}");
    assert!(
        failed
            .stdout
            .lines()
            .any(|l| l == format!("  FAIL  queue {slow}: missing")),
        "{failed:?}"
    );
    assert_eq!(failed.stdout.matches("  ok    ").count(), objects.len() - 1);
    assert_eq!(
        failed.stderr.trim(),
        format!(
            "retryctl: 1 of {} checks failed: the broker does not match the plan of `{queue}`",
            objects.len()
        )
    );

    // An unknown work queue fails before any line, as over AMQP 0-9-1.
    let unknown = common::unique("retryctl-unknown10");
    let run = retryctl10(&["topology", "verify", &unknown, "--policy", policy.path()]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    assert!(
        run.stderr.starts_with(&format!(
            "retryctl: there is no queue `{unknown}` on {redacted}:"
        )),
        "{run:?}"
    );
}

#[tokio::test]
async fn a_url_scheme_no_protocol_speaks_exits_2_naming_it() {
    let policy = PolicyFile::new(POLICY);
    for (url, args, scheme) in [
        (
            "redis://127.0.0.1:6379",
            vec!["parked", "list", "comments"],
            "redis://",
        ),
        (
            "http://guest:s3cret@127.0.0.1:15672",
            vec!["topology", "verify", "comments", "--policy", policy.path()],
            "http://",
        ),
        (
            "amqp://guest:s3cret@127.0.0.1:5672,http://127.0.0.1:15672",
            vec!["topology", "apply", "comments", "--policy", policy.path()],
            "http://",
        ),
    ] {
        for protocol in [None, Some("amqp10")] {
            let mut all: Vec<&str> = protocol.map_or(vec![], |p| vec!["--protocol", p]);
            all.extend(&args);
            let run = retryctl_with_env(&all, url).await;
            assert_eq!(run.code, 2, "{url} {all:?}: {run:?}");
            assert!(run.stdout.is_empty(), "{run:?}");
            assert_eq!(
                run.stderr.trim(),
                format!(
                    "retryctl: URL scheme \"{scheme}\" in --url (or AMQP_URL): retryctl accepts \
                     amqp:// (amqp091 or amqp10), amqps:// (amqp091 or amqp10), nats:// \
                     (nats), tls:// (nats), memory:// (memory)"
                ),
                "{run:?}"
            );
            assert!(!run.all().contains("s3cret"), "{run:?}");
        }
    }
    // An unknown --protocol: named, with the registered ones.
    let run = retryctl(&["--protocol", "stomp", "parked", "list", "comments"]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("amqp091, amqp10, nats"), "{run:?}");
}

#[tokio::test]
async fn the_password_is_never_printed_over_amqp10() {
    let url = common::amqp10_url();
    let secret = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map(|(userinfo, _)| userinfo.to_owned())
        .filter(|userinfo| userinfo.contains(':'))
        .expect("the test broker's AMQP 1.0 URL has a password");
    // A broker that does not answer, on the command line and in the environment.
    let unreachable = url.replace("127.0.0.1:5672", "127.0.0.1:1");
    let redacted = redacted10(&unreachable);
    let args = ["--protocol", "amqp10", "parked", "list", "comments"];
    for run in [
        retryctl(&[&["--url", unreachable.as_str()][..], &args[..]].concat()).await,
        retryctl_with_env(&args, &unreachable).await,
    ] {
        assert_eq!(run.code, 1, "{run:?}");
        assert!(!run.all().contains(&secret), "password shown: {run:?}");
        assert!(run.stderr.contains(&redacted), "{run:?}");
    }
    let help = retryctl_with_env(&["--protocol", "amqp10", "--help"], &url).await;
    assert_eq!(help.code, 0, "{help:?}");
    assert!(!help.all().contains(&secret), "password shown: {help:?}");
    assert!(help.stdout.contains("--protocol"), "{help:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_console_groups_and_replays_parked_messages_over_amqp10() {
    let Some((queue, plan, _cleanup)) = work_queue("retryctl-console10").await else {
        return;
    };
    let parking = plan.parking_queue();
    let (conn, ch) = common::raw().await;
    for (id, reason, error) in [
        ("c-1", "permanent", "order 1 not found"),
        ("c-2", "attempts-exhausted", "db timeout"),
        ("c-3", "permanent", "order 30 not found"),
    ] {
        let section = app_properties(&[
            ("x-retry-reason", Ok(reason)),
            ("x-retry-last-error", Ok(error)),
        ]);
        let properties = BasicProperties::default()
            .with_message_id(id.into())
            .with_delivery_mode(2)
            .with_headers(common::table([("x-amqp-1.0-app-properties", section)]));
        common::publish_with(&ch, parking, id.as_bytes(), properties).await;
    }
    let url = common::amqp10_url();
    let console = console::Console::start(&[&queue], &["--protocol", "amqp10", "--url", &url]);
    let q = console.index_after(&queue, 0);
    assert_eq!(q["parked"], 3, "{q}");
    assert_eq!(q["by_reason"]["permanent"], 2, "{q}");
    // AMQP 1.0 gives no count of a queue.
    assert_eq!(q["depths"][0]["ready"], Value::Null, "{q}");
    assert_eq!(q["groups"][0]["error"], "order <n> not found", "{q}");

    let job = console.act(
        &queue,
        "replay",
        r#"{"reason": "permanent", "group": "order <n> not found"}"#,
    );
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(
        job["summary"],
        format!("replayed 2 to {queue}, left 1 in {parking}")
    );
    assert_eq!(console::held(&queue).await, 2);
    assert_eq!(console::held(parking).await, 1);
    let _ = conn.close(200, "done".into()).await;
}
