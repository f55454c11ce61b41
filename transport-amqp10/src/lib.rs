//! # transport-amqp10
//!
//! An AMQP 1.0 [`Transport`](retry_core::Transport) for the retry engine, through
//! [fe2o3-amqp](https://docs.rs/fe2o3-amqp). It runs the same [`Consumer`](retry_core::Consumer)
//! and handlers as the AMQP 0-9-1 transport, against RabbitMQ 3.x's `rabbitmq_amqp1_0`
//! plugin or any AMQP 1.0 broker.
//!
//! ## Design
//!
//! * **A connection per intake.** One connection publishes clones and verifies addresses;
//!   every [`Amqp10Subscription`] (one per [`consume`](retry_core::Transport::consume)) and
//!   every queue's fetch link has its own. On RabbitMQ 3.10 a send refused by a full
//!   `reject-publish` queue makes the broker close the connection it came on, without
//!   answering the send. Apart, that costs only the publishing connection: the publish times
//!   out, and the original is released on its intact link (requeued, not lost). The
//!   publishing side reconnects on the next send.
//! * **Every send is bounded** by [`Amqp10Config::with_publish_timeout`], and sent unsettled:
//!   only the broker's `accepted` counts as a confirm. `rejected`, `released` and `modified`
//!   are refusals; an error or a timeout is a failure. Either way the engine requeues the
//!   original.
//! * **Manual credit equal to the prefetch.** A task owns each subscription's receiver; it
//!   hands deliveries out and grants `prefetch − held` more once the previous grant is used
//!   up, so no more than `prefetch` deliveries are ever unsettled. (Granting earlier is
//!   unsafe: RabbitMQ 3.10 does not subtract transfers already on the way from a new grant,
//!   and fe2o3 refuses a transfer beyond its credit, which can then never be settled.) A tag
//!   names its link, so settling reaches the subscription (or fetch) that received the
//!   delivery and no other. Accepting and releasing a subscription's delivery go from the
//!   settling task straight to the link's session (fe2o3's `ReceiverDisposer`), not through
//!   the link's task: the two share the credit ledger, and a settlement wakes the task only
//!   when it makes a grant due.
//! * **A consumer's start is prepared ahead.** While [`verify`](retry_core::Transport::verify)
//!   (or `provision`) probes a plan's addresses, several at once, the isolation queue's fetch
//!   link is attached and a consuming link on the work queue is opened, both granting
//!   nothing; the consumer's first fetch and its `consume` then find them ready. Suspects
//!   are still fetched and run before any work.
//! * **Fetch counts, then takes a credit of one.** [`fetch`](retry_core::Transport::fetch)
//!   first asks how many messages the queue has ready, with a `flow` that grants nothing:
//!   RabbitMQ answers every `flow` with the count (`available`), which the transport reads
//!   off the connection's incoming frames (fe2o3 keeps it to itself). With none ready the
//!   answer is `Ok(None)` at once, and no credit was ever granted. Otherwise it grants exactly
//!   1 on the queue's fetch link and waits [`Amqp10Config::with_fetch_wait`] (250 ms by
//!   default) for the transfer; a ready message arrives within milliseconds, and one the
//!   broker's answer to the grant says is on its way is waited for up to the operation
//!   timeout. If none comes (another consumer took it) the link is detached and its session
//!   ended, which takes the credit back, and the answer is `Ok(None)`. RabbitMQ 3.10 cannot
//!   drain (a drain that finds a classic queue empty ends the session with an internal
//!   error), and a flow with credit 0 that crosses a transfer leaves fe2o3 and the broker
//!   disagreeing about the credit. The detach races: a message the broker dispatches in its
//!   last few milliseconds goes back to the queue marked redelivered, which from the
//!   isolation queue reads as a crash. Counting first leaves that race only to two
//!   consumers fetching from one queue at once.
//!   [`ready`](retry_core::Transport::ready) asks for the same count every poll interval
//!   and resolves once a message is ready, so the consumer pauses its work lane only when
//!   there are suspects to run alone.
//! * **Settlement:** ack is `accepted`, reject is `rejected` (the broker dead-letters it), and
//!   requeue is `released` on RabbitMQ 3.x (which ends the session on `modified`) or
//!   `modified` with `delivery-failed` elsewhere, so the broker counts the attempt.
//! * **Every incoming message is checked before it is decoded.** Each connection reads what
//!   comes in before fe2o3 does: a message must be a valid AMQP 1.0 encoding nested no
//!   deeper than 64 levels, since fe2o3 decodes by recursing once per
//!   level with no limit and a deeply nested message would overflow the stack and abort the
//!   process. A message that fails, or that fe2o3 cannot decode, is settled `rejected`, so
//!   the queue dead-letters it (a plan's work and isolation queues into its parking queue);
//!   it never reaches the engine and is never received twice. A walk of a parking queue
//!   hands it out marked with [`UNDECODABLE_HEADER`] instead.
//! * **Facts** come from `header.first-acquirer` (RabbitMQ 3.x: `false` means redelivered),
//!   `header.delivery-count` (elsewhere) and the engine's headers, which this transport keeps
//!   in `application-properties` (see [`convert`]). Values that a header cannot carry
//!   exactly are kept aside and put back on clones ([`NATIVE_HEADER`]).
//! * **Address verification.** RabbitMQ 3.10 accepts and silently drops a send to a missing
//!   queue or an unroutable exchange. [`verify`](retry_core::Transport::verify) (what a
//!   [`Consumer`](retry_core::Consumer) calls before consuming when provisioning is off) and
//!   [`provision`](retry_core::Transport::provision) both verify every queue and exchange of
//!   the plan (a receiver attached with no credit to `/amq/queue/NAME`, which never
//!   declares; a sender attached to `/exchange/NAME`) and fail with
//!   [`TransportError::MissingAddress`](retry_core::TransportError::MissingAddress) naming
//!   everything missing and how to provision it. Bindings cannot be seen over AMQP 1.0, so a
//!   clone goes straight to the verified queue its route is bound to (`/amq/queue/NAME`),
//!   never through `/exchange/X/KEY`: an unbound delay queue still gets its clones, and a
//!   route no verified plan knows fails with `MissingAddress` instead of being sent. (A route
//!   through the default exchange names its queue, which is verified before the first send
//!   to it.)
//! * **Re-verification.** A queue can be deleted while the consumer runs (an operator fixing
//!   a conflict deletes and recreates it). Every send first checks that its address was
//!   verified on the same publishing connection less than
//!   [`Amqp10Config::with_reverify_after`] ago (5 s by default): a timestamp comparison. If
//!   not, it probes the address again, once for all the sends waiting on it; a new
//!   publishing connection verifies every address again. A queue found missing fails the
//!   publish with `MissingAddress`, and the engine requeues the original instead of
//!   acknowledging it.
//!
//!   **The window that remains:** the plugin offers nothing like AMQP 0-9-1's `mandatory`,
//!   so between a queue's deletion and the next re-verification of its address, clones sent
//!   to it are accepted and dropped, and their originals acknowledged. The re-verification
//!   age bounds that window.
//!
//!   What probing costs, measured with `examples/reverify_cost.rs` (release build, a
//!   consumer taking 150 000 messages a round through the retry path, clone and ack, at
//!   prefetch 50, on a local RabbitMQ 3.10; two cores shared with other builds): at the
//!   default 5 s the throughput was 0.79 to 1.32 times that of never re-verifying, over six
//!   rounds of about 9 000 to 13 000 msg/s either way: the cost is below that noise.
//!   Re-verifying every 100 ms gave 0.57 to 1.12 times; the slowest rounds put what a probe
//!   holds up the sends to its address at about 40 ms, which at 5 s is under 1 % of the
//!   time.
//! * **Nothing is declared.** RabbitMQ's plugin cannot declare queues with arguments, so the
//!   topology is declared over AMQP 0-9-1 (transport-amqp091) and verified here.
//! * **Links are detached, never closed** (closing misbehaves on RabbitMQ 3.10).
//! * **Operators' tools.** [`Amqp10Transport`] implements [`Admin`](retry_core::Admin):
//!   a check of a plan object by object (the probes of `verify`, nothing sent), an `apply`
//!   refused (apply over AMQP 0-9-1), an unknown depth (walk the queue), and
//!   [`hidden_headers`](retry_core::Admin::hidden_headers) for a message RabbitMQ 3.x shows
//!   without the headers it was published with over AMQP 0-9-1.
//!
//! ## Profiles
//!
//! [`BrokerProfile::RabbitMq3`] (the default) and [`BrokerProfile::Generic`], which uses
//! `modified`, trusts `delivery-count`, names queues by plain addresses and can delay clones
//! natively with the scheduled-delivery annotations of ActiveMQ Artemis and Azure Service
//! Bus ([`NativeDelay`]): a delayed clone then goes straight back to the work queue.
//!
//! How each profile carries a plan's [delay strategy](retry_core::DelayStrategy):
//!
//! | profile | per-delay queues (the default) | delay cascade |
//! |---|---|---|
//! | `RabbitMq3` | sent to the verified delay queue; the broker expires it back | refused with [`TransportError::Unsupported`](retry_core::TransportError::Unsupported) |
//! | `Generic` without native delays | sent to the verified delay queue, which the broker must expire back | refused with `Unsupported` |
//! | `Generic` with native delays | sent straight to the work (or isolation) queue, scheduled | the same: the cascade's objects are never used |
//!
//! A cascade is a chain of exchanges joined by exchange-to-exchange bindings. RabbitMQ's
//! plugin can neither declare nor inspect bindings, and it accepts a send to an exchange with
//! no matching binding and drops it without a word: a cascade with one binding missing
//! would lose retries silently. So [`verify`](Amqp10Transport::verify) and `provision` of a
//! plan with a cascade fail, before anything is probed or sent, and a
//! [`Consumer`](retry_core::Consumer) with one never starts. Use the per-delay-queue strategy
//! with this transport, or consume with transport-amqp091, which declares the cascade and
//! hears of an unroutable publish.
//!
//! ## TLS and credentials
//!
//! `amqps://` URLs connect over TLS with rustls and its `ring` provider (no C toolchain
//! needed). [`Amqp10Config::with_tls`] takes a [`TlsConfig`](retry_core::TlsConfig): CA
//! files trusted in place of the `webpki-roots` authorities, a client certificate and key,
//! and a server name checked (and sent as SNI) in place of the URL's host;
//! [`Amqp10Config::with_tls_config`] takes a whole rustls configuration instead. A refused
//! handshake fails with [`TransportError::Tls`](retry_core::TransportError::Tls) naming
//! `host:port` and a [`TlsFailure`](retry_core::TlsFailure): an unknown CA, a wrong host
//! name, an expired certificate, a server that does not answer with TLS (a plain port given
//! as `amqps://`), the server's alert, a file that cannot be read or parsed. An `amqps://`
//! URL is never retried on plain TCP.
//!
//! Authentication is SASL PLAIN with the URL's credentials (ANONYMOUS without), or SASL
//! EXTERNAL with [`Amqp10Config::with_external_auth`]: the client certificate is the login
//! (RabbitMQ: the `rabbitmq_auth_mechanism_ssl` plugin). The password and key material
//! appear in no log line, error or `Debug` output.
//!
//! ```
//! use retry_core::TlsConfig;
//! use transport_amqp10::Amqp10Config;
//!
//! let tls = TlsConfig::new()
//!     .with_ca_file("/etc/rabbitmq/ca.pem")
//!     .with_client_identity("/etc/app/client.pem", "/etc/app/client.key");
//! // Log in as the certificate's user; the URL needs no credentials.
//! let config = Amqp10Config::new("amqps://rabbit.internal:5671")
//!     .with_tls(tls)
//!     .with_external_auth();
//! # drop(config);
//! ```
//!
//! ## Example
//!
//! ```no_run
//! use retry_core::{Consumer, HandlerError, Message, RetryPolicy};
//! use std::time::Duration;
//! use transport_amqp10::{Amqp10Config, Amqp10Transport};
//!
//! async fn handle(msg: Message) -> Result<(), HandlerError> {
//!     if msg.body().is_empty() {
//!         return Err(HandlerError::permanent("empty body"));
//!     }
//!     Ok(())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // The topology of "comments" (its delay, isolation and parking queues) was declared over
//! // AMQP 0-9-1; `run` verifies it first. Suspects are fetched from "comments.suspect".
//! let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
//! let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
//! let consumer = Consumer::builder(transport, "comments", policy, handle)
//!     .with_prefetch(20)
//!     .build()?;
//! let report = consumer.run(std::future::pending()).await?;
//! println!("{report:?}");
//! # Ok(())
//! # }
//! ```
//!
//! `examples/04_amqp10_consumer.rs` (workspace root) runs the whole path against a local RabbitMQ and exits.
//!
//! The crate's README (`transport-amqp10/README.md`) is how it works concern by concern,
//! and what the RabbitMQ 3.x profile cannot do. The guide, in the repository's `docs/`
//! folder, covers where this transport sits beside the others (`docs/transports.md`),
//! clusters (`docs/clusters.md`), the parking lot over AMQP 1.0 (`docs/parking-lot.md`),
//! its benchmarks (`docs/benchmarks.md`) and the known limitations (`docs/limitations.md`).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod codec;
mod config;
mod connection;
pub mod convert;
mod external;
mod fetch;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod profile;
mod publisher;
mod receiver;
mod registration;
mod shared;
mod subscription;
mod tap;
mod tls;
mod transport;
mod verification;
mod walk;

pub use codec::{NATIVE_HEADER, UNDECODABLE_HEADER};
pub use config::Amqp10Config;
pub use profile::{BrokerProfile, GenericProfile, NativeDelay};
pub use receiver::Amqp10Tag;
pub use registration::registration;
pub use retry_core::NodeListError;
pub use subscription::Amqp10Subscription;
pub use transport::Amqp10Transport;
pub use transport_kit::settings::{ConnectionSettings, NodeOrder};

/// The former name of [`NodeListError`]. Its variants are now those of the node-list error
/// both AMQP transports share: `EmptyNodeList` is `Empty`, `InvalidUrl` and `MissingHost`
/// are `Invalid`, and every node variant names the node's `position` and `node` (the
/// redacted URL, formerly `url`).
///
/// ```
/// # #![allow(deprecated)]
/// use transport_amqp10::{ConfigError, NodeListError};
///
/// let old: ConfigError = NodeListError::Empty;
/// assert!(matches!(old, NodeListError::Empty));
/// ```
#[deprecated(
    note = "renamed NodeListError, the URL error shared with transport-amqp091 (retry_core::NodeListError); ConfigError goes in the next release"
)]
pub type ConfigError = NodeListError;
