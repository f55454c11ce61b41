//! Passwords never reach the logs: everything this crate and lapin trace, at every level,
//! through a TLS failure, a refused login, an unreachable broker and a recovery.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber.

mod common;

use std::time::Duration;

use common::*;
use retry_core::{Subscription, Transport};
use transport_amqp091::testing::LogRecorder;
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
    let url = url().replacen("guest:guest", &format!("{user}:{secret}"), 1);
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
    for secret in [
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
