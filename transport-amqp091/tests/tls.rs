//! TLS on a real broker: the node of `stress/tls-node.sh` (`amqps://` on 5676, plain on
//! 5675) with its throwaway CA. A consumer over TLS handles, retries and parks; a client
//! certificate logs in with `EXTERNAL`; and every refusal is a typed
//! `TransportError::Tls` naming the endpoint and the check that failed, with neither the
//! password nor a byte of a key in its text or `Debug` output. Each test skips, loudly,
//! without the node (`REQUIRE_TLS=1` makes it fail instead).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{start, unique, wait_get};
use lapin::{Connection, ConnectionProperties};
use retry_core::{
    DeadLetterReason, HandlerError, Message, ParkedRecord, RetryPolicy, Terminal, TlsConfig,
    TlsFailure, TopologyPlan, Transport, TransportError,
};
use test_brokers::rabbitmq::{Cleanup, TlsNode, rabbitmqctl, tls_node};
use transport_amqp091::{AmqpConfig, AmqpTransport};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Counts runs per message id.
#[derive(Clone, Default)]
struct Runs(Arc<std::sync::Mutex<std::collections::HashMap<String, u32>>>);

impl Runs {
    fn next(&self, msg: &Message) -> u32 {
        let id = msg.properties().message_id.clone().unwrap_or_default();
        let mut m = self.0.lock().unwrap();
        let n = m.entry(id).or_default();
        *n += 1;
        *n
    }
}

/// The node's plain-TCP URL, for setting up and looking (and cleaning up) without TLS.
fn plain_url(node: &TlsNode) -> String {
    format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.plain_port)
}

async fn raw(node: &TlsNode) -> (Connection, lapin::Channel) {
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.plain_port);
    let conn = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    (conn, ch)
}

fn trusting_the_ca(node: &TlsNode) -> TlsConfig {
    TlsConfig::new().with_ca_file(node.cert("ca.pem"))
}

/// `rabbitmqctl` on the TLS node.
fn ctl(args: &[&str]) -> String {
    let mut all = vec!["-n", "rtls@localhost"];
    all.extend_from_slice(args);
    rabbitmqctl(&all)
}

/// The user, login mechanism and TLS flag of the TLS node's connection named `name`.
fn connection(name: &str) -> Vec<String> {
    let all = ctl(&[
        "list_connections",
        "--no-table-headers",
        "user",
        "auth_mechanism",
        "ssl",
        "client_properties",
    ]);
    let line = all
        .lines()
        .find(|l| l.contains(&format!("\"{name}\"")))
        .unwrap_or_else(|| panic!("no connection {name} in {all}"));
    line.split('\t').take(3).map(str::to_owned).collect()
}

/// Connects with `config` (no recovery), which must be refused.
async fn refused(config: AmqpConfig) -> TransportError {
    let connecting = AmqpTransport::connect(config.with_auto_recover(false));
    match tokio::time::timeout(Duration::from_secs(30), connecting)
        .await
        .expect("a refusal comes quickly")
    {
        Ok(t) => {
            let _ = t.close().await;
            panic!("connected where TLS must refuse");
        }
        Err(e) => e,
    }
}

/// Every 16-character piece of the base64 body of the PEM `key` files.
fn key_pieces(node: &TlsNode, keys: &[&str]) -> Vec<String> {
    let mut pieces = Vec::new();
    for key in keys {
        let text = std::fs::read_to_string(node.cert(key)).unwrap();
        for line in text.lines().filter(|l| !l.starts_with("-----")) {
            let chars: Vec<char> = line.chars().collect();
            pieces.extend(
                chars
                    .chunks(16)
                    .filter(|c| c.len() == 16)
                    .map(String::from_iter),
            );
        }
    }
    assert!(pieces.len() > 50, "the keys were read");
    pieces
}

