//! TLS on a real broker, the private node of `stress/tls-node.sh` (skipped loudly without it,
//! mandatory with `REQUIRE_TLS`): a consumer over `amqps://` with the node's CA, mutual TLS,
//! and each refusal as a typed error that names the check and shows neither the password
//! nor key material. Before those, `amqps://` URLs are shown to speak TLS from the first
//! byte, against a local listener that records what the client sends first.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::BasicProperties;
use retry_core::{
    Consumer, HandlerError, Message, RetryPolicy, TlsConfig, TlsFailure, TopologyPlan,
    TransportError,
};
use test_brokers::rabbitmq::{TlsNode, tls_node};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use transport_amqp10::{Amqp10Config, Amqp10Transport};

use common::{Broker, broker_at, unique};

/// The password of every URL a refusal test gives: it must appear in no error.
const PASSWORD: &str = "Tl5-N0t-Sh0wn-7731";

async fn first_bytes(scheme: &str) -> (Vec<u8>, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buf = vec![0u8; 8];
        let _ = tokio::time::timeout(Duration::from_secs(5), socket.read_exact(&mut buf)).await;
        buf
    });
    let config = Amqp10Config::new(format!("{scheme}://app:T0pS3cret@localhost:{port}"))
        .with_connect_timeout(Duration::from_secs(1));
    let err = Amqp10Transport::connect(config)
        .await
        .expect_err("nothing answers");
    let seen = server.await.expect("server");
    (seen, format!("{err} {err:?}"))
}

#[tokio::test]
async fn amqps_starts_with_a_tls_client_hello() {
    let (seen, err) = first_bytes("amqps").await;
    assert_eq!(seen[0], 0x16, "a TLS handshake record, got {seen:?}");
    assert_eq!(seen[1], 0x03, "TLS version major 3, got {seen:?}");
    assert!(!err.contains("T0pS3cret"), "{err}");
}

#[tokio::test]
async fn amqp_starts_with_the_sasl_protocol_header() {
    let (seen, err) = first_bytes("amqp").await;
    assert_eq!(seen, b"AMQP\x03\x01\x00\x00", "SASL protocol header");
    assert!(!err.contains("T0pS3cret"), "{err}");
}

/// The node's CA, and nothing else, trusted.
fn trusting_the_node(node: &TlsNode) -> TlsConfig {
    TlsConfig::new().with_ca_file(node.cert("ca.pem"))
}

fn config(url: String, tls: TlsConfig) -> Amqp10Config {
    Amqp10Config::new(url)
        .with_tls(tls)
        .with_connect_timeout(Duration::from_secs(5))
        .with_publish_timeout(Duration::from_secs(2))
}

