//! Running the built `retryctl` as an operator would, for the CLI tests.

#![allow(dead_code)]

use std::path::PathBuf;

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
    retryctl_with_env(args, &super::common::url()).await
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
