//! `retryctl topology` end to end: the built binary, run as an operator would, against the
//! local broker. Every test uses queue names of its own and deletes what it created.

#[path = "common/cli.rs"]
mod cli;
mod common;

use std::time::Duration;

use cli::{POLICY, PolicyFile, Run, plan, retryctl, retryctl_with_env};
use lapin::types::{AMQPValue, FieldTable};
use retry_core::{RetryPolicy, TopologyPlan};
use transport_amqp091::AmqpConfig;

/// Deletes `plan`'s queues and exchanges.
async fn teardown(config: &AmqpConfig, plan: &TopologyPlan) {
    let transport = common::transport(config).await;
    transport.teardown(plan).await.unwrap();
    transport.close().await.unwrap();
}

#[tokio::test]
async fn plan_prints_every_queue_with_its_arguments_and_as_json() {
    let policy = PolicyFile::new(POLICY);
    let expected = plan("comments");

    let text = retryctl(&["topology", "plan", "comments", "--policy", policy.path()]).await;
    assert_eq!(text.code, 0, "{text:?}");
    // Each queue on a line of its own, with its arguments below it.
    for q in expected.queues() {
        let header = format!("  {}  (", q.name);
        assert!(
            text.stdout.lines().any(|l| l.starts_with(&header)),
            "{} missing: {text:?}",
            q.name
        );
    }
    for e in expected.exchanges() {
        assert!(
            text.stdout.contains(&e.name),
            "{} missing: {text:?}",
            e.name
        );
    }
    assert!(text.stdout.contains("x-message-ttl"), "{text:?}");
    assert!(
        text.stdout
            .contains("comments.retry -> comments.crash.300ms  (routing key comments.crash.300ms)"),
        "{text:?}"
    );

    let json = retryctl(&[
        "topology",
        "plan",
        "comments",
        "--policy",
        policy.path(),
        "--json",
    ])
    .await;
    assert_eq!(json.code, 0, "{json:?}");
    let parsed: serde_json::Value = serde_json::from_str(&json.stdout).expect("JSON");
    let names: Vec<&str> = parsed["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["name"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = expected.queues().iter().map(|q| q.name.as_str()).collect();
    assert_eq!(names, want);
    let crash = &parsed["queues"][4];
    assert_eq!(crash["role"], "crash-delay");
    assert_eq!(crash["arguments"]["x-message-ttl"], 300);
    assert_eq!(
        crash["arguments"]["x-dead-letter-routing-key"],
        "comments.suspect"
    );
    assert_eq!(crash["dead_letters_to"][0], "comments.suspect");
    assert_eq!(parsed["bindings"].as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn a_url_with_several_nodes_plans_quorum_queues_unless_classic_is_asked_for() {
    let policy = PolicyFile::new(POLICY);
    let cluster = "amqp://guest:guest@10.0.0.1:5672/%2f,amqp://guest:guest@10.0.0.2:5672/%2f";
    let queue_types = |run: &Run| -> Vec<(String, serde_json::Value, serde_json::Value)> {
        assert_eq!(run.code, 0, "{run:?}");
        let parsed: serde_json::Value = serde_json::from_str(&run.stdout).expect("JSON");
        parsed["queues"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| {
                (
                    q["name"].as_str().unwrap().to_owned(),
                    q["arguments"]["x-queue-type"].clone(),
                    q["arguments"]["x-quorum-initial-group-size"].clone(),
                )
            })
            .collect()
    };
    let args = [
        "topology",
        "plan",
        "comments",
        "--policy",
        policy.path(),
        "--json",
    ];
    let on_cluster = retryctl_with_env(&args, cluster).await;
    for (name, kind, group) in queue_types(&on_cluster) {
        assert_eq!(kind, "quorum", "{name}");
        assert_eq!(group, serde_json::Value::Null, "{name}");
    }
    let replicated = retryctl_with_env(
        &[&args[..], &["--replication-factor", "3"]].concat(),
        cluster,
    )
    .await;
    for (name, kind, group) in queue_types(&replicated) {
        assert_eq!((kind, group), ("quorum".into(), 3.into()), "{name}");
    }
    let classic = retryctl_with_env(&[&args[..], &["--classic"]].concat(), cluster).await;
    for (name, kind, _) in queue_types(&classic) {
        assert_eq!(kind, "classic", "{name}");
    }
    // One node: classic, as before.
    for (name, kind, _) in queue_types(&retryctl(&args).await) {
        assert_eq!(kind, "classic", "{name}");
    }
    let both = retryctl_with_env(
        &[&args[..], &["--classic", "--replication-factor", "3"]].concat(),
        cluster,
    )
    .await;
    assert_eq!(both.code, 2, "{both:?}");
}

#[tokio::test]
async fn a_policy_file_with_an_unknown_key_exits_2_naming_the_key_and_its_line() {
    let policy = PolicyFile::new(&POLICY.replace("crash_delay", "crash_dleay"));
    let run = retryctl(&["topology", "plan", "comments", "--policy", policy.path()]).await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stdout.is_empty(), "{run:?}");
    assert!(run.stderr.starts_with("retryctl: "), "{run:?}");
    assert!(run.stderr.contains("crash_dleay"), "{run:?}");
    assert!(run.stderr.contains("line 2"), "{run:?}");

    // A file that is not there is the user's input too.
    let run = retryctl(&[
        "topology",
        "plan",
        "comments",
        "--policy",
        "/nonexistent.toml",
    ])
    .await;
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("/nonexistent.toml"), "{run:?}");
}

#[tokio::test]
async fn apply_creates_the_plan_then_verifies_it() {
    let Some(config) = common::broker("retryctl apply").await else {
        return;
    };
    let queue = common::unique("retryctl-apply");
    let policy = PolicyFile::new(POLICY);
    let apply = ["topology", "apply", &queue, "--policy", policy.path()];
    let first = retryctl(&apply).await;
    let second = retryctl(&apply).await;
    let plan = plan(&queue);
    teardown(&config, &plan).await;

    assert_eq!(first.code, 0, "{first:?}");
    assert_eq!(second.code, 0, "{second:?}");
    let objects = plan
        .exchanges()
        .iter()
        .map(|e| format!("exchange {}", e.name))
        .chain(plan.queues().iter().map(|q| format!("queue {}", q.name)));
    for object in objects {
        assert!(
            first
                .stdout
                .lines()
                .any(|l| l.trim() == format!("created   {object}")),
            "{object} not created: {first:?}"
        );
        assert!(
            second
                .stdout
                .lines()
                .any(|l| l.trim() == format!("verified  {object}")),
            "{object} not verified: {second:?}"
        );
    }
    assert!(first.stdout.contains("8 created, 0 verified"), "{first:?}");
    assert!(
        second.stdout.contains("0 created, 8 verified"),
        "{second:?}"
    );
}

#[tokio::test]
async fn verify_passes_on_a_freshly_applied_plan() {
    let Some(config) = common::broker("retryctl verify ok").await else {
        return;
    };
    let queue = common::unique("retryctl-verify");
    let policy = PolicyFile::new(POLICY);
    let apply = retryctl(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    let verify = retryctl(&["topology", "verify", &queue, "--policy", policy.path()]).await;
    let (conn, ch) = common::raw().await;
    let left = [
        common::message_count(&ch, &queue).await.unwrap(),
        common::message_count(&ch, &format!("{queue}.suspect"))
            .await
            .unwrap(),
    ];
    let _ = conn.close(200, "done".into()).await;
    let plan = plan(&queue);
    teardown(&config, &plan).await;

    assert_eq!(apply.code, 0, "{apply:?}");
    assert_eq!(verify.code, 0, "{verify:?}");
    for (_, route, destination) in plan.delayed_destinations() {
        let line = format!(
            "ok    queue {}: a probe came back to `{destination}` after",
            route.routing_key
        );
        assert!(verify.stdout.contains(&line), "no {line:?} in {verify:?}");
    }
    assert_eq!(
        verify.stdout.matches("ok    ").count(),
        plan.exchanges().len() + plan.queues().len(),
        "{verify:?}"
    );
    assert_eq!(left, [0, 0], "probes were left behind: {verify:?}");
}

#[tokio::test]
async fn verify_names_the_delay_queues_that_dead_letter_elsewhere() {
    let Some(config) = common::broker("retryctl verify broken").await else {
        return;
    };
    let queue = common::unique("retryctl-broken");
    let policy = PolicyFile::new(POLICY);
    let plan = plan(&queue);
    let apply = retryctl(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(apply.code, 0, "{apply:?}");
    // The 500ms delay queue, with the right TTL, dead-letters to a queue that does not exist;
    // the crash-delay queue to the work queue instead of the isolation queue.
    let (conn, ch) = common::raw().await;
    let dead_letter_to = |key: String| {
        move |mut args: FieldTable| {
            args.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(key.as_str().into()),
            );
            args
        }
    };
    let slow = format!("{queue}.retry.500ms");
    let crash = format!("{queue}.crash.300ms");
    let nowhere = dead_letter_to(format!("{queue}.nowhere"));
    test_brokers::rabbitmq::redeclare(&ch, &plan, &slow, nowhere)
        .await
        .unwrap();
    test_brokers::rabbitmq::redeclare(&ch, &plan, &crash, dead_letter_to(queue.clone()))
        .await
        .unwrap();

    let verify = retryctl(&["topology", "verify", &queue, "--policy", policy.path()]).await;
    let left = [
        common::message_count(&ch, &queue).await.unwrap(),
        common::message_count(&ch, &format!("{queue}.suspect"))
            .await
            .unwrap(),
    ];
    let _ = conn.close(200, "done".into()).await;
    teardown(&config, &plan).await;

    assert_eq!(verify.code, 1, "{verify:?}");
    let line = |prefix: &str| {
        verify
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?} in {verify:?}"))
            .to_owned()
    };
    let check = "check its x-dead-letter-exchange/x-dead-letter-routing-key";
    assert_eq!(
        line(&format!("FAIL  queue {slow}:")).trim(),
        format!("FAIL  queue {slow}: probe did not come back to `{queue}` within 5.5s: {check}")
    );
    assert_eq!(
        line(&format!("FAIL  queue {crash}:")).trim(),
        format!(
            "FAIL  queue {crash}: probe came back to `{queue}` instead of `{queue}.suspect`: {check}"
        )
    );
    assert!(
        line(&format!("ok    queue {queue}.retry.200ms:")).contains("came back"),
        "{verify:?}"
    );
    assert_eq!(verify.stdout.matches("FAIL").count(), 2, "{verify:?}");
    assert!(
        verify.stderr.starts_with("retryctl: 2 of 8 checks failed"),
        "{verify:?}"
    );
    assert_eq!(left, [0, 0], "probes were left behind: {verify:?}");
}

#[tokio::test]
async fn verify_takes_no_work_from_a_queue_with_messages_ready() {
    let Some(config) = common::broker("retryctl verify busy").await else {
        return;
    };
    let queue = common::unique("retryctl-busy");
    let policy = PolicyFile::new(POLICY);
    let apply = retryctl(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(apply.code, 0, "{apply:?}");
    let (conn, ch) = common::raw().await;
    common::publish(&ch, &queue, b"work", "work-1").await;

    let verify = retryctl(&["topology", "verify", &queue, "--policy", policy.path()]).await;
    let ready = common::ready_and_unacked_settled(&queue).await;
    let work = common::get(&ch, &queue).await;
    let _ = conn.close(200, "done".into()).await;
    let plan = plan(&queue);
    teardown(&config, &plan).await;

    assert_eq!(verify.code, 1, "{verify:?}");
    for delay in ["200ms", "500ms"] {
        let line = format!(
            "FAIL  queue {queue}.retry.{delay}: not probed: `{queue}` has 1 message(s) ready"
        );
        assert!(verify.stdout.contains(&line), "no {line:?} in {verify:?}");
    }
    // The isolation queue is empty: the crash-delay queue is still probed.
    assert!(
        verify.stdout.contains(&format!(
            "ok    queue {queue}.crash.300ms: a probe came back"
        )),
        "{verify:?}"
    );
    assert_eq!(ready, (1, 0), "{verify:?}");
    let work = work.expect("the work is still there");
    assert_eq!(work.message_id.as_deref(), Some("work-1"));
    assert!(work.headers.get("x-retry-probe").is_none());
}

#[tokio::test]
async fn verify_puts_back_work_that_comes_ahead_of_its_probes() {
    let Some(config) = common::broker("retryctl verify puts back").await else {
        return;
    };
    // Probes that wait 2 s: time enough to put work ahead of them.
    let queue = common::unique("retryctl-ahead");
    let policy =
        PolicyFile::new("crash_delay = \"2s\"\n\n[backoff]\nkind = \"list\"\ndelays = [\"2s\"]\n");
    let apply = retryctl(&["topology", "apply", &queue, "--policy", policy.path()]).await;
    assert_eq!(apply.code, 0, "{apply:?}");
    let args: Vec<String> = ["topology", "verify", &queue, "--policy", policy.path()]
        .map(str::to_owned)
        .into();
    let verify = tokio::spawn(async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        retryctl(&args).await
    });
    // Once both probes wait in their delay queues, work reaches the queues they come back to.
    let (conn, ch) = common::raw().await;
    let (delay, crash) = (format!("{queue}.retry.2s"), format!("{queue}.crash.2s"));
    let suspects = format!("{queue}.suspect");
    let waiting = common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            common::message_count(&ch, &delay).await.unwrap()
                + common::message_count(&ch, &crash).await.unwrap()
        },
        |n| *n == 2,
    )
    .await;
    common::publish(&ch, &queue, b"work", "work-1").await;
    common::publish(&ch, &suspects, b"suspect", "suspect-1").await;
    let verify = verify.await.unwrap();
    // The probes expire behind the work.
    let back = common::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        || async {
            common::message_count(&ch, &queue).await.unwrap()
                + common::message_count(&ch, &suspects).await.unwrap()
        },
        |n| *n == 4,
    )
    .await;
    // What each queue holds now, in order, with the redelivered flag.
    let mut held = Vec::new();
    for q in [&queue, &suspects] {
        while let Some(m) = ch
            .basic_get(
                q.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        {
            let d = m.delivery;
            let id = d.properties.message_id().as_ref().map(|s| s.to_string());
            let probe = d
                .properties
                .headers()
                .as_ref()
                .is_some_and(|h| h.inner().contains_key("x-retry-probe"));
            held.push((q.clone(), id.filter(|_| !probe), d.redelivered));
        }
    }
    let _ = conn.close(200, "done".into()).await;
    let policy = RetryPolicy::delays([Duration::from_secs(2)])
        .with_crash_delay(Duration::from_secs(2))
        .build()
        .unwrap();
    teardown(&config, &TopologyPlan::new(&queue, &policy).unwrap()).await;

    assert_eq!(waiting, 2, "the probes were not sent: {verify:?}");
    assert_eq!(back, 4, "{verify:?}");
    assert_eq!(verify.code, 1, "{verify:?}");
    for (object, destination) in [(&delay, &queue), (&crash, &suspects)] {
        let line = format!(
            "FAIL  queue {object}: a probe could not be read back: a message that is not a probe \
             came to the head of `{destination}` first (it was put back at once"
        );
        assert!(verify.stdout.contains(&line), "no {line:?} in {verify:?}");
    }
    // The work is back at the head of its queue, redelivered as a requeue makes it. The
    // suspect was moved back without the flag, which would count a crash; the probes follow.
    assert_eq!(
        held,
        [
            (queue.clone(), Some("work-1".to_owned()), true),
            (queue.clone(), None, false),
            (suspects.clone(), Some("suspect-1".to_owned()), false),
            (suspects.clone(), None, false),
        ],
        "{verify:?}"
    );
}

