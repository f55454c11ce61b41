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
//!   PubAck), and the engine settles the original only after it. A publish no stream answers
//!   ("no responders") is [`Returned`](retry_core::PublishResult::Returned) only if the
//!   server says the stream does not exist; otherwise (a restarted server restoring its
//!   streams answers so) it failed, and is tried again. A full stream that discards new
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
//!   is double-acked. One whose double ack fails is naked and brought back by the next fetch
//!   of its queue (the consumer's claim of it, before any work), unless the server did take
//!   the ack. A fetch whose message may have been lost in flight fails with
//!   [`FetchLost`](retry_core::TransportError::FetchLost).
//! * **Watching the isolation queue.** [`ready`](retry_core::Transport::ready) answers for a
//!   message handed out and not acked (another process's suspect) only when it could have
//!   been handed out again: an ack wait after its delivery, then once per ack wait while
//!   nothing changes, not every poll.
//! * **Counts.** [`count`](NatsTransport::count) first purges copies of acked messages
//!   that a killed server left below the consumer's ack floor (never delivered again), as
//!   the transport also does after each reconnection.
//!
//! * **Two connections.** Pulls run on a connection of their own, with the acks and
//!   keep-alives of a subscription's deliveries; publishes and API requests on the other.
//!   Only pulls bring stored messages in, so a message that takes a connection down (next)
//!   takes down the pulling one only: publishing clones and parking go on.
//!
//! ## Operators' tools
//!
//! [`NatsTransport`] implements [`Admin`](retry_core::Admin), what `retryctl` asks of a
//! broker: a queue's depth (its stream's [`count`](NatsTransport::count)), applying a plan
//! (its streams and consumers, each reported created or verified) and checking the server
//! against it object by object (nothing is probed: the server holds the delays itself).
//! [`NatsLayout`] lays a plan out as streams without connecting (refusing queue types and a
//! probe TTL, taking a replication factor as the streams' replicas), and
//! [`registration`] hands out both.
//!
//! ## Messages async-nats cannot read
//!
//! async-nats 0.49 parses every incoming message's header block on its connection's task,
//! before anything else can look at it, and nats-server stores whatever bytes a producer's
//! `HPUB` carries. [`check_header_block`] says, for a stored block, what the client does with
//! it and why (the line, byte and header at fault):
//!
//! * a block that is not UTF-8, a first line that is not `NATS/1.0` or has no valid
//!   status, a line without a colon, a header name with a character other than printable
//!   ASCII: **the client fails its connection** and reconnects
//!   ([`ClientFailure::ConnectionLost`]);
//! * a header value holding a bare carriage return: **the client's connection task
//!   panics**, and the client never works again ([`ClientFailure::ClientDies`]); the
//!   transport replaces its pulling connection when a pull finds it dead;
//! * a first line with a status other than 200 (`NATS/1.0 408`): a pull of async-nats'
//!   would **read it as the server's word about the pull** ([`ClientFailure::ReadAsStatus`]);
//!   the transport's pulls tell a stored message (it carries its ack subject as reply) from
//!   the server's status, and report it.
//!
//! Such a message is handed out to the consumer that pulled it and stays so: it would come
//! back after each ack wait and do the same again, forever. So the transport **sweeps**:
//! after every (re)connection of its pulling connection, when a pull finds a misread
//! message, and before it first reads a queue, it reads every message each queue's consumer
//! has handed out and not had acked (from the ack floor to the last delivered sequence)
//! with the stream's `MSG.GET` API by hand (JSON, the block in base64, never parsed by the
//! client), and parks each one the client cannot read: a copy goes to the plan's parking
//! queue with the original payload, `x-retry-reason: malformed`, why in
//! [`UNDECODABLE_HEADER`], the block byte for byte in [`HEADER_BLOCK_HEADER`] (hex), the
//! queue in `x-retry-origin-queue` and a `Nats-Msg-Id` naming the stream, sequence and store
//! time; once the parking stream has acknowledged it, the original is deleted. A crash
//! between the two leaves a second parked copy, never a loss.
//!
//! What it costs: **one lost pulling connection per such message per process** (none for a
//! misread status, none for one a process before this one died holding: the sweep before
//! the first read parks it), and the pull it came in: the messages that came with it are
//! handed out to a connection that is gone, and come back after the ack wait, redelivered,
//! so each runs alone once as a suspect. Its limits: a message never yet pulled is not
//! looked at before it is; a queue that belongs to no plan this transport provisioned or
//! verified has no parking queue, and its unreadable message is left where it is, with an
//! error in the log, to fail every connection that pulls it; a sweep reads one message per
//! request (about 55 µs each on loopback), and a delay stream's handed-out range holds
//! every clone waiting for its time. A [walk](retry_core::Transport::walk) hands such a
//! message out with why and its block as its only headers.
//!
//! What the server's durability means for the engine is in the guide,
//! `docs/transports.md`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod codec;
mod config;
mod connection;
mod delivery;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod header_block;
mod mover;
mod names;
mod provision;
mod pull;
mod quarantine;
mod registration;
mod stored;
mod subscription;
mod tag;
#[cfg(feature = "testing")]
pub mod testing;
mod transport;
mod view;

pub use admin::NatsLayout;
pub use codec::{
    HEADER_BLOCK_HEADER, HEADER_BLOCK_LENGTH_HEADER, UNDECODABLE_HEADER, decode_value, encode_value,
};
pub use config::{ConfigError, DEFAULT_DUPLICATE_WINDOW, NatsConfig};
pub use header_block::{ClientFailure, HeaderBlockError, HeaderBlockProblem, check_header_block};
pub use names::{CONSUMER, check_queue_name, stream_name};
pub use registration::registration;
pub use subscription::NatsSubscription;
pub use tag::NatsTag;
pub use transport::{MIN_SERVER_VERSION, NatsTransport};
pub use transport_kit::settings::{ConnectionSettings, NodeOrder};
