//! # transport-nats
//!
//! A NATS JetStream [`Transport`](retry_core::Transport) for the retry engine, through
//! [async-nats](https://docs.rs/async-nats). The same [`Consumer`](retry_core::Consumer),
//! policies and handlers as on RabbitMQ run unchanged on a broker with no exchanges, no
//! queue TTLs and no dead-lettering.
//!
//! ## How the plan maps
//!
//! Each queue of the [`TopologyPlan`](retry_core::TopologyPlan) is a stream that captures
//! exactly the subject named after the queue (see [`stream_name`]):
//!
//! | queue | stream | retention | consumer |
//! |---|---|---|---|
//! | work `Q` | `Q` | work queue | durable pull `retry-engine`, explicit acks |
//! | isolation `Q.suspect` | `Q_suspect` | work queue | the same; read one message at a time (a pull of 1 with `expires`) |
//! | delay `Q.retry.30s`, crash delay `Q.crash.5s` | `Q_retry_30s`, ... | work queue | the same, read by the transport's mover |
//! | parking `Q.parking` | `Q_parking` | limits (browsable) | none: tools read it by sequence |
//!
//! * **Confirms.** A clone is published with the stream's acknowledgement awaited (a
//!   PubAck), and the engine settles the original only after it. No stream for the subject
//!   is [`Returned`](retry_core::PublishResult::Returned); a full stream that discards new
//!   messages is [`Refused`](retry_core::PublishResult::Refused). Each clone carries a
//!   `Nats-Msg-Id` made of the stream and sequence it is a clone of and where it goes, so
//!   a publish repeated after a lost acknowledgement is stored once.
//! * **Delays.** A clone in a delay stream carries when it is due. The transport's mover
//!   holds a clone due within its horizon (half the ack wait, at most 5 s) and naks one due
//!   later with its time left, so the server holds it until then; once due it is published
//!   to the work queue (or, from a crash delay, the isolation queue) and acked. Every clone
//!   waits for its own delay, jitter and `retry_after` included, and none waits behind
//!   another.
//! * **Suspects.** JetStream counts each delivery of a message (`num_delivered`), a nak's
//!   as much as a crash's, so it is read as the redelivered flag: a redelivered work
//!   delivery is a suspect, and only one that comes back from the isolation queue counts a
//!   crash, as on RabbitMQ.
//! * **Long handlers.** Every unsettled delivery is kept alive with `+WPI` each third of the
//!   ack wait (one task per subscription), so the server hands a message out again only
//!   when its consumer is gone.
//! * **Settlement:** ack `+ACK`, requeue `-NAK`, reject `+TERM`. Deliveries of a
//!   subscription are acked without waiting for an answer (the subscription's
//!   [`flush`](retry_core::Subscription::flush) flushes the connection); a fetched suspect
//!   is double-acked.
//!
//! What the server's durability means for the engine is in the guide,
//! `docs/transports.md`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod codec;
mod config;
mod connection;
mod delivery;
mod header_block;
mod mover;
mod names;
mod provision;
mod pull;
mod quarantine;
mod stored;
mod subscription;
mod tag;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;

pub use codec::{
    HEADER_BLOCK_HEADER, HEADER_BLOCK_LENGTH_HEADER, UNDECODABLE_HEADER, decode_value, encode_value,
};
pub use config::{ConfigError, DEFAULT_DUPLICATE_WINDOW, NatsConfig};
pub use header_block::{ClientFailure, HeaderBlockError, HeaderBlockProblem, check_header_block};
pub use names::{CONSUMER, check_queue_name, stream_name};
pub use subscription::NatsSubscription;
pub use tag::NatsTag;
pub use transport::{MIN_SERVER_VERSION, NatsTransport};