/// `err` names the endpoint and the `want`ed failure, and neither its text, its chain nor
/// its `Debug` output holds `password` or a piece of a key.
fn assert_tls(
    err: &TransportError,
    endpoint: &str,
    want: &TlsFailure,
    password: &str,
    node: &TlsNode,
) {
    match err {
        TransportError::Tls {
            endpoint: e,
            failure,
        } => {
            assert_eq!(e, endpoint, "{err}");
            assert_eq!(failure, want, "{err}");
        }
        other => panic!("not a TLS refusal: {other:?} ({other})"),
    }
    let mut text = format!("{err} {err:?}");
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(&format!(" {s} {s:?}"));
        source = s.source();
    }
    assert!(!text.contains(password), "{text}");
    for piece in key_pieces(node, &["client.key", "expired.key", "server.key"]) {
        assert!(!text.contains(&piece), "key material in {text}");
    }
}

#[tokio::test]
async fn a_consumer_over_tls_handles_retries_and_parks() {
    let Some(node) = tls_node("a consumer over TLS") else {
        return;
    };
    let q = unique("tls-consumer");
    let policy = RetryPolicy::delays([ms(300)]).build().unwrap();
    let plan = TopologyPlan::new(&q, &policy).unwrap();
    // Deletes the plan when dropped, through the node's plain port.
    let _cleanup = Cleanup::new(plain_url(&node)).with_plan(&plan);
    let config = AmqpConfig::new(format!(
        "amqps://guest:guest@localhost:{}/%2f",
        node.tls_port
    ))
    .with_tls(trusting_the_ca(&node))
    .with_connection_name(unique("tls-consumer"));
    let name = config.connection_name().unwrap().to_owned();
    let t = Arc::new(AmqpTransport::connect(config).await.unwrap());
    t.provision(&plan).await.unwrap();
    // The broker sees a TLS connection.
    assert_eq!(connection(&name), ["guest", "PLAIN", "true"]);

    let runs = Runs::default();
    let r = runs.clone();
    let running = start(
        Arc::clone(&t),
        policy,
        move |m: Message| {
            let n = r.next(&m);
            let id = m.properties().message_id.clone().unwrap_or_default();
            async move {
                match (id.as_str(), n) {
                    ("retried", 1) => Err(HandlerError::transient("down once")),
                    ("parked", _) => Err(HandlerError::permanent("never valid")),
                    _ => Ok(()),
                }
            }
        },
        &q,
        |b| b,
    );
    let (conn, ch) = raw(&node).await;
    for id in ["handled", "retried", "parked"] {
        common::publish(&ch, &q, id.as_bytes(), id).await;
    }
    let parked = wait_get(&ch, plan.parking_queue(), ms(15_000)).await;
    assert!(running.until(ms(15_000), |t| t.len() == 4).await);
    assert_eq!(running.of("handled"), [Terminal::Handled { attempt: 1 }]);
    assert_eq!(
        running.of("retried"),
        [
            Terminal::Retried {
                attempts: 1,
                delay: ms(300)
            },
            Terminal::Handled { attempt: 2 }
        ]
    );
    assert_eq!(running.of("parked").len(), 1);
    let report = running.stop().await;
    assert_eq!(report.handled, 2);

    let parked = parked.expect("the permanent failure is parked");
    assert_eq!(parked.message_id.as_deref(), Some("parked"));
    let record = ParkedRecord::decode(&parked.headers);
    assert_eq!(record.reason, Some(DeadLetterReason::Permanent));
    assert_eq!(record.last_error, Some("never valid"));
    assert_eq!(common::message_count(&ch, &q).await.unwrap(), 0);
    assert_eq!(
        common::message_count(&ch, plan.parking_queue())
            .await
            .unwrap(),
        0
    );
    assert_eq!(runs.0.lock().unwrap()["retried"], 2);
    (*t).close().await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn a_client_certificate_logs_in_with_external_as_its_common_name() {
    let Some(node) = tls_node("mutual TLS with EXTERNAL") else {
        return;
    };
    let identity = trusting_the_ca(&node)
        .with_client_identity(node.cert("client.pem"), node.cert("client.key"));
    // No user or password in the URL: the certificate is the login.
    let config = AmqpConfig::new(format!("amqps://localhost:{}/%2f", node.tls_port))
        .with_tls(identity.clone())
        .with_external_auth()
        .with_connection_name(unique("tls-external"));
    let name = config.connection_name().unwrap().to_owned();
    let t = AmqpTransport::connect(config).await.unwrap();
    let q = unique("tls-external");
    // The user may use the broker: a queue declared and deleted through the transport.
    let ch = t.connection().create_channel().await.unwrap();
    ch.queue_declare(q.as_str().into(), Default::default(), Default::default())
        .await
        .unwrap();
    ch.queue_delete(q.as_str().into(), Default::default())
        .await
        .unwrap();
    assert_eq!(
        connection(&name),
        [node.client_cn.as_str(), "EXTERNAL", "true"]
    );
    t.close().await.unwrap();

    // The same certificate beside a password login: presented in the handshake only.
    let config = AmqpConfig::new(format!(
        "amqps://guest:guest@localhost:{}/%2f",
        node.tls_port
    ))
    .with_tls(identity)
    .with_connection_name(unique("tls-plain-login"));
    let name = config.connection_name().unwrap().to_owned();
    let t = AmqpTransport::connect(config).await.unwrap();
    assert_eq!(connection(&name), ["guest", "PLAIN", "true"]);
    t.close().await.unwrap();
}

const PASSWORD: &str = "tls-refusal-secret-9157";

fn url(host: &str, port: u16) -> String {
    format!("amqps://guest:{PASSWORD}@{host}:{port}/%2f")
}

#[tokio::test]
async fn a_server_certificate_from_an_unknown_ca_is_refused() {
    let Some(node) = tls_node("TLS refusal: unknown CA") else {
        return;
    };
    let config = AmqpConfig::new(url("localhost", node.tls_port))
        .with_tls(TlsConfig::new().with_ca_file(node.cert("other-ca.pem")));
    let err = refused(config).await;
    let endpoint = format!("localhost:{}", node.tls_port);
    assert_tls(&err, &endpoint, &TlsFailure::UnknownIssuer, PASSWORD, &node);
}

#[tokio::test]
async fn a_certificate_for_another_name_is_refused_unless_the_name_is_overridden() {
    let Some(node) = tls_node("TLS refusal: wrong host name") else {
        return;
    };
    // The node's certificate names `localhost` only.
    let config = AmqpConfig::new(url("127.0.0.1", node.tls_port)).with_tls(trusting_the_ca(&node));
    let err = refused(config).await;
    let endpoint = format!("127.0.0.1:{}", node.tls_port);
    let want = TlsFailure::WrongHostName {
        name: "127.0.0.1".into(),
    };
    assert_tls(&err, &endpoint, &want, PASSWORD, &node);

    let config = AmqpConfig::new(format!(
        "amqps://guest:guest@127.0.0.1:{}/%2f",
        node.tls_port
    ))
    .with_tls(trusting_the_ca(&node).with_server_name("localhost"))
    .with_auto_recover(false);
    let t = AmqpTransport::connect(config)
        .await
        .expect("the certificate is valid for the overriding name");
    t.close().await.unwrap();

    // A name the certificate does not hold is refused under that name.
    let config = AmqpConfig::new(url("localhost", node.tls_port))
        .with_tls(trusting_the_ca(&node).with_server_name("rabbit.example"));
    let err = refused(config).await;
    let want = TlsFailure::WrongHostName {
        name: "rabbit.example".into(),
    };
    let endpoint = format!("localhost:{}", node.tls_port);
    assert_tls(&err, &endpoint, &want, PASSWORD, &node);
}

/// A TLS server on 127.0.0.1 presenting `expired.pem` (signed by the node's CA, for
/// `localhost`, valid in January 2020 only); its port.
async fn expired_server(node: &TlsNode) -> (u16, tokio::task::JoinHandle<()>) {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let certs = CertificateDer::pem_file_iter(node.cert("expired.pem"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(node.cert("expired.key")).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let serving = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // The client refuses the certificate: the handshake fails here too.
                let _ = acceptor.accept(tcp).await;
            });
        }
    });
    (port, serving)
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let Some(node) = tls_node("TLS refusal: expired certificate") else {
        return;
    };
    let (port, serving) = expired_server(&node).await;
    let config = AmqpConfig::new(url("localhost", port)).with_tls(trusting_the_ca(&node));
    let err = refused(config).await;
    serving.abort();
    assert_tls(
        &err,
        &format!("localhost:{port}"),
        &TlsFailure::Expired,
        PASSWORD,
        &node,
    );
}

