//! The transport against the real RabbitMQ: provisioning, publish results, settlement and
//! recovery, without the driver.

mod common;

use std::time::Duration;

use common::*;
use retry_core::headers::{self, EngineHeaders};
use retry_core::{
    HeaderValue, Message, MessageParts, Properties, Publish, PublishResult, QueueType, RetryPolicy,
    Route, Settlement, Subscription, Timestamp, TopologyPlan, Transport, TransportError,
};
use test_brokers::rabbitmq::refusing;
use transport_amqp091::{AmqpConfig, AmqpTransport};

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn clone_of(queue: &str, body: &[u8]) -> Message {
    Message::new(MessageParts {
        queue: queue.into(),
        exchange: String::new(),
        routing_key: queue.into(),
        body: body.to_vec(),
        properties: Properties {
            message_id: Some("m-1".into()),
            content_type: Some("application/octet-stream".into()),
            persistent: true,
            ..Properties::default()
        },
        headers: [("tenant", HeaderValue::from("acme"))]
            .into_iter()
            .collect(),
        ..MessageParts::default()
    })
}

fn publish_to(route: Route) -> Publish {
    Publish {
        route,
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: Some(Timestamp::from_millis(1_000)),
            last_failure: Some(Timestamp::from_millis(2_000)),
            last_error: Some("boom".into()),
            reason: None,
            delay: Some(secs(1)),
            suspect: None,
        },
    }
}

#[tokio::test]
async fn provisioning_creates_exactly_the_planned_topology_and_is_idempotent() {
    let Some(config) = broker("provision").await else {
        return;
    };
    let q = unique("prov");
    let policy = RetryPolicy::delays([secs(30), secs(600), secs(3600)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = transport(&config).await;
    let first = t.provision_inspected(&plan).await.unwrap();
    // Two exchanges; the work queue, three delay queues, the isolation queue, its
    // crash-delay queue and the parking queue.
    assert_eq!(first.created.len(), 2 + 7, "{first:?}");
    assert_eq!(t.last_provision_report().as_ref(), Some(&first));

    let queues = list_queues(&q).await;
    let mut names: Vec<_> = queues.iter().map(|r| r["name"].as_str().unwrap()).collect();
    names.sort();
    let mut planned: Vec<_> = plan.queues().iter().map(|q| q.name.as_str()).collect();
    planned.sort();
    assert_eq!(names, planned);
    for spec in plan.queues() {
        let row = queues
            .iter()
            .find(|r| r["name"] == spec.name.as_str())
            .unwrap();
        assert_eq!(row["durable"], true);
        assert_eq!(row["type"], "classic");
        // rabbitmqctl prints arguments as [name, type, value] triples.
        let args: Vec<(String, String)> = row["arguments"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| (a[0].as_str().unwrap().to_owned(), a[2].to_string()))
            .collect();
        let mut want: Vec<(String, String)> = spec
            .arguments
            .to_headers()
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    HeaderValue::Int(n) => n.to_string(),
                    HeaderValue::Str(s) => format!("{s:?}"),
                    other => panic!("unexpected argument {other:?}"),
                };
                (k.to_owned(), v)
            })
            .collect();
        let mut got = args.clone();
        got.sort();
        want.sort();
        assert_eq!(got, want, "{}", spec.name);
    }
    let bindings = list_bindings(&q).await;
    let mut planned: Vec<_> = plan
        .bindings()
        .iter()
        .map(|b| (b.exchange.clone(), b.queue.clone(), b.routing_key.clone()))
        .collect();
    planned.sort();
    assert_eq!(bindings, planned);

    // Again: nothing new, everything verified.
    let second = t.provision_inspected(&plan).await.unwrap();
    assert!(second.created.is_empty(), "{second:?}");
    assert_eq!(second.verified.len(), 9);
    // The consumer's start declares without asking: the same objects, none refused.
    t.provision(&plan).await.unwrap();
    let declared = t.last_provision_report().unwrap();
    assert_eq!(declared.declared.len(), 9, "{declared:?}");
    assert!(declared.created.is_empty() && declared.verified.is_empty());
    assert_eq!(list_bindings(&q).await, planned);
    t.teardown(&plan).await.unwrap();
    assert!(list_queues(&q).await.is_empty());
}

