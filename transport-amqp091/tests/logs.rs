//! Passwords never reach the logs: everything this crate and lapin trace, at every level,
//! through a TLS failure, a refused login, an unreachable broker and a recovery.
//!
//! A test binary of its own, because it installs the process-wide tracing subscriber.

mod common;

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use common::*;
use retry_core::{Subscription, Transport};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// Every event and span field, as text.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Recorder;

struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

fn keep(line: Line) {
    LINES.lock().unwrap().push(line.0);
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut line = Line(format!("span {}", span.metadata().name()));
        span.record(&mut line);
        keep(line);
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, values: &Record<'_>) {
        let mut line = Line("record".into());
        values.record(&mut line);
        keep(line);
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line(format!("{} {}", meta.level(), meta.target()));
        event.record(&mut line);
        keep(line);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// The recorded lines that contain `secret`.
fn leaks(secret: &str) -> Vec<String> {
    LINES
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains(secret))
        .cloned()
        .collect()
}

#[tokio::test]
async fn passwords_never_reach_the_logs() {
    tracing::subscriber::set_global_default(Recorder).expect("the only subscriber");

    // A TLS handshake against the plain port fails.
    let tls = AmqpConfig::new("amqps://guest:tls-secret-4711@127.0.0.1:5672/%2f")
        .with_auto_recover(false);
    let err = tokio::time::timeout(Duration::from_secs(20), AmqpTransport::connect(tls))
        .await
        .expect("a TLS handshake against a plain port fails quickly")
        .unwrap_err();
    tracing::error!(error = %err, "connect failed");
    // Nothing listens on port 1.
    let refused = AmqpConfig::new("amqp://guest:refused-secret-4711@127.0.0.1:1/%2f")
        .with_auto_recover(false);
    let err = tokio::time::timeout(Duration::from_secs(20), AmqpTransport::connect(refused))
        .await
        .expect("a refused connection fails quickly")
        .unwrap_err();
    tracing::error!(error = %err, "connect failed");

    let Some(config) = broker("logs").await else {
        return;
    };
    // A wrong password.
    let wrong = AmqpConfig::new("amqp://guest:wrong-secret-4711@127.0.0.1:5672/%2f")
        .with_auto_recover(false);
    let err = AmqpTransport::connect(wrong).await.unwrap_err();
    tracing::error!(error = %err, "connect failed");

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

    let lines = LINES.lock().unwrap().len();
    assert!(lines > 10, "only {lines} lines recorded");
    for secret in [
        "tls-secret-4711",
        "refused-secret-4711",
        "wrong-secret-4711",
        &secret,
    ] {
        assert_eq!(leaks(secret), Vec::<String>::new(), "{secret} was logged");
    }
}