/// The lines of base64 of every key file of the node's certificates: none may appear in
/// an error or a log line.
fn key_material(node: &TlsNode) -> Vec<String> {
    ["client.key", "expired.key", "server.key", "other-ca.key"]
        .iter()
        .flat_map(|file| {
            let pem = std::fs::read_to_string(node.cert(file)).expect("key file");
            pem.lines()
                .filter(|l| !l.starts_with("-----") && l.len() > 20)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Connects to `url` with `tls`, expects a TLS refusal and returns its failure, after
/// checking that neither the password nor key material shows.
async fn refusal(node: &TlsNode, url: String, tls: TlsConfig) -> (String, TlsFailure) {
    assert!(url.contains(PASSWORD));
    let config = config(url, tls);
    let shown_config = format!("{config:?}");
    let err = Amqp10Transport::connect(config)
        .await
        .expect_err("the connection is refused");
    let shown = format!("{err} | {err:?} | {shown_config}");
    assert!(!shown.contains(PASSWORD), "the password shows: {shown}");
    for line in key_material(node) {
        assert!(!shown.contains(&line), "key material shows: {shown}");
    }
    match err {
        TransportError::Tls { endpoint, failure } => (endpoint, failure),
        other => panic!("not a TLS refusal: {other:?}"),
    }
}

fn tls_url(user: &str, host: &str, port: u16) -> String {
    format!("amqps://{user}:{PASSWORD}@{host}:{port}")
}

async fn handle(msg: Message) -> Result<(), HandlerError> {
    match msg.body() {
        b"ok" => Ok(()),
        b"flaky" if msg.headers().get("x-retry-attempts").is_none() => {
            Err(HandlerError::transient("first try fails"))
        }
        b"flaky" => Ok(()),
        _ => Err(HandlerError::permanent("unreadable")),
    }
}

/// The TLS node over plain AMQP 0-9-1, to declare, publish and look.
async fn plain(node: &TlsNode) -> Broker {
    broker_at(&format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        node.plain_port
    ))
    .await
    .expect("the TLS node's plain port")
}

#[tokio::test]
async fn a_consumer_over_amqps_handles_retries_and_parks() {
    let Some(node) = tls_node("a consumer over amqps://") else {
        return;
    };
    let b = plain(&node).await;
    let q = unique("tls-consumer");
    let policy = RetryPolicy::delays([Duration::from_millis(500)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    for body in [&b"ok"[..], b"flaky", b"bad"] {
        b.publish(&q, body, BasicProperties::default()).await;
    }

    let transport = Amqp10Transport::connect(config(
        format!("amqps://guest:guest@localhost:{}", node.tls_port),
        trusting_the_node(&node),
    ))
    .await
    .expect("amqps:// with the node's CA");
    let finished = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(Notify::new());
    let consumer = Consumer::builder(transport, q.as_str(), policy, handle)
        .with_prefetch(5)
        .with_handler_timeout(Duration::from_secs(5))
        .with_on_terminal({
            let finished = Arc::clone(&finished);
            let done = Arc::clone(&done);
            move |_, terminal| {
                if terminal.is_final() && finished.fetch_add(1, Ordering::SeqCst) + 1 == 3 {
                    done.notify_one();
                }
            }
        })
        .build()
        .expect("consumer");
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(20), done.notified()).await;
    };
    let report = consumer.run(shutdown).await.expect("run");

    assert_eq!(finished.load(Ordering::SeqCst), 3, "{report:?}");
    assert_eq!(report.received, 4, "{report:?}");
    assert_eq!(report.handled, 2, "{report:?}");
    assert_eq!(report.retried, 1, "{report:?}");
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_eq!(
        report.requeued + report.settle_errors + report.receive_errors,
        0,
        "{report:?}"
    );
    // The broker's side: the permanent failure parked, nothing left in the work queue.
    assert_eq!(
        b.wait_ready(plan.parking_queue(), 1, Duration::from_secs(3))
            .await,
        1
    );
    assert_eq!(
        b.get(plan.parking_queue()).await.map(|(body, _)| body),
        Some(b"bad".to_vec())
    );
    assert_eq!(b.ready(&q).await, 0);
    let delay_queue = &plan.queues()[1].name;
    assert_eq!(b.ready(delay_queue).await, 0, "the retry came back");
}

#[tokio::test]
async fn mutual_tls_logs_in_as_the_client_certificate_or_with_a_password() {
    let Some(node) = tls_node("mutual TLS over amqps://") else {
        return;
    };
    let b = plain(&node).await;
    let q = unique("tls-mutual");
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&q, &policy).expect("plan");
    let _cleanup = b.declare(&plan, &[], vec![]).await;
    let identity = || {
        trusting_the_node(&node)
            .with_client_identity(node.cert("client.pem"), node.cert("client.key"))
    };

    // EXTERNAL: no user or password, the certificate's common name is the user. It logs in
    // only if the certificate was presented and accepted.
    let t = Amqp10Transport::connect(
        config(format!("amqps://localhost:{}", node.tls_port), identity()).with_external_auth(),
    )
    .await
    .expect("mutual TLS with EXTERNAL");
    t.verify(&plan).await.expect("the plan is there");
    t.close().await;

    // A certificate presented, and a PLAIN login.
    let t = Amqp10Transport::connect(config(
        format!("amqps://guest:guest@localhost:{}", node.tls_port),
        identity(),
    ))
    .await
    .expect("mutual TLS with PLAIN");
    t.verify(&plan).await.expect("the plan is there");
    t.close().await;

    // EXTERNAL without a certificate: RabbitMQ 3.10 offers it and refuses the login.
    let err = Amqp10Transport::connect(
        config(
            format!("amqps://localhost:{}", node.tls_port),
            trusting_the_node(&node),
        )
        .with_external_auth(),
    )
    .await
    .expect_err("EXTERNAL without a certificate");
    let why = std::error::Error::source(&err).map(|e| e.to_string());
    assert!(
        matches!(&err, TransportError::Connection { .. })
            && why.is_some_and(|why| why.contains("refused the SASL EXTERNAL login (Auth)")),
        "{err:?}"
    );
    // EXTERNAL on plain TCP is refused before connecting.
    let err = Amqp10Transport::connect(
        config(format!("amqp://localhost:{}", node.plain_port), identity()).with_external_auth(),
    )
    .await
    .expect_err("EXTERNAL without TLS");
    assert!(matches!(err, TransportError::Unsupported { .. }), "{err:?}");
}

#[tokio::test]
async fn a_client_certificate_the_server_does_not_trust_is_refused_by_the_server() {
    let Some(node) = tls_node("a client certificate of an unknown CA") else {
        return;
    };
    // The other CA's own certificate and key: a client identity the node cannot chain.
    let tls = trusting_the_node(&node)
        .with_client_identity(node.cert("other-ca.pem"), node.cert("other-ca.key"));
    let (endpoint, failure) =
        refusal(&node, tls_url("guest", "localhost", node.tls_port), tls).await;
    assert_eq!(endpoint, format!("localhost:{}", node.tls_port));
    // The alert when it arrives, or the connection closed right after the handshake.
    assert!(
        matches!(&failure, TlsFailure::RefusedByServer { .. }),
        "{failure:?}"
    );
    // The same over EXTERNAL, where the transport reads the broker's first answer itself.
    let tls = trusting_the_node(&node)
        .with_client_identity(node.cert("other-ca.pem"), node.cert("other-ca.key"));
    let config = config(format!("amqps://localhost:{}", node.tls_port), tls).with_external_auth();
    let err = Amqp10Transport::connect(config).await.expect_err("refused");
    assert!(
        matches!(
            &err,
            TransportError::Tls {
                failure: TlsFailure::RefusedByServer { .. },
                ..
            }
        ),
        "{err:?}"
    );
}

/// Under TLS 1.3 a server refuses a client certificate after the client's handshake has
/// ended, and RabbitMQ's alert is often lost in the reset of the connection: a server that
/// hangs up right after the handshake, before answering anything, stands for it here.
#[tokio::test]
async fn a_hang_up_right_after_presenting_a_certificate_is_a_refusal_by_the_server() {
    let Some(node) = tls_node("a TLS refusal: hang-up after the handshake") else {
        return;
    };
    let port = tls_server(&node, "server").await;
    let identity = trusting_the_node(&node)
        .with_client_identity(node.cert("client.pem"), node.cert("client.key"));
    let (endpoint, failure) =
        refusal(&node, tls_url("guest", "localhost", port), identity.clone()).await;
    assert_eq!(endpoint, format!("localhost:{port}"));
    assert!(
        matches!(&failure, TlsFailure::RefusedByServer { alert } if alert.starts_with("none received")),
        "{failure:?}"
    );
    let err = Amqp10Transport::connect(
        config(format!("amqps://localhost:{port}"), identity).with_external_auth(),
    )
    .await
    .expect_err("hung up");
    assert!(
        matches!(
            &err,
            TransportError::Tls {
                failure: TlsFailure::RefusedByServer { .. },
                ..
            }
        ),
        "{err:?}"
    );
    // Without a certificate, a hang-up is only a lost connection.
    let err = Amqp10Transport::connect(config(
        tls_url("guest", "localhost", port),
        trusting_the_node(&node),
    ))
    .await
    .expect_err("hung up");
    assert!(matches!(err, TransportError::Connection { .. }), "{err:?}");
}

#[tokio::test]
async fn a_server_certificate_of_an_unknown_ca_is_refused() {
    let Some(node) = tls_node("a TLS refusal: unknown CA") else {
        return;
    };
    let tls = TlsConfig::new().with_ca_file(node.cert("other-ca.pem"));
    let (endpoint, failure) =
        refusal(&node, tls_url("guest", "localhost", node.tls_port), tls).await;
    assert_eq!(endpoint, format!("localhost:{}", node.tls_port));
    assert_eq!(failure, TlsFailure::UnknownIssuer);
    // The public roots do not know the throwaway CA either.
    let (_, failure) = refusal(
        &node,
        tls_url("guest", "localhost", node.tls_port),
        TlsConfig::new(),
    )
    .await;
    assert_eq!(failure, TlsFailure::UnknownIssuer);
}

#[tokio::test]
async fn a_host_the_certificate_does_not_name_is_refused_unless_the_name_is_given() {
    let Some(node) = tls_node("a TLS refusal: wrong host name") else {
        return;
    };
    let (endpoint, failure) = refusal(
        &node,
        tls_url("guest", "127.0.0.1", node.tls_port),
        trusting_the_node(&node),
    )
    .await;
    assert_eq!(endpoint, format!("127.0.0.1:{}", node.tls_port));
    assert_eq!(
        failure,
        TlsFailure::WrongHostName {
            name: "127.0.0.1".into()
        }
    );
    // The name the certificate does carry, given explicitly.
    let t = Amqp10Transport::connect(config(
        format!("amqps://guest:guest@127.0.0.1:{}", node.tls_port),
        trusting_the_node(&node).with_server_name("localhost"),
    ))
    .await
    .expect("127.0.0.1 checked as localhost");
    t.close().await;
    // And a name it does not carry, given explicitly, is named in the refusal.
    let (_, failure) = refusal(
        &node,
        tls_url("guest", "localhost", node.tls_port),
        trusting_the_node(&node).with_server_name("rabbit.example"),
    )
    .await;
    assert_eq!(
        failure,
        TlsFailure::WrongHostName {
            name: "rabbit.example".into()
        }
    );
}

/// A TLS server on 127.0.0.1 presenting the node's certificate `name` (`.pem` and `.key`)
/// for `localhost`: the handshake is all it does, then it hangs up.
async fn tls_server(node: &TlsNode, name: &str) -> u16 {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(node.cert(&format!("{name}.pem")))
        .expect("certificate file")
        .collect::<Result<Vec<_>, _>>()
        .expect("certificates");
    let key = PrivateKeyDer::from_pem_file(node.cert(&format!("{name}.key"))).expect("key");
    let server = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ = acceptor.accept(socket).await;
            });
        }
    });
    port
}

