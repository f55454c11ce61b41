//! Passwords never reach the logs: everything this crate and fe2o3-amqp trace, at every
//! level, through a TLS failure, an unreachable broker, a refused login and a publishing
//! connection the broker closed and the transport replaced.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber.

mod common;

use std::time::Duration;

use common::*;
use retry_core::headers::EngineHeaders;
use retry_core::{
    DeadLetterReason, Message, MessageParts, Properties, Publish, PublishResult, RetryPolicy,
    TopologyPlan, Transport,
};
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::testing::{LogRecorder, rabbitmqctl};

async fn connect_error(url: String) -> String {
    let config = Amqp10Config::new(url).with_connect_timeout(Duration::from_secs(5));
    let err = Amqp10Transport::connect(config)
        .await
        .expect_err("the connection fails");
    tracing::error!(error = &err as &dyn std::error::Error, debug = ?err, "connect failed");
    err.to_string()
}

#[tokio::test]
async fn passwords_never_reach_the_logs() {
    let logs = LogRecorder::default();
    tracing::subscriber::set_global_default(logs.clone()).expect("the only subscriber");

    // TLS to the plain port, a port nobody listens on.
    connect_error("amqps://guest:tls-secret-4712@127.0.0.1:5672".into()).await;
    connect_error("amqp://guest:refused-secret-4712@127.0.0.1:1".into()).await;

    let Some(b) = broker().await else {
        return;
    };
    connect_error(url10().replacen("guest:guest", "guest:wrong-secret-4712", 1)).await;

    // A user of its own, whose password is nowhere else; the broker closes its connection
    // and the transport connects again to publish.
    let user = unique("logs-user");
    let secret = format!("replaced-secret-{}", std::process::id());
    rabbitmqctl(&["add_user", &user, &secret]);
    rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    let url = url10().replacen("guest:guest", &format!("{user}:{secret}"), 1);
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
    for secret in [
        "tls-secret-4712",
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
