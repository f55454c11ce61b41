//! The work queue and policy file every topology command takes, and the plan they make.

use std::path::PathBuf;

use clap::Args;
use retry_core::{QueueRole, QueueType, RetryPolicy, TopologyPlan};
use transport_amqp091::AmqpConfig;

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

    /// Quorum only: on how many nodes each queue is replicated when it is created
    /// (`x-quorum-initial-group-size`).
    #[arg(long, value_name = "NODES", conflicts_with = "classic")]
    pub replication_factor: Option<u32>,
}

impl PlanArgs {
    /// Reads the policy file and computes the plan. A file that cannot be read, does not
    /// parse, has an unknown key or an invalid value is a usage error naming the file (and,
    /// for TOML, the line).
    ///
    /// The queues are quorum queues with `--quorum` or `--replication-factor`, classic ones
    /// with `--classic`, and otherwise what `url` calls for: quorum for a list of nodes,
    /// classic for one ([`AmqpConfig::queue_type`]).
    pub fn plan(&self, url: &str) -> Result<TopologyPlan, CliError> {
        let policy = load_policy(&self.policy)?;
        let queue_type = if self.quorum || self.replication_factor.is_some() {
            QueueType::Quorum
        } else if self.classic {
            QueueType::Classic
        } else {
            AmqpConfig::new(url).queue_type()
        };
        let mut builder = TopologyPlan::builder(&self.queue, &policy).with_queue_type(queue_type);
        if let Some(nodes) = self.replication_factor {
            builder = builder.with_replication_factor(nodes);
        }
        builder
            .build()
            .map_err(|e| CliError::usage_from(format!("no plan for queue {:?}", self.queue), e))
    }
}

impl PlanArgs {
    /// The plan on NATS JetStream, and on how many servers each stream is kept: NATS has no
    /// queue types, so `--quorum` and `--classic` are usage errors; `--replication-factor N`
    /// is the streams' replica count (1 to 5, JetStream's range), 1 without it. A queue
    /// name that cannot be a NATS subject (a wildcard, an empty token) is a usage error too.
    pub fn nats_plan(&self) -> Result<(TopologyPlan, usize), CliError> {
        if self.quorum || self.classic {
            let flag = if self.quorum { "--quorum" } else { "--classic" };
            return Err(CliError::usage(format!(
                "{flag} does not apply on NATS JetStream: queue types are RabbitMQ's, and \
                 every queue is a stream; --replication-factor N keeps each stream on N \
                 servers"
            )));
        }
        let replicas = match self.replication_factor {
            None => 1,
            Some(n @ 1..=5) => n as usize,
            Some(n) => {
                return Err(CliError::usage(format!(
                    "--replication-factor {n}: a NATS JetStream stream has 1 to 5 replicas"
                )));
            }
        };
        let policy = load_policy(&self.policy)?;
        let plan = TopologyPlan::builder(&self.queue, &policy)
            .build()
            .map_err(|e| CliError::usage_from(format!("no plan for queue {:?}", self.queue), e))?;
        for queue in plan.queues() {
            transport_nats::check_queue_name(&queue.name).map_err(|e| {
                CliError::usage_from(format!("no plan for queue {:?} on NATS", self.queue), e)
            })?;
        }
        Ok((plan, replicas))
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

/// The TTL of a queue whose messages wait, if it is one.
pub fn role_ttl(role: QueueRole) -> Option<std::time::Duration> {
    match role {
        QueueRole::Delay { ttl }
        | QueueRole::CrashDelay { ttl }
        | QueueRole::CascadeLevel { ttl, .. } => Some(ttl),
        QueueRole::Work | QueueRole::Isolation | QueueRole::Parking => None,
    }
}