#[tokio::test]
async fn an_expired_server_certificate_is_refused() {
    let Some(node) = tls_node("a TLS refusal: expired certificate") else {
        return;
    };
    let port = tls_server(&node, "expired").await;
    let (endpoint, failure) = refusal(
        &node,
        tls_url("guest", "localhost", port),
        trusting_the_node(&node),
    )
    .await;
    assert_eq!(endpoint, format!("localhost:{port}"));
    assert_eq!(failure, TlsFailure::Expired);
}

#[tokio::test]
async fn a_plain_port_given_as_amqps_is_refused_not_spoken_to_in_plain() {
    let Some(node) = tls_node("a TLS refusal: plain port") else {
        return;
    };
    let (endpoint, failure) = refusal(
        &node,
        tls_url("guest", "localhost", node.plain_port),
        trusting_the_node(&node),
    )
    .await;
    assert_eq!(endpoint, format!("localhost:{}", node.plain_port));
    assert_eq!(failure, TlsFailure::NotTls);
}

#[tokio::test]
async fn a_missing_ca_file_is_a_configuration_refusal_naming_it() {
    let Some(node) = tls_node("a TLS refusal: missing CA file") else {
        return;
    };
    let missing = node.cert("no-such-ca.pem");
    let (_, failure) = refusal(
        &node,
        tls_url("guest", "localhost", node.tls_port),
        TlsConfig::new().with_ca_file(&missing),
    )
    .await;
    match failure {
        TlsFailure::Configuration { file, reason } => {
            assert_eq!(file, missing.display().to_string());
            assert!(reason.contains("cannot be read"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // A key file given as the certificate: named, its contents not shown.
    let (_, failure) = refusal(
        &node,
        tls_url("guest", "localhost", node.tls_port),
        trusting_the_node(&node)
            .with_client_identity(node.cert("client.key"), node.cert("client.key")),
    )
    .await;
    match failure {
        TlsFailure::Configuration { file, reason } => {
            assert_eq!(file, node.cert("client.key").display().to_string());
            assert!(reason.contains("no PEM certificate"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