#[tokio::test]
async fn a_plain_port_given_as_amqps_is_refused_never_spoken_to_in_plain_tcp() {
    let Some(node) = tls_node("TLS refusal: plain port") else {
        return;
    };
    let config =
        AmqpConfig::new(url("localhost", node.plain_port)).with_tls(trusting_the_ca(&node));
    let err = refused(config).await;
    let endpoint = format!("localhost:{}", node.plain_port);
    assert_tls(&err, &endpoint, &TlsFailure::NotTls, PASSWORD, &node);
}

#[tokio::test]
async fn a_client_certificate_the_server_does_not_trust_is_refused_by_the_server() {
    let Some(node) = tls_node("TLS refusal by the server") else {
        return;
    };
    // expired.pem as a client certificate: signed by the CA, but expired.
    let config = AmqpConfig::new(url("localhost", node.tls_port)).with_tls(
        trusting_the_ca(&node)
            .with_client_identity(node.cert("expired.pem"), node.cert("expired.key")),
    );
    let err = refused(config).await;
    let TransportError::Tls {
        failure: TlsFailure::RefusedByServer { alert },
        ..
    } = &err
    else {
        panic!("not a refusal by the server: {err:?}");
    };
    let want = TlsFailure::RefusedByServer {
        alert: alert.clone(),
    };
    assert_tls(
        &err,
        &format!("localhost:{}", node.tls_port),
        &want,
        PASSWORD,
        &node,
    );
    assert!(!alert.is_empty());
}

