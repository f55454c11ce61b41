//! The AMQP 1.0 transport on the local three-node cluster (`stress/cluster.sh up`, node list in
//! `AMQP_CLUSTER_URLS`): a node list whose first node is down, and a subscription that goes
//! on consuming, on another node, after the node it was on is stopped.

use std::time::{Duration, Instant};

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use retry_core::{QueueType, RetryPolicy, Settlement, Subscription, TopologyPlan, Transport};
use test_brokers::rabbitmq::{ClusterLease, cluster, cluster_sh, confirm_channel};
use test_brokers::{LogRecorder, print_uncaptured};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// The same node as AMQP 1.0 URL: `amqp://user:pass@host:port` without the virtual host.
fn amqp10_url(url091: &str) -> String {
    url091.trim_end_matches("/%2f").to_owned()
}

/// Publishes `id` to `queue` with a confirm, on the first node of `urls` that answers. A
/// nack is RabbitMQ's "not taken, publish again": a quorum queue whose leader was on the
/// node just stopped nacks while its members elect another. It is published again, a
/// little later, for up to 30 s.
async fn publish(urls: &[String], queue: &str, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut nacks = 0;
    while Instant::now() < deadline {
        for url in urls {
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(5),
                Connection::connect(url, ConnectionProperties::default()),
            )
            .await
            else {
                continue;
            };
            let ch = confirm_channel(&conn).await.unwrap();
            let confirm = ch
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    id.as_bytes(),
                    BasicProperties::default()
                        .with_message_id(id.into())
                        .with_delivery_mode(2),
                )
                .await
                .unwrap();
            let acked = confirm.await.unwrap().is_ack();
            let _ = conn.close(200, "published".into()).await;
            if acked {
                if nacks > 0 {
                    print_uncaptured(&format!("{id}: confirmed after {nacks} nacks\n"));
                }
                return;
            }
            nacks += 1;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("no node of {urls:?} confirmed a publish within 30 s ({nacks} nacks)");
}

#[tokio::test]
async fn a_subscription_consumes_on_another_node_after_its_node_is_stopped() {
    let Some(urls) = cluster("AMQP 1.0 failover") else {
        return;
    };
    let logs = LogRecorder::up_to(tracing::Level::WARN);
    let _ = tracing::subscriber::set_global_default(logs.clone());
    let _lease = ClusterLease::take().await;

    let q = format!("amqp10-cluster-{}", std::process::id());
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap();
    let plan = TopologyPlan::builder(&q, &policy)
        .with_queue_type(QueueType::Quorum)
        .with_replication_factor(3)
        .build()
        .unwrap();
    let setup = AmqpTransport::connect(AmqpConfig::cluster(urls.clone()).unwrap())
        .await
        .unwrap();
    setup.provision(&plan).await.unwrap();

    // The first node of the list is down: the connections open on rtest1, the next.
    let mut list = vec!["amqp://guest:guest@127.0.0.1:5689".to_owned()];
    list.extend(urls.iter().map(|u| amqp10_url(u)));
    let config = Amqp10Config::cluster(list).unwrap();
    let t = Amqp10Transport::connect(config).await.unwrap();
    t.provision(&plan).await.unwrap();
    let sub = t.consume(&q, 4).await.unwrap();
    publish(&urls, &q, "before").await;
    let before = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("a delivery before the stop")
        .unwrap()
        .unwrap();
    t.settle(&before.tag, Settlement::Ack).await.unwrap();

    let stopped = Instant::now();
    tokio::task::spawn_blocking(|| cluster_sh(&["stop", "rtest1"]))
        .await
        .unwrap();
    publish(&urls, &q, "after").await;
    // A lost link is reported once, as the consumer driver expects; the next receive
    // attaches again, on the next node that answers.
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        assert!(
            Instant::now() < deadline,
            "consuming resumes on another node within 60 s"
        );
        match tokio::time::timeout(Duration::from_secs(10), sub.recv()).await {
            Ok(Ok(Some(delivery))) => break delivery,
            Ok(Ok(None)) => panic!("the subscription ended"),
            Ok(Err(_)) | Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let took = stopped.elapsed();
    assert_eq!(after.message.body(), b"after");
    t.settle(&after.tag, Settlement::Ack).await.unwrap();

    let moved = logs.containing("AMQP 1.0 connection failed over to another node");
    print_uncaptured(&format!(
        "AMQP 1.0: consuming resumed {took:?} after rtest1 was stopped\n{}\n",
        moved.join("\n")
    ));
    assert!(
        moved
            .iter()
            .any(|l| l.contains("left=amqp://guest:****@127.0.0.1:5681")
                && l.contains("reached=amqp://guest:****@127.0.0.1:568")),
        "{moved:?}"
    );
    assert!(
        logs.containing("guest:guest").is_empty(),
        "a password in the logs"
    );
    t.close().await;
    tokio::task::spawn_blocking(|| cluster_sh(&["start", "rtest1"]))
        .await
        .unwrap();
    setup.teardown(&plan).await.unwrap();
    setup.close().await.unwrap();
}
