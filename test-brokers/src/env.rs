//! Where the test brokers are, from the environment with loopback defaults, and names no
//! other test run uses.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// `AMQP_URL` (AMQP 0-9-1), or the local broker as guest on the default virtual host.
///
/// ```
/// let url = test_brokers::amqp_url();
/// assert!(url.starts_with("amqp"));
/// ```
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `AMQP10_URL` (AMQP 1.0: no virtual host path), or the local broker as guest.
pub fn amqp10_url() -> String {
    std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}

/// `NATS_URL`, or the local NATS server.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The `host:port` of `url` (of its first node, for a comma-separated list), credentials
/// and path left out: for a client that takes an address (a proxy, a raw publisher), and for
/// messages that must not show a password.
///
/// ```
/// let at = test_brokers::authority("amqp://guest:secret@broker:5672/%2f");
/// assert_eq!(at, "broker:5672");
/// assert_eq!(test_brokers::authority("nats://a:4222,nats://b:4222"), "a:4222");
/// ```
pub fn authority(url: &str) -> String {
    let first = url.split(',').next().unwrap_or_default().trim();
    let rest = first.split_once("://").map_or(first, |(_, rest)| rest);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// A name no other test run uses: `prefix`, this process's id, the clock's low bits and a
/// counter of this process, joined by `-` (a valid queue, exchange and NATS stream name for
/// a `prefix` of letters, digits and `-`).
///
/// ```
/// let (a, b) = (test_brokers::unique("orders"), test_brokers::unique("orders"));
/// assert!(a.starts_with("orders-") && a != b);
/// ```
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}-{}-{:x}-{}",
        std::process::id(),
        nanos & 0xffff_ffff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The comma-separated URLs in `var` (a test cluster's node list), or `None` after the skip
/// policy ([`skip`](crate::skip) under `required_by`) when it is unset or empty. `script` is the
/// `stress/` script that starts the cluster and prints its URLs.
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn cluster_urls(
    var: &str,
    required_by: &str,
    script: &str,
    what: &str,
) -> Option<Vec<String>> {
    match std::env::var(var) {
        Ok(urls) if !urls.trim().is_empty() => {
            Some(urls.split(',').map(|u| u.trim().to_owned()).collect())
        }
        _ => {
            crate::skip(
                required_by,
                what,
                &format!("no cluster ({var} is unset)"),
                &format!(
                    "Start one with `stress/{script} up` and set {var}=$(stress/{script} urls)"
                ),
            );
            None
        }
    }
}

/// The path of the workspace's `stress/` script `name` (the test clusters and nodes).
#[cfg(any(feature = "rabbitmq", feature = "nats"))]
pub(crate) fn stress_script(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../stress")
        .join(name)
}
