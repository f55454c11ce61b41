//! The local three-node RabbitMQ cluster of `stress/cluster.sh`, for the tests that stop and
//! kill nodes.

use std::process::Command;

use crate::env::{cluster_urls, stress_script};

/// The environment variable with the test cluster's node list (`stress/cluster.sh urls`).
pub const CLUSTER_URLS: &str = "AMQP_CLUSTER_URLS";

/// The test cluster's node URLs from [`CLUSTER_URLS`], or `None` after a loud notice that
/// `what` is skipped. With [`REQUIRE_CLUSTER`](crate::REQUIRE_CLUSTER) set (as CI sets it)
/// a missing list panics.
///
/// ```no_run
/// let Some(urls) = test_brokers::rabbitmq::cluster("my cluster test") else {
///     return;
/// };
/// assert_eq!(urls.len(), 3);
/// ```
pub fn cluster(what: &str) -> Option<Vec<String>> {
    cluster_urls(CLUSTER_URLS, crate::REQUIRE_CLUSTER, "cluster.sh", what)
}

/// Runs the workspace's `stress/cluster.sh` with `args` (`stop rtest1`, `kill rtest2`,
/// `start-all`, ...) and panics with its output if it fails. Blocking: call it from
/// `spawn_blocking` in async code.
///
/// ```no_run
/// test_brokers::rabbitmq::cluster_sh(&["stop", "rtest1"]);
/// test_brokers::rabbitmq::cluster_sh(&["start", "rtest1"]);
/// ```
pub fn cluster_sh(args: &[&str]) {
    if let Err(e) = try_cluster_sh(args) {
        panic!("{e}");
    }
}

/// Runs `stress/cluster.sh` with `args` as [`cluster_sh`] does, returning its failure
/// (the command and what it printed) instead of panicking.
///
/// ```no_run
/// if let Err(e) = test_brokers::rabbitmq::try_cluster_sh(&["kill", "rtest2"]) {
///     eprintln!("{e}");
/// }
/// ```
pub fn try_cluster_sh(args: &[&str]) -> Result<(), String> {
    let out = cluster_script(args)
        .output()
        .map_err(|e| format!("stress/cluster.sh {args:?} did not run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "stress/cluster.sh {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// The test cluster for one test at a time (tests that stop and kill nodes must not overlap
/// within a test binary): every node is started when the lease is taken and again when it
/// is dropped, passed or failed, so that one test's failure never becomes the next one's.
///
/// ```no_run
/// # async fn f() {
/// let _lease = test_brokers::rabbitmq::ClusterLease::take().await;
/// // ... stop and kill nodes ...
/// # }
/// ```
#[derive(Debug)]
pub struct ClusterLease {
    _one: tokio::sync::MutexGuard<'static, ()>,
}

impl ClusterLease {
    /// Waits for the other tests of this process to give the cluster back, then starts
    /// every node.
    pub async fn take() -> Self {
        static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
        let one = ONE_AT_A_TIME.lock().await;
        tokio::task::spawn_blocking(|| cluster_sh(&["start-all"]))
            .await
            .expect("stress/cluster.sh start-all");
        ClusterLease { _one: one }
    }
}

impl Drop for ClusterLease {
    /// Starts every node again; a failure is not reported (a `Drop` must not panic, and the
    /// next lease starts them anyway).
    fn drop(&mut self) {
        let _ = cluster_script(&["start-all"]).output();
    }
}

/// The workspace's `stress/cluster.sh` with `args`, ready to run.
fn cluster_script(args: &[&str]) -> Command {
    let mut command = Command::new("bash");
    command.arg(stress_script("cluster.sh")).args(args);
    command
}
