//! Passwords and keys never reach the logs: everything this crate and lapin trace, at every
//! level, through TLS refusals (on the TLS node of `stress/tls-node.sh`, when it runs), a
//! login with a client certificate, a refused login, an unreachable broker and a recovery.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber.

mod common;

use std::time::Duration;

use common::*;
use retry_core::{Subscription, TlsConfig, Transport, TransportError};
use test_brokers::LogRecorder;
use test_brokers::rabbitmq::tls_node;
use transport_amqp091::{AmqpConfig, AmqpTransport};

#[tokio::test]
async fn passwords_never_reach_the_logs() {
    let logs = LogRecorder::default();
    tracing::subscriber::set_global_default(logs.clone()).expect("the only subscriber");

    // A TLS handshake against the plain port fails.
    let tls = AmqpConfig::new("amqps://guest:tls-secret-4711@127.0.0.1:5672/%2f")
        .with_auto_recover(false);
    let err = tokio::time::timeout(Duration::from_secs(20), AmqpTransport::connect(tls))
        .await
        .expect("a TLS handshake against a plain port fails quickly")
        .unwrap_err();
    tracing::error!(error = &err as &dyn std::error::Error, "connect failed");
    // Nothing listens on port 1.
    let refused = AmqpConfig::new("amqp://guest:refused-secret-4711@127.0.0.1:1/%2f")
        .with_auto_recover(false);
    let err = tokio::time::timeout(Duration::from_secs(20), AmqpTransport::connect(refused))
        .await
        .expect("a refused connection fails quickly")
        .unwrap_err();
    tracing::error!(error = &err as &dyn std::error::Error, "connect failed");

    // TLS refusals and a login with a client certificate, on the TLS node.
    let mut keys = Vec::new();
    if let Some(node) = tls_node("TLS lines of the log test") {
        let ca = TlsConfig::new().with_ca_file(node.cert("ca.pem"));
        let refusals = [
            // An unknown CA.
            (
                format!(
                    "amqps://guest:tls-ca-secret-4711@localhost:{}/%2f",
                    node.tls_port
                ),
                TlsConfig::new().with_ca_file(node.cert("other-ca.pem")),
            ),
            // A wrong host name.
            (
                format!(
                    "amqps://guest:tls-name-secret-4711@127.0.0.1:{}/%2f",
                    node.tls_port
                ),
                ca.clone(),
            ),
            // A client certificate the server refuses, with its key.
            (
                format!(
                    "amqps://guest:tls-alert-secret-4711@localhost:{}/%2f",
                    node.tls_port
                ),
                ca.clone()
                    .with_client_identity(node.cert("expired.pem"), node.cert("expired.key")),
            ),
            // A key that does not go with the certificate.
            (
                format!(
                    "amqps://guest:tls-key-secret-4711@localhost:{}/%2f",
                    node.tls_port
                ),
                ca.clone()
                    .with_client_identity(node.cert("client.pem"), node.cert("expired.key")),
            ),
        ];
        for (url, tls) in refusals {
            let config = AmqpConfig::new(url).with_tls(tls).with_auto_recover(false);
            tracing::info!(config = ?config, "connecting");
            let err = AmqpTransport::connect(config).await.unwrap_err();
            assert!(matches!(err, TransportError::Tls { .. }), "{err:?}");
            tracing::error!(error = &err as &dyn std::error::Error, debug = ?err, "connect failed");
        }
        let mtls = AmqpConfig::new(format!("amqps://localhost:{}/%2f", node.tls_port))
            .with_tls(ca.with_client_identity(node.cert("client.pem"), node.cert("client.key")))
            .with_external_auth();
        let t = AmqpTransport::connect(mtls).await.unwrap();
        tracing::info!(transport = ?t, "connected");
        t.close().await.unwrap();
        for key in ["client.key", "expired.key"] {
            let pem = std::fs::read_to_string(node.cert(key)).unwrap();
            keys.extend(
                pem.lines()
                    .filter(|l| !l.starts_with("-----") && l.len() >= 16)
                    .map(|l| l[..16].to_owned()),
            );
        }
        assert!(keys.len() > 20, "the keys were read");
    }

    let Some(config) = broker("logs").await else {
        return;
    };
    // A wrong password.
    let wrong = AmqpConfig::new("amqp://guest:wrong-secret-4711@127.0.0.1:5672/%2f")
        .with_auto_recover(false);
    let err = AmqpTransport::connect(wrong).await.unwrap_err();
    tracing::error!(error = &err as &dyn std::error::Error, "connect failed");

    // A user of its own, whose password is nowhere else, through a forced close and a
    // recovery.
    let user = unique("logs-user");
    let secret = format!("recovery-secret-{}", std::process::id());
    rabbitmqctl(&["add_user", &user, &secret]);
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let name = config.connection_name().unwrap().to_owned();
    let url = amqp_url().replacen("guest:guest", &format!("{user}:{secret}"), 1);
    assert!(url.contains(&secret), "AMQP_URL must carry guest:guest");
    let t = AmqpTransport::connect(AmqpConfig::new(url).with_connection_name(name.clone()))
        .await
        .unwrap();
    tracing::info!(transport = ?t, "connected");
    let (_conn, ch) = raw().await;
    let q = unique("logs");
    declare_durable(&ch, &q, Default::default()).await;
    let sub = t.consume(&q, 1).await.unwrap();
    assert_eq!(close_connection(&name).await, 1);
    // Consuming resumes on the recovered connection.
    publish(&ch, &q, b"after", "after").await;
    let got = tokio::time::timeout(Duration::from_secs(30), sub.recv()).await;
    let recovered = recoveries_reaching(&t, 1).await;
    t.close().await.unwrap();
    rabbitmqctl(&["delete_user", &user]);
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    assert!(matches!(got, Ok(Ok(Some(_)))), "{got:?}");
    assert_eq!(recovered, 1, "the connection was recovered");

    assert!(logs.len() > 10, "only {} lines recorded", logs.len());
    for piece in &keys {
        assert_eq!(
            logs.containing(piece),
            Vec::<String>::new(),
            "key material was logged"
        );
    }
    // The refusals were logged, by their check.
    if !keys.is_empty() {
        for check in [
            "unknown CA",
            "not valid for 127.0.0.1",
            "refused the handshake",
            "does not go with",
        ] {
            assert!(!logs.containing(check).is_empty(), "no line says {check:?}");
        }
    }
    for secret in [
        "tls-ca-secret-4711",
        "tls-name-secret-4711",
        "tls-alert-secret-4711",
        "tls-key-secret-4711",
        "tls-secret-4711",
        "refused-secret-4711",
        "wrong-secret-4711",
        &secret,
    ] {
        assert_eq!(
            logs.containing(secret),
            Vec::<String>::new(),
            "{secret} was logged"
        );
    }
}