#[tokio::test]
async fn a_conflicting_declaration_is_reported_by_queue_and_argument() {
    let Some(config) = broker("conflict").await else {
        return;
    };
    let q = unique("conflict");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let delay_queue = format!("{q}.retry.30s");
    let (_conn, ch) = raw().await;
    let mut args = lapin::types::FieldTable::default();
    args.insert(
        "x-message-ttl".into(),
        lapin::types::AMQPValue::LongInt(5_000),
    );
    declare_durable(&ch, &delay_queue, args).await;

    let t = transport(&config).await;
    let err = t.provision(&plan).await.unwrap_err();
    match &err {
        TransportError::TopologyConflict {
            object,
            argument,
            existing,
            wanted,
        } => {
            assert!(object.contains(&delay_queue), "{err}");
            assert!(
                argument == "x-dead-letter-exchange" || argument == "x-message-ttl",
                "{err}"
            );
            assert!(!existing.is_empty() && !wanted.is_empty(), "{err}");
        }
        other => panic!("expected a conflict, got {other}"),
    }
    // The transport is still usable after the refused declaration.
    let plain = TopologyPlan::new(&unique("after-conflict"), &policy).unwrap();
    t.provision(&plain).await.unwrap();
    t.teardown(&plain).await.unwrap();
    ch.queue_delete(delay_queue.as_str().into(), Default::default())
        .await
        .unwrap();
    t.teardown(&plan).await.unwrap();

    // An isolation queue declared without its dead-letter routing is a conflict too.
    let q = unique("conflict-suspect");
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    declare_durable(&ch, plan.isolation_queue(), Default::default()).await;
    let err = t.provision(&plan).await.unwrap_err();
    assert!(
        matches!(&err, TransportError::TopologyConflict { object, argument, .. }
            if object.contains(plan.isolation_queue()) && argument.starts_with("x-dead-letter")),
        "{err}"
    );
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn publish_results_are_told_apart() {
    let Some(config) = broker("publish").await else {
        return;
    };
    let q = unique("pub");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let msg = clone_of(&q, b"\x00\xffbody");
    let (route, _) = plan.route_for(secs(30)).unwrap();

    // Confirmed, with the body untouched and the engine's headers written.
    let r = t.publish(&msg, &publish_to(route.clone())).await;
    assert!(matches!(r, PublishResult::Confirmed), "{r:?}");
    let (_conn, ch) = raw().await;
    let got = wait_get(&ch, &format!("{q}.retry.30s"), secs(5))
        .await
        .unwrap();
    assert_eq!(got.body, b"\x00\xffbody");
    assert_eq!(got.message_id.as_deref(), Some("m-1"));
    assert_eq!(
        got.headers.get(headers::ATTEMPTS),
        Some(&HeaderValue::Int(1))
    );
    assert_eq!(got.headers.get("tenant"), Some(&HeaderValue::from("acme")));
    assert_eq!(
        got.headers.get(headers::ORIGIN_QUEUE),
        Some(&HeaderValue::from(q.as_str()))
    );

    // Returned: the exchange exists but nothing is bound to the key.
    let unroutable = Route {
        exchange: route.exchange.clone(),
        routing_key: "no-such-key".into(),
    };
    let r = t.publish(&msg, &publish_to(unroutable)).await;
    assert!(matches!(r, PublishResult::Returned), "{r:?}");

    // Failed: a missing exchange is a channel error...
    let missing = Route {
        exchange: format!("{q}.missing").into(),
        routing_key: "k".into(),
    };
    let r = t.publish(&msg, &publish_to(missing)).await;
    assert!(matches!(r, PublishResult::Failed(_)), "{r:?}");
    // ...after which the transport reopens its channel and publishes again.
    let r = t.publish(&msg, &publish_to(route.clone())).await;
    assert!(matches!(r, PublishResult::Confirmed), "{r:?}");

    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn a_full_reject_publish_queue_refuses_the_clone() {
    let Some(config) = broker("refused").await else {
        return;
    };
    let q = unique("full");
    let (_conn, ch) = raw().await;
    ch.queue_declare(
        q.as_str().into(),
        Default::default(),
        refusing(lapin::types::FieldTable::default()),
    )
    .await
    .unwrap();
    let t = transport(&config).await;
    let route = Route {
        exchange: "".into(),
        routing_key: q.as_str().into(),
    };
    let r = t.publish(&clone_of(&q, b"x"), &publish_to(route)).await;
    assert!(matches!(r, PublishResult::Refused), "{r:?}");
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn passwords_stay_out_of_errors_and_debug_output() {
    // TLS to the plain port fails in the handshake; the error must not carry the password.
    let config =
        AmqpConfig::new("amqps://guest:hunter2-secret@127.0.0.1:5672/%2f").with_auto_recover(false);
    assert!(!format!("{config:?}").contains("hunter2"));
    let err = tokio::time::timeout(secs(20), AmqpTransport::connect(config))
        .await
        .expect("a TLS handshake against a plain port fails quickly")
        .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    // A typed refusal naming the endpoint (host and port, no user) and the failed check.
    match &err {
        TransportError::Tls { endpoint, failure } => {
            assert_eq!(endpoint, "127.0.0.1:5672");
            assert_eq!(failure, &retry_core::TlsFailure::NotTls);
        }
        other => panic!("not a TLS refusal: {other:?}"),
    }

    // Any other failure to connect keeps lapin's error whole as the source, not flattened
    // into the message, and names the node with its password redacted.
    let config =
        AmqpConfig::new("amqp://guest:hunter2-secret@127.0.0.1:1/%2f").with_auto_recover(false);
    let err = tokio::time::timeout(secs(20), AmqpTransport::connect(config))
        .await
        .expect("a refused connection fails quickly")
        .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("amqp://guest:****@127.0.0.1:1"), "{text}");
    let source = std::error::Error::source(&err).expect("the client's error is the source");
    assert!(
        source.downcast_ref::<lapin::Error>().is_some(),
        "{source:?}"
    );
    assert!(!err.to_string().contains(&source.to_string()), "{err}");

    let Some(_) = broker("password").await else {
        return;
    };
    let wrong = AmqpConfig::new("amqp://guest:not-the-password@127.0.0.1:5672/%2f")
        .with_auto_recover(false);
    let err = AmqpTransport::connect(wrong).await.unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(!text.contains("not-the-password"), "{text}");
}

#[tokio::test]
async fn consuming_resumes_after_a_forced_close_and_stale_tags_are_not_acked() {
    let Some(config) = broker("recovery").await else {
        return;
    };
    let name = config.connection_name().unwrap().to_owned();
    let q = unique("recover");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::builder(&q, &policy)
        .with_queue_type(QueueType::Classic)
        .build()
        .unwrap();
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let (_conn, ch) = raw().await;
    publish(&ch, &q, b"one", "one").await;
    let sub = t.consume(&q, 10).await.unwrap();
    let first = sub.recv().await.unwrap().unwrap();
    assert!(!first.facts.redelivered);

    assert_eq!(close_connection(&name).await, 1);
    // The held delivery comes back, flagged, on the recovered channel.
    let again = tokio::time::timeout(secs(30), sub.recv())
        .await
        .expect("consuming resumes")
        .unwrap()
        .unwrap();
    assert_eq!(again.message.body(), b"one");
    assert!(again.facts.redelivered);
    assert_eq!(recoveries_reaching(&t, 1).await, 1);

    // Settling the stale tag fails (the broker has it back); the new one is acked.
    let stale = t.settle(&first.tag, Settlement::Ack).await;
    assert!(
        matches!(stale, Err(TransportError::Connection { .. })),
        "{stale:?}"
    );
    t.settle(&again.tag, Settlement::Ack).await.unwrap();
    sub.flush().await.unwrap();
    // The broker counts unacknowledged deliveries: the new tag's ack arrived, on the open
    // channel, before anything is closed.
    assert_eq!(ready_and_unacked_settled(&q).await, (0, 0));

    // And publishing works on the recovered connection.
    let (route, _) = plan.route_for(secs(30)).unwrap();
    let r = t
        .publish(&clone_of(&q, b"x"), &publish_to(route.clone()))
        .await;
    assert!(matches!(r, PublishResult::Confirmed), "{r:?}");
    // Closing returns whatever was never acked: nothing is left.
    t.close().await.unwrap();
    assert_eq!(ready_and_unacked_settled(&q).await, (0, 0));
    transport(&config).await.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn requeue_returns_the_delivery_and_acks_are_batched_safely() {
    let Some(config) = broker("settle").await else {
        return;
    };
    let q = unique("settle");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let (_conn, ch) = raw().await;
    for i in 0..6 {
        publish(&ch, &q, format!("m{i}").as_bytes(), &format!("m{i}")).await;
    }
    let sub = t.consume(&q, 6).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(sub.recv().await.unwrap().unwrap());
    }
    // Ack out of order, requeue one in the middle.
    for i in [5, 0, 1, 3, 4] {
        t.settle(&got[i].tag, Settlement::Ack).await.unwrap();
    }
    t.settle(&got[2].tag, Settlement::Requeue).await.unwrap();
    let back = tokio::time::timeout(secs(10), sub.recv())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(back.message.body(), b"m2");
    assert!(back.facts.redelivered);
    t.settle(&back.tag, Settlement::Ack).await.unwrap();
    // Closing sends the batched acks first: were one missing, its message would be back
    // in the queue once the connection is gone.
    t.close().await.unwrap();
    assert_eq!(
        ready_and_unacked_settled(&q).await,
        (0, 0),
        "every ack reached the broker"
    );
    transport(&config).await.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn two_subscriptions_never_settle_each_others_deliveries() {
    let Some(config) = broker("two-subs").await else {
        return;
    };
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let (a, b) = (unique("sub-a"), unique("sub-b"));
    let plans = [&a, &b].map(|q| TopologyPlan::new(q, &policy).unwrap());
    let t = transport(&config).await;
    for plan in &plans {
        t.provision(plan).await.unwrap();
    }
    let (_conn, ch) = raw().await;
    for i in 0..4 {
        publish(&ch, &a, b"a", &format!("a{i}")).await;
        publish(&ch, &b, b"b", &format!("b{i}")).await;
    }
    let sub_a = t.consume(&a, 4).await.unwrap();
    let sub_b = t.consume(&b, 4).await.unwrap();
    assert_ne!(sub_a.channel_id(), sub_b.channel_id());
    let mut from_a = Vec::new();
    for _ in 0..4 {
        from_a.push(sub_a.recv().await.unwrap().unwrap());
        let d = sub_b.recv().await.unwrap().unwrap();
        assert_eq!(d.message.body(), b"b");
    }
    // Acks of the first go out as one `multiple` ack: on a shared channel it would also
    // cover the second's deliveries, which nobody acked.
    for d in &from_a {
        t.settle(&d.tag, Settlement::Ack).await.unwrap();
    }
    sub_a.flush().await.unwrap();
    t.close().await.unwrap();
    assert_eq!(message_count(&ch, &a).await.unwrap(), 0);
    assert_eq!(
        message_count(&ch, &b).await.unwrap(),
        4,
        "the second's stay unacked, then return"
    );
    let t = transport(&config).await;
    for plan in &plans {
        t.teardown(plan).await.unwrap();
    }
}

/// A retry's clone of a received message carries the user's headers in the AMQP types they
/// came with, not as the header model reads them.
#[tokio::test]
async fn a_clone_keeps_the_users_headers_in_their_types() {
    let Some(config) = broker("clone types").await else {
        return;
    };
    let q = unique("clone-types");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    // Deleted even when an assertion below fails.
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let (_conn, ch) = raw().await;
    let properties = lapin::BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(table(narrow_headers()));
    publish_with(&ch, &q, b"typed", properties).await;
    let original = t.fetch(&q).await.unwrap().expect("the message");
    assert_eq!(
        original.message.headers().get("i16"),
        Some(&HeaderValue::Int(-300)),
        "the handler reads the model's value"
    );
    let (route, _) = plan.route_for(secs(30)).unwrap();
    let r = t
        .publish(&original.message, &publish_to(route.clone()))
        .await;
    assert!(matches!(r, PublishResult::Confirmed), "{r:?}");
    t.settle(&original.tag, Settlement::Ack).await.unwrap();
    let clone = poll_until(
        secs(5),
        Duration::from_millis(20),
        || async {
            ch.basic_get(
                format!("{q}.retry.30s").as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
            .unwrap()
        },
        Option::is_some,
    )
    .await
    .expect("the clone")
    .delivery;
    let headers = clone.properties.headers().clone().expect("headers");
    assert_narrow_headers_kept(&headers);
    assert_eq!(
        headers.inner().get(headers::ATTEMPTS),
        Some(&lapin::types::AMQPValue::LongLongInt(1)),
        "the engine's headers are written afresh"
    );
}

#[tokio::test]
async fn fetch_takes_one_message_settled_at_once_and_names_a_missing_queue() {
    let Some(config) = broker("fetch").await else {
        return;
    };
    let q = unique("fetch");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let isolation = plan.isolation_queue();
    assert!(t.fetch(isolation).await.unwrap().is_none(), "empty");
    let (_conn, ch) = raw().await;
    for id in ["s1", "s2"] {
        publish(&ch, isolation, id.as_bytes(), id).await;
    }
    let first = t.fetch(isolation).await.unwrap().unwrap();
    assert_eq!(first.message.body(), b"s1");
    assert_eq!(first.message.queue(), isolation);
    assert!(!first.facts.redelivered);
    assert_eq!(
        message_count(&ch, isolation).await.unwrap(),
        1,
        "only one taken"
    );
    // A requeued fetch comes back redelivered, at the head.
    t.settle(&first.tag, Settlement::Requeue).await.unwrap();
    let again = t.fetch(isolation).await.unwrap().unwrap();
    assert_eq!(again.message.body(), b"s1");
    assert!(again.facts.redelivered);
    // An ack is sent at once, never batched.
    t.settle(&again.tag, Settlement::Ack).await.unwrap();
    let second = t.fetch(isolation).await.unwrap().unwrap();
    // Held unsettled when the transport goes, it is back, redelivered.
    t.close().await.unwrap();
    let t = transport(&config).await;
    let back = t.fetch(isolation).await.unwrap().unwrap();
    assert_eq!(back.message.body(), b"s2");
    assert!(back.facts.redelivered);
    t.settle(&back.tag, Settlement::Ack).await.unwrap();
    assert!(t.fetch(isolation).await.unwrap().is_none());
    drop(second);

    let missing = format!("{q}.nowhere");
    let err = t.fetch(&missing).await.unwrap_err();
    assert!(
        matches!(&err, TransportError::MissingAddress { address, .. } if address.contains(&missing)),
        "{err:?}"
    );
    // The channel error did not spoil the next fetch.
    assert!(t.fetch(isolation).await.unwrap().is_none());
    t.teardown(&plan).await.unwrap();
}

#[tokio::test]
async fn ready_waits_for_a_message_without_taking_it() {
    let Some(config) = broker("ready").await else {
        return;
    };
    let q = unique("ready");
    let policy = RetryPolicy::delays([secs(30)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    let t = transport(&config).await;
    t.provision(&plan).await.unwrap();
    let isolation = plan.isolation_queue().to_owned();
    let poll = Duration::from_millis(50);
    let watched = tokio::time::timeout(Duration::from_millis(300), t.ready(&isolation, poll)).await;
    assert!(watched.is_err(), "nothing ready: the watch waits");
    let (_conn, ch) = raw().await;
    publish(&ch, &isolation, b"s", "s").await;
    tokio::time::timeout(secs(5), t.ready(&isolation, poll))
        .await
        .expect("resolves once a message is ready")
        .unwrap();
    assert_eq!(
        message_count(&ch, &isolation).await.unwrap(),
        1,
        "nothing was taken"
    );
    let err = t.ready(&format!("{q}.nowhere"), poll).await.unwrap_err();
    assert!(
        matches!(err, TransportError::MissingAddress { .. }),
        "{err:?}"
    );
    t.teardown(&plan).await.unwrap();
}
