//! `amqps://` URLs speak TLS from the first byte, with the password nowhere in the error.
//! A local listener stands in for the broker: it records what the client sends first.

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use transport_amqp10::{Amqp10Config, Amqp10Transport};

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
