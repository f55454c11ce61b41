//! The work queue and policy file every topology command takes, and the plan they make.

use std::path::PathBuf;

use clap::Args;
use retry_core::{QueueType, RetryPolicy, TopologyPlan};

use crate::error::CliError;

/// A work queue, its policy file and its queue type.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The work queue, e.g. `comments`.
    #[arg(value_name = "QUEUE")]
    pub queue: String,

    /// The retry policy, a TOML file as `retry_core::RetryPolicy` reads it (`max_attempts`,
    /// `[backoff]` with `kind`, ...). Unknown keys are refused.
    #[arg(long, value_name = "FILE")]
    pub policy: PathBuf,

    /// Quorum queues instead of classic ones.
    #[arg(long)]
    pub quorum: bool,
}

impl PlanArgs {
    /// Reads the policy file and computes the plan. A file that cannot be read, does not
    /// parse, has an unknown key or an invalid value is a usage error naming the file (and,
    /// for TOML, the line).
    pub fn plan(&self) -> Result<TopologyPlan, CliError> {
        let policy = load_policy(&self.policy)?;
        let queue_type = if self.quorum {
            QueueType::Quorum
        } else {
            QueueType::Classic
        };
        TopologyPlan::builder(&self.queue, &policy)
            .with_queue_type(queue_type)
            .build()
            .map_err(|e| CliError::usage_from(format!("no plan for queue {:?}", self.queue), e))
    }
}

/// The policy in the TOML file at `path`.
pub fn load_policy(path: &std::path::Path) -> Result<RetryPolicy, CliError> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::usage_from(format!("cannot read policy file {shown}"), e))?;
    // toml's message names the line and column, and shows the line.
    toml::from_str::<RetryPolicy>(&text)
        .map_err(|e| CliError::usage_from(format!("policy file {shown}"), e))
}
