//! Passwords and keys never reach the logs: everything this crate and fe2o3-amqp trace, at
//! every level, through TLS refusals (with a client certificate and key configured), an
//! unreachable broker, a refused login and a publishing connection the broker closed and
//! the transport replaced.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber.

mod common;

use std::time::Duration;

use common::*;
use retry_core::headers::EngineHeaders;
use retry_core::{
    DeadLetterReason, Message, MessageParts, Properties, Publish, PublishResult, RetryPolicy,
    TlsConfig, TlsFailure, TopologyPlan, Transport, TransportError,
};
use test_brokers::LogRecorder;
use test_brokers::rabbitmq::{rabbitmqctl, tls_node};
use transport_amqp10::{Amqp10Config, Amqp10Transport};

async fn connect_error(url: String) -> String {
    connect_error_with(Amqp10Config::new(url)).await.to_string()
}

async fn connect_error_with(config: Amqp10Config) -> TransportError {
    let config = config.with_connect_timeout(Duration::from_secs(5));
    tracing::info!(config = ?config, "connecting");
    let err = Amqp10Transport::connect(config)
        .await
        .expect_err("the connection fails");
    tracing::error!(error = &err as &dyn std::error::Error, debug = ?err, "connect failed");
    err
}

#[tokio::test]
async fn passwords_never_reach_the_logs() {
    let logs = LogRecorder::default();
    tracing::subscriber::set_global_default(logs.clone()).expect("the only subscriber");

    // TLS to the plain port, a port nobody listens on.
    connect_error("amqps://guest:tls-secret-4712@127.0.0.1:5672".into()).await;
    connect_error("amqp://guest:refused-secret-4712@127.0.0.1:1".into()).await;

    // TLS refusals on the TLS node, with a client certificate and key configured: by the
    // client (a CA that signed nothing there, a wrong host name) and by the server (a
    // client certificate of a CA it does not know).
    let mut keys = Vec::new();
    if let Some(node) = tls_node("TLS refusals in the logs") {
        let identity = |cert: &str, key: &str| {
            TlsConfig::new()
                .with_ca_file(node.cert("ca.pem"))
                .with_client_identity(node.cert(cert), node.cert(key))
        };
        let url = |host: &str| {
            format!(
                "amqps://guest:tls-refused-secret-4712@{host}:{}",
                node.tls_port
            )
        };
        let refusals = [
            (
                url("localhost"),
                identity("client.pem", "client.key").with_server_name("rabbit.example"),
            ),
            (url("127.0.0.1"), identity("client.pem", "client.key")),
            (url("localhost"), identity("other-ca.pem", "other-ca.key")),
        ];
        for (url, tls) in refusals {
            let err = connect_error_with(Amqp10Config::new(url).with_tls(tls)).await;
            assert!(
                matches!(
                    err,
                    TransportError::Tls {
                        failure: TlsFailure::WrongHostName { .. }
                            | TlsFailure::RefusedByServer { .. },
                        ..
                    }
                ),
                "{err:?}"
            );
        }
        for file in ["client.key", "other-ca.key"] {
            let pem = std::fs::read_to_string(node.cert(file)).expect("key file");
            keys.extend(
                pem.lines()
                    .filter(|l| !l.starts_with("-----") && l.len() > 20)
                    .map(str::to_owned),
            );
        }
        assert!(!keys.is_empty());
    }
    // Checked here too, as the rest needs the machine's broker.
    if !keys.is_empty() {
        let refusals = logs.containing("TLS with");
        assert!(
            refusals.len() >= 3,
            "the TLS refusals were not logged: {refusals:?}"
        );
    }
    for line in &keys {
        assert_eq!(
            logs.containing(line),
            Vec::<String>::new(),
            "key material was logged"
        );
    }
    assert_eq!(
        logs.containing("tls-refused-secret-4712"),
        Vec::<String>::new(),
        "a TLS refusal logged the password"
    );

    let Some(b) = broker().await else {
        return;
    };
    connect_error(amqp10_url().replacen("guest:guest", "guest:wrong-secret-4712", 1)).await;

    // A user of its own, whose password is nowhere else; the broker closes its connection
    // and the transport connects again to publish.
    let user = unique("logs-user");
    let secret = format!("replaced-secret-{}", std::process::id());
    rabbitmqctl(&["add_user", &user, &secret]);
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let url = amqp10_url().replacen("guest:guest", &format!("{user}:{secret}"), 1);
    assert!(url.contains(&secret), "AMQP10_URL must carry guest:guest");

    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new(&unique("logs"), &policy).unwrap();
    let _cleanup = b.declare(&plan, &[], Vec::new()).await;
    let t = Amqp10Transport::connect(
        Amqp10Config::new(url).with_publish_timeout(Duration::from_secs(2)),
    )
    .await
    .unwrap();
    tracing::info!(transport = ?t, "connected");
    t.provision(&plan).await.unwrap();
    let message = Message::new(MessageParts {
        queue: plan.work_queue().to_owned(),
        exchange: String::new(),
        routing_key: plan.work_queue().to_owned(),
        body: b"x".to_vec(),
        properties: Properties::default(),
        headers: Default::default(),
        native: Default::default(),
    });
    let park = Publish {
        route: plan.parking_route().clone(),
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
            reason: Some(DeadLetterReason::Permanent),
            delay: None,
            suspect: None,
        },
    };
    assert!(matches!(
        t.publish(&message, &park).await,
        PublishResult::Confirmed
    ));
    rabbitmqctl(&["close_all_user_connections", &user, "test: forced close"]);
    let mut after = Vec::new();
    for _ in 0..10 {
        let result = t.publish(&message, &park).await;
        let confirmed = matches!(result, PublishResult::Confirmed);
        after.push(result);
        if confirmed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    t.close().await;
    rabbitmqctl(&["delete_user", &user]);
    assert!(
        matches!(after.last(), Some(PublishResult::Confirmed)),
        "{after:?}"
    );
    let connected = logs.containing("publisher connected");
    assert!(
        connected.len() >= 2,
        "no reconnection logged: {connected:?}"
    );

    assert!(logs.len() > 10, "only {} lines recorded", logs.len());
    for line in &keys {
        assert_eq!(
            logs.containing(line),
            Vec::<String>::new(),
            "key material was logged"
        );
    }
    for secret in [
        "tls-secret-4712",
        "tls-refused-secret-4712",
        "refused-secret-4712",
        "wrong-secret-4712",
        &secret,
    ] {
        assert_eq!(
            logs.containing(secret),
            Vec::<String>::new(),
            "{secret} was logged"
        );
    }
}