#[tokio::test]
async fn unusable_tls_settings_are_refused_naming_the_file_or_setting() {
    let Some(node) = tls_node("TLS refusal: settings") else {
        return;
    };
    let endpoint = format!("localhost:{}", node.tls_port);
    let configuration = |err: &TransportError| match err {
        TransportError::Tls {
            failure: TlsFailure::Configuration { file, reason },
            ..
        } => (file.clone(), reason.clone()),
        other => panic!("not a configuration refusal: {other:?}"),
    };

    let missing = node.cert("no-such-ca.pem");
    let config = AmqpConfig::new(url("localhost", node.tls_port))
        .with_tls(TlsConfig::new().with_ca_file(&missing));
    let err = refused(config).await;
    let (file, reason) = configuration(&err);
    assert_eq!(file, missing.display().to_string());
    assert!(reason.contains("cannot be read"), "{reason}");
    assert_tls(
        &err,
        &endpoint,
        &TlsFailure::Configuration { file, reason },
        PASSWORD,
        &node,
    );

    // A key that does not go with the certificate, and a key file given as the CA.
    for (tls, named) in [
        (
            trusting_the_ca(&node)
                .with_client_identity(node.cert("client.pem"), node.cert("expired.key")),
            node.cert("expired.key"),
        ),
        (
            TlsConfig::new().with_ca_file(node.cert("client.key")),
            node.cert("client.key"),
        ),
    ] {
        let config = AmqpConfig::new(url("localhost", node.tls_port)).with_tls(tls);
        let err = refused(config).await;
        let (file, reason) = configuration(&err);
        assert_eq!(Path::new(&file), named, "{reason}");
        assert_tls(
            &err,
            &endpoint,
            &TlsFailure::Configuration { file, reason },
            PASSWORD,
            &node,
        );
    }

    // TLS settings with a plain URL, and EXTERNAL without a certificate: refused, not
    // ignored.
    let plain_url = format!("amqp://guest:{PASSWORD}@127.0.0.1:{}/%2f", node.plain_port);
    let err = refused(AmqpConfig::new(&plain_url).with_tls(trusting_the_ca(&node))).await;
    assert_eq!(configuration(&err).0, "the URL");
    let err = refused(
        AmqpConfig::new(url("localhost", node.tls_port))
            .with_tls(trusting_the_ca(&node))
            .with_external_auth(),
    )
    .await;
    assert_eq!(configuration(&err).0, "the client certificate");
    assert!(!format!("{err} {err:?}").contains(PASSWORD));
}
