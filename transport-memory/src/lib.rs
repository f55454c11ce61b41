//! # transport-memory
//!
//! A deterministic in-memory model of RabbitMQ 3.10 with a virtual clock.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod broker;
mod clock;
mod dead_letter;
mod error;
mod exchange;
mod fault;
mod message;
mod queue;
mod trace;
mod transport;

pub use broker::{Broker, BrokerBuilder, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_START, QueueStats};
pub use clock::Sleep;
pub use error::BrokerError;
pub use exchange::topic_matches;
pub use fault::FaultRates;
pub use message::{MessageKey, Outgoing, QueuedMessage};
pub use queue::{Overflow, QueueOptions};
pub use trace::{DeathReason, Event, EventKind, MessageRef, PublishOutcome, Publisher, Trace};
pub use transport::{DeliveryTag, MemoryTransport};