#[tokio::test]
async fn verify_of_an_unknown_queue_fails_naming_it() {
    if common::broker("retryctl verify unknown").await.is_none() {
        return;
    }
    let queue = common::unique("retryctl-unknown");
    let policy = PolicyFile::new(POLICY);
    let run = retryctl(&["topology", "verify", &queue, "--policy", policy.path()]).await;
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr
            .starts_with(&format!("retryctl: there is no queue `{queue}` on ")),
        "{run:?}"
    );
    // Nothing was created.
    let (conn, ch) = common::raw().await;
    let answer = ch
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = conn.close(200, "done".into()).await;
    assert!(answer.is_err(), "{queue} exists");
}

#[tokio::test]
async fn the_password_of_the_url_is_never_printed() {
    let url = common::amqp_url();
    let redacted = AmqpConfig::new(url.as_str()).redacted_url();
    let secret = url
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map(|(userinfo, _)| userinfo.to_owned())
        .filter(|userinfo| userinfo.contains(':'))
        .expect("the test broker's URL has a password");
    let shown = |run: &Run| {
        let all = run.all();
        assert!(!all.contains(&secret), "password shown: {run:?}");
        all
    };

    // Help, with the URL in the environment and on the command line.
    for args in [
        vec!["--help"],
        vec!["topology", "verify", "--help"],
        vec!["--url", url.as_str(), "--help"],
        vec!["--url", url.as_str(), "topology", "apply", "--help"],
    ] {
        let run = retryctl_with_env(&args, &url).await;
        assert_eq!(run.code, 0, "{run:?}");
        assert!(shown(&run).contains("AMQP_URL"), "{run:?}");
    }
    // A broker that does not answer: the error names the redacted URL.
    let unreachable = url.replace("127.0.0.1:5672", "127.0.0.1:1");
    let policy = PolicyFile::new(POLICY);
    let run = retryctl(&[
        "--url",
        &unreachable,
        "topology",
        "apply",
        "nowhere",
        "--policy",
        policy.path(),
    ])
    .await;
    assert_eq!(run.code, 1, "{run:?}");
    let want = AmqpConfig::new(unreachable.as_str()).redacted_url();
    assert!(shown(&run).contains(&want), "{run:?}");

    let Some(config) = common::broker("retryctl password").await else {
        return;
    };
    let queue = common::unique("retryctl-url");
    let apply = [
        "--url",
        url.as_str(),
        "topology",
        "apply",
        &queue,
        "--policy",
        policy.path(),
    ];
    let applied = retryctl(&apply).await;
    let verify = [
        "--url",
        url.as_str(),
        "topology",
        "verify",
        &queue,
        "--policy",
        policy.path(),
    ];
    let verified = retryctl(&verify).await;
    teardown(&config, &plan(&queue)).await;
    assert_eq!(applied.code, 0, "{applied:?}");
    assert_eq!(verified.code, 0, "{verified:?}");
    assert!(shown(&applied).contains(&redacted), "{applied:?}");
    assert!(shown(&verified).contains(&redacted), "{verified:?}");
}

