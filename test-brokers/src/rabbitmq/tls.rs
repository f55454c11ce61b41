//! The private TLS node of `stress/tls-node.sh` and its throwaway certificates.

use crate::{REQUIRE_TLS, skip};

/// The private TLS node of `stress/tls-node.sh` and its throwaway certificates.
#[derive(Clone, Debug)]
pub struct TlsNode {
    /// The directory of `ca.pem`, `server.pem`, `client.pem`/`client.key`, `expired.pem`/
    /// `expired.key` and `other-ca.pem` (`RTLS_CERTS`, default `/tmp/retry-tls/certs`).
    pub certs: std::path::PathBuf,
    /// The node's plain-TCP port (AMQP 0-9-1 and 1.0).
    pub plain_port: u16,
    /// The node's TLS port (AMQP 0-9-1 and 1.0).
    pub tls_port: u16,
    /// The common name of `client.pem`, the user it logs in as with `EXTERNAL`.
    pub client_cn: String,
}

impl TlsNode {
    /// A file of the certificate directory.
    pub fn cert(&self, name: &str) -> std::path::PathBuf {
        self.certs.join(name)
    }
}

/// The TLS node of `stress/tls-node.sh`, or `None` after a loud notice that `what` is
/// skipped when its TLS port does not answer. With [`REQUIRE_TLS`](crate::REQUIRE_TLS) set (as CI sets it) a
/// missing node panics.
///
/// ```no_run
/// let Some(node) = test_brokers::rabbitmq::tls_node("my TLS test") else {
///     return;
/// };
/// let url = format!("amqps://guest:guest@localhost:{}/%2f", node.tls_port);
/// # drop(url);
/// ```
pub fn tls_node(what: &str) -> Option<TlsNode> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let port = |name: &str, default: &str| -> u16 {
        var(name, default)
            .parse()
            .unwrap_or_else(|e| panic!("{name}: not a port: {e}"))
    };
    let node = TlsNode {
        certs: var("RTLS_CERTS", "/tmp/retry-tls/certs").into(),
        plain_port: port("RTLS_PLAIN_PORT", "5675"),
        tls_port: port("RTLS_TLS_PORT", "5676"),
        client_cn: var("RTLS_CLIENT_CN", "retry-tls-client"),
    };
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], node.tls_port));
    let answers =
        std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2)).is_ok();
    if answers && node.cert("ca.pem").is_file() {
        return Some(node);
    }
    skip(
        REQUIRE_TLS,
        what,
        &format!(
            "no TLS node on {addr} with certificates in {}",
            node.certs.display()
        ),
        "Start one with `stress/tls-node.sh up`",
    );
    None
}
