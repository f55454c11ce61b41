//! The work queue and policy file every topology command takes, and the plan the
//! transport's [`Layout`](retry_core::Layout) makes of them.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use retry_core::{PlanError, PlanOption, PlanOptions, QueueType, RetryPolicy, TopologyPlan};

use crate::broker::Broker;
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

    /// Quorum queues instead of classic ones (the default when `--url` names several
    /// nodes).
    #[arg(long, conflicts_with = "classic")]
    pub quorum: bool,

    /// Classic queues, even on a cluster.
    #[arg(long)]
    pub classic: bool,

    /// On how many nodes each queue is replicated when it is created: a quorum queue's
    /// `x-quorum-initial-group-size`, a NATS stream's replicas.
    #[arg(long, value_name = "NODES", conflicts_with = "classic")]
    pub replication_factor: Option<u32>,
}

impl PlanArgs {
    /// The options these arguments give, with `max_probe_ttl` for `topology verify`.
    pub fn options(&self, max_probe_ttl: Option<Duration>) -> PlanOptions {
        let mut options = PlanOptions::new();
        if self.quorum {
            options = options.with_queue_type(QueueType::Quorum);
        } else if self.classic {
            options = options.with_queue_type(QueueType::Classic);
        }
        if let Some(nodes) = self.replication_factor {
            options = options.with_replication_factor(nodes);
        }
        if let Some(ttl) = max_probe_ttl {
            options = options.with_max_probe_ttl(ttl);
        }
        options
    }

    /// Reads the policy file and has the transport that speaks `broker`'s URL lay out the
    /// plan. A file that cannot be read, does not parse, has an unknown key or an invalid
    /// value is a usage error naming the file (and, for TOML, the line); so is an option
    /// the transport does not take, named by its flag.
    pub fn plan(&self, broker: &Broker, options: &PlanOptions) -> Result<TopologyPlan, CliError> {
        let registration = broker.registration()?;
        let policy = load_policy(&self.policy)?;
        registration
            .layout()
            .plan(broker.url(), &self.queue, &policy, options)
            .map_err(plan_error)
    }
}

/// The flag that sets `option`.
fn flag(option: PlanOption) -> &'static str {
    match option {
        PlanOption::Quorum => "--quorum",
        PlanOption::Classic => "--classic",
        PlanOption::ReplicationFactor => "--replication-factor",
        PlanOption::MaxProbeTtl => "--max-probe-ttl",
    }
}

/// A layout's refusal, naming the flag: a usage error.
fn plan_error(e: PlanError) -> CliError {
    match e {
        PlanError::Unsupported {
            option,
            transport,
            why,
        } => CliError::usage(format!(
            "{} does not apply on {transport}: {why}",
            flag(option)
        )),
        PlanError::OutOfRange {
            option, value, why, ..
        } => CliError::usage(format!("{} {value}: {why}", flag(option))),
        e => CliError::usage(e),
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