#[tokio::test]
async fn apply_over_tls_with_the_tls_options_and_refusals_that_name_the_check() {
    let Some(node) = test_brokers::rabbitmq::tls_node("retryctl over TLS") else {
        return;
    };
    let queue = common::unique("retryctl-tls");
    let policy = PolicyFile::new(POLICY);
    let ca = node.cert("ca.pem");
    let ca = ca.to_str().unwrap();
    // The node's certificate names `localhost`, not 127.0.0.1.
    let url = format!("amqps://guest:guest@127.0.0.1:{}/%2f", node.tls_port);
    let apply = |extra: &[&str]| {
        let mut args = vec!["topology", "apply", &queue, "--policy", policy.path()];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let url = url.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            retryctl_with_env(&args, &url).await
        }
    };

    let wrong_name = run(apply(&["--tls-ca", ca])).await;
    let applied = run(apply(&["--tls-ca", ca, "--tls-server-name", "localhost"])).await;
    let half_identity = run(apply(&["--tls-ca", ca, "--tls-cert", ca])).await;
    // A transport that takes no TLS settings refuses them before connecting.
    let no_tls = {
        let args = apply(&["--tls-ca", ca]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        retryctl_with_env(&args, "memory://").await
    };
    let plain = AmqpConfig::new(format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        node.plain_port
    ));
    teardown(&plain, &plan(&queue)).await;

    assert_eq!(wrong_name.code, 1, "{wrong_name:?}");
    assert!(
        wrong_name.stderr.contains("not valid for 127.0.0.1"),
        "{wrong_name:?}"
    );
    assert_eq!(applied.code, 0, "{applied:?}");
    assert!(applied.stdout.contains("8 created"), "{applied:?}");
    assert_eq!(half_identity.code, 2, "{half_identity:?}");
    assert_eq!(no_tls.code, 2, "{no_tls:?}");
    assert!(
        no_tls.stderr.contains("do not apply to ") && no_tls.stderr.contains("takes no TLS"),
        "{no_tls:?}"
    );
}
