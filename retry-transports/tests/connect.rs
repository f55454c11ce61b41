//! Connecting by URL on the local brokers: each scheme reaches its transport, the erased
//! transport is the concrete one inside, and a broker that does not answer is an error
//! naming it, without its password.
//!
//! RabbitMQ at `AMQP_URL` / `AMQP10_URL`, NATS at `NATS_URL` (loopback by default); without
//! them these tests skip loudly, and with `REQUIRE_BROKER=1` / `REQUIRE_NATS=1` they fail.

#![cfg(feature = "all")]

use std::time::Duration;

use retry_core::{RetryPolicy, TopologyPlan, Transport};
use retry_transports::{ConnectError, ConnectOptions, DynTransport};
use transport_amqp10::Amqp10Transport;
use transport_amqp091::AmqpTransport;
use transport_memory::MemoryTransport;
use transport_nats::NatsTransport;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// Connects, or skips loudly when the broker is absent and `require` is not set (a panic
/// when it is).
async fn connect(url: &str, options: ConnectOptions, require: &str) -> Option<DynTransport> {
    match retry_transports::connect_with(url, options).await {
        Ok(t) => Some(t),
        Err(e) => {
            let why = format!("no broker at {} ({e})", test_brokers::authority(url));
            test_brokers::skip(require, "connecting by URL", &why, "Start the broker");
            None
        }
    }
}

#[test]
fn amqp_urls_reach_amqp091_unless_amqp10_is_asked_for() {
    runtime().block_on(async {
        let url = test_brokers::amqp_url();
        let Some(t) = connect(&url, ConnectOptions::new(), test_brokers::REQUIRE_BROKER).await
        else {
            return;
        };
        let amqp = t.downcast_ref::<AmqpTransport>().expect("an AmqpTransport");
        assert_eq!(t.capabilities(), amqp.capabilities());
        // Through the erased transport: a queue missing, then provisioned and empty.
        let queue = format!("registry-{}", std::process::id());
        let plan = TopologyPlan::new(&queue, &RetryPolicy::default()).unwrap();
        assert!(t.fetch(&queue).await.is_err(), "not declared yet");
        t.provision(&plan)
            .await
            .expect("provision over the registry's transport");
        let fetched = t.fetch(&queue).await;
        amqp.teardown(&plan).await.expect("teardown");
        assert!(fetched.expect("a fetch from the declared queue").is_none());

        let url10 = test_brokers::amqp10_url();
        let options = ConnectOptions::new()
            .with_protocol("amqp10")
            .with_client_name("registry-test")
            .with_setting("operation_timeout", "5s");
        let Some(t) = connect(&url10, options, test_brokers::REQUIRE_BROKER).await else {
            return;
        };
        assert!(t.downcast_ref::<Amqp10Transport>().is_some(), "{t:?}");
    });
}

#[test]
fn nats_urls_reach_nats() {
    runtime().block_on(async {
        let url = test_brokers::nats_url();
        let options = ConnectOptions::new().with_setting("ack_wait", "5s");
        let Some(t) = connect(&url, options, test_brokers::REQUIRE_NATS).await else {
            return;
        };
        let nats = t.downcast_ref::<NatsTransport>().expect("a NatsTransport");
        assert_eq!(t.capabilities(), nats.capabilities());
        nats.close().await;
    });
}

#[test]
fn memory_urls_reach_a_broker_of_their_own() {
    runtime().block_on(async {
        let a = retry_transports::connect("memory://").await.unwrap();
        let b = retry_transports::connect("MEMORY://").await.unwrap();
        let a = a.downcast_ref::<MemoryTransport>().unwrap();
        let b = b.downcast_ref::<MemoryTransport>().unwrap();
        assert!(a.broker().queue_names().is_empty());
        a.broker()
            .declare_queue("only-in-a", Default::default())
            .unwrap();
        assert!(b.broker().queue_names().is_empty(), "a broker of its own");
    });
}

#[test]
fn a_broker_that_does_not_answer_is_named_without_its_password() {
    runtime().block_on(async {
        for (url, options) in [
            (
                "amqp://guest:s3cret@127.0.0.1:1/%2f",
                ConnectOptions::new().with_setting("connect_timeout", "2s"),
            ),
            ("nats://u:s3cret@127.0.0.1:1", ConnectOptions::new()),
        ] {
            let connecting = retry_transports::connect_with(url, options);
            let err = tokio::time::timeout(Duration::from_secs(30), connecting)
                .await
                .expect("refused within 30 s")
                .unwrap_err();
            assert!(matches!(err, ConnectError::Transport(_)), "{url}: {err:?}");
            let text = format!("{err} {err:?}");
            assert!(text.contains("127.0.0.1:1"), "{url}: {text}");
            assert!(!text.contains("s3cret"), "{url}: {text}");
        }
    });
}
