//! Why a simulation could not be built or fed.

use retry_core::{ConsumerConfigError, TopologyError};

use crate::broker::error::BrokerError;

/// Why a simulation could not be built or fed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimulationError {
    /// The topology plan could not be made.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The consumer settings were refused.
    #[error(transparent)]
    Consumer(#[from] ConsumerConfigError),
    /// The broker refused an operation.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A message with this id was already published: the simulation follows messages by id.
    #[error("a message with id {0:?} was already published; ids must be unique")]
    DuplicateId(String),
    /// The broker did not take a publish.
    #[error("publishing {id:?} was not confirmed: {confirm:?}")]
    NotConfirmed {
        /// The message.
        id: String,
        /// The broker's answer.
        confirm: retry_core::Confirm,
    },
}
