//! Running the built `retryctl` as an operator would, for the CLI tests.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use lapin::types::{AMQPValue, LongString};
use retry_core::{RetryPolicy, TopologyPlan};
use serde_json::Value;

const RETRYCTL: &str = env!("CARGO_BIN_EXE_retryctl");

/// A policy file with `text`, deleted when dropped.
pub struct PolicyFile(PathBuf);

impl PolicyFile {
    pub fn new(text: &str) -> Self {
        let path = std::env::temp_dir().join(format!("{}.toml", super::common::unique("retryctl")));
        std::fs::write(&path, text).unwrap();
        PolicyFile(path)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for PolicyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What a run of `retryctl` printed, and its exit code.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// Runs `retryctl args` with `AMQP_URL` set to the test broker's URL.
pub async fn retryctl(args: &[&str]) -> Run {
    retryctl_with_env(args, &super::common::amqp_url()).await
}

pub async fn retryctl_with_env(args: &[&str], amqp_url: &str) -> Run {
    let out = tokio::process::Command::new(RETRYCTL)
        .args(args)
        .env("AMQP_URL", amqp_url)
        // The protocol is the one the arguments ask for, whatever the environment says.
        .env_remove("RETRYCTL_PROTOCOL")
        .output()
        .await
        .expect("retryctl runs");
    Run {
        code: out.status.code().expect("retryctl exited"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Short delays, so that `verify`'s probes come back within a second: two delay queues and
/// a crash-delay queue.
pub const POLICY: &str = r#"max_attempts = 3
crash_delay = "300ms"

[backoff]
kind = "list"
delays = ["200ms", "500ms"]
"#;

/// The plan `POLICY` gives for `queue`, for cleaning up and breaking.
pub fn plan(queue: &str) -> TopologyPlan {
    let policy = RetryPolicy::delays([200, 500].map(Duration::from_millis))
        .with_max_attempts(3)
        .with_crash_delay(Duration::from_millis(300))
        .build()
        .unwrap();
    TopologyPlan::new(queue, &policy).unwrap()
}

/// An AMQP long string.
pub fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// Parses JSON lines (the run must have succeeded).
pub fn json_lines(run: &Run) -> Vec<Value> {
    assert_eq!(run.code, 0, "{run:?}");
    run.stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect()
}

/// The `id` of each line.
pub fn ids(lines: &[Value]) -> Vec<&str> {
    lines.iter().map(|l| l["id"].as_str().unwrap()).collect()
}
