//! Chaos with a journal per message: consumer processes on the real broker (a private
//! RabbitMQ node, over AMQP 0-9-1 or AMQP 1.0) are SIGKILLed, have their connections closed
//! by the broker and live through a `stop_app`/`start_app`, while one shared journal records
//! every delivery, handler run, publish and its confirm, settlement and terminal of every
//! message. At the end every message must be handled or parked as its script says; a
//! message that is neither is reported with its whole journal, so that a loss names its
//! last step.
//!
//! * [`script`]: what each message does, written into its id.
//! * [`journal`]: the journal's format, writer and reader.
//! * [`transport`]: the transport wrapper that journals deliveries, publishes and settles.
//! * [`consumer`]: the `chaos_consumer` process.
//! * [`node`]: the private node (`stress/chaos-node.sh`).
//! * [`driver`]: publishing, the fault schedule, the wait, the drain.
//! * [`reconcile`]: what became of every message.
//! * [`soak`]: chaos for a set time with one consumer's RSS, descriptors and threads
//!   sampled, judged and drawn.
//!
//! The full run is the `chaos` binary (`cargo run -p stress --bin chaos -- --help`);
//! `tests/chaos.rs` is the bounded version CI runs. The soak is the `soak` binary.

pub mod consumer;
pub mod driver;
pub mod journal;
pub mod node;
pub mod reconcile;
pub mod script;
pub mod soak;
pub mod transport;
