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
mod executor;
mod fault;
mod message;
mod queue;
mod report;
mod script;
mod simulation;
mod trace;
mod transport;

pub use broker::{Broker, BrokerBuilder, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_START, QueueStats};
pub use clock::Sleep;
pub use error::BrokerError;
pub use exchange::topic_matches;
pub use fault::FaultRates;
pub use message::{MessageKey, Outgoing, QueuedMessage};
pub use queue::{Overflow, QueueOptions};
pub use report::{ConsumerReport, ConsumerState, Fate, MessageReport, Report, Run, Stop, Totals};
pub use script::{Script, Step};
pub use simulation::{DEFAULT_HORIZON, SimEvent, Simulation, SimulationBuilder, SimulationError};
pub use trace::{DeathReason, Event, EventKind, MessageRef, PublishOutcome, Publisher, Trace};
pub use transport::{DeliveryTag, MemoryTransport};
