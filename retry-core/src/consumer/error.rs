//! `ConsumerError`: why a consumer run stopped early.

use crate::EngineError;
use crate::transport::TransportError;

/// Why a consumer run stopped early.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Declaring the topology plan failed.
    #[error("provisioning the topology of queue {queue:?} failed")]
    Provision {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Verifying the topology plan failed, with provisioning turned off
    /// ([`ConsumerBuilder::with_provision`](crate::ConsumerBuilder::with_provision)): something the
    /// engine sends to is missing (see [`Transport::verify`](crate::Transport::verify)), or the broker could not be
    /// asked. Nothing was consumed.
    #[error("verifying the topology of queue {queue:?} (provisioning is off) failed")]
    Verify {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Starting to consume failed in a way that trying again cannot fix (the queue does not
    /// exist, say); lost connections and timeouts are retried instead.
    #[error("starting to consume queue {queue:?} failed")]
    Consume {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Receiving failed in a way that trying again cannot fix (lost connections and
    /// timeouts are retried instead). Deliveries already held were finished first.
    #[error("receiving from queue {queue:?} failed")]
    Receive {
        /// The work queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// Taking suspects from the isolation queue failed in a way that trying again cannot
    /// fix (the queue does not exist, say). Deliveries already held were finished first.
    #[error("taking suspects from the isolation queue {queue:?} failed")]
    Isolation {
        /// The isolation queue.
        queue: String,
        /// The transport's error.
        source: TransportError,
    },
    /// The engine refused an input: a bug in the driver, never a broker condition.
    #[error("the retry engine refused the consumer's input")]
    Engine(#[from] EngineError),
}
