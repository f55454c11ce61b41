//! The local three-node NATS JetStream cluster of `stress/nats-cluster.sh`, for the
//! failover tests.

use crate::env::{cluster_urls, stress_script};

/// The environment variable with the test cluster's comma-separated URLs
/// (`stress/nats-cluster.sh urls`).
pub const CLUSTER_URLS: &str = "NATS_CLUSTER_URLS";

/// The test cluster's URLs from [`CLUSTER_URLS`], or `None` after a loud notice that `what`
/// is skipped. With [`REQUIRE_NATS_CLUSTER`](crate::REQUIRE_NATS_CLUSTER) set (as CI sets
/// it) a missing list panics.
///
/// ```no_run
/// let Some(urls) = test_brokers::nats::cluster("my NATS cluster test") else {
///     return;
/// };
/// assert_eq!(urls.len(), 3);
/// ```
pub fn cluster(what: &str) -> Option<Vec<String>> {
    cluster_urls(
        CLUSTER_URLS,
        crate::REQUIRE_NATS_CLUSTER,
        "nats-cluster.sh",
        what,
    )
}

/// Runs the workspace's `stress/nats-cluster.sh` with `args` (`kill 2`, `start 2`, ...);
/// the error says what failed. The script is killed if this future is dropped, so a test
/// that fails while it runs does not leave it restarting a node under the next test.
pub async fn try_cluster_sh(args: &[&str]) -> Result<(), String> {
    let script = stress_script("nats-cluster.sh");
    let status = tokio::process::Command::new(&script)
        .args(args)
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|e| format!("run {}: {e}", script.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!(
            "`stress/nats-cluster.sh {}` failed: {status}",
            args.join(" ")
        ))
    }
}

/// Runs `stress/nats-cluster.sh` with `args` as [`try_cluster_sh`] does, and panics if it
/// fails.
///
/// ```no_run
/// # async fn f() {
/// test_brokers::nats::cluster_sh(&["kill", "2"]).await;
/// test_brokers::nats::cluster_sh(&["start", "2"]).await;
/// # }
/// ```
pub async fn cluster_sh(args: &[&str]) {
    if let Err(e) = try_cluster_sh(args).await {
        panic!("{e}");
    }
}
