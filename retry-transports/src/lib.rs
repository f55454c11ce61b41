//! # retry-transports
//!
//! Connect to a broker by URL: the URL's scheme picks the transport, and the transport
//! comes back as a [`DynTransport`], which the [`Consumer`](retry_core::Consumer), the
//! [`ParkingLot`](retry_core::ParkingLot) and everything else generic over
//! [`Transport`](retry_core::Transport) take. Each transport of the workspace is behind a
//! cargo feature, in the way `object_store`'s `parse_url` works:
//!
//! | feature | name | URLs | transport |
//! |---|---|---|---|
//! | `amqp091` | `amqp091` | `amqp://`, `amqps://` | RabbitMQ and other AMQP 0-9-1 brokers |
//! | `amqp10` | `amqp10` | `amqp://`, `amqps://`, when asked for by name | AMQP 1.0 |
//! | `nats` | `nats` | `nats://`, `tls://` | NATS JetStream |
//! | `memory` (default) | `memory` | `memory://` | the in-memory broker, a new one per connection |
//!
//! `all` turns on every one. A scheme two transports speak goes to the first in this table;
//! [`ConnectOptions::with_protocol`] asks for another by name. The settings each takes are
//! in its crate's `registration()` documentation.
//!
//! ```
//! use retry_core::{Consumer, HandlerError, Message, RetryPolicy};
//! use std::time::Duration;
//!
//! async fn handle(_msg: Message) -> Result<(), HandlerError> {
//!     Ok(())
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! // The URL is configuration: `amqp://…`, `nats://…` or `memory://` builds the same type.
//! let url = std::env::var("BROKER_URL").unwrap_or_else(|_| "memory://".to_owned());
//! let transport = retry_transports::connect(&url).await?;
//! let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
//! let consumer = Consumer::builder(transport, "orders", policy, handle).build()?;
//! # let _ = consumer;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! A transport of your own joins with one line: build the [`registry`], then
//! [`Registry::register`] your crate's [`Registration`]. `docs/new-transport.md`, in the
//! repository, is the recipe.
//!
//! ## What the erasure costs
//!
//! A [`DynTransport`] moves each delivery's tag into one shared allocation and wraps a
//! subscription's `recv` in one more boxed future; `publish` and `settle` pass the inner
//! transport's futures through. The benchmark `cargo bench -p transport-memory --bench
//! erasure` runs the same consumer over the concrete and the erased in-memory transport in
//! one run; its figures are in `docs/benchmarks.md`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use retry_core::{
    ConnectError, ConnectOptions, DynSubscription, DynTag, DynTransport, Endpoint, Registration,
    Registry,
};

/// A registry of every transport whose feature is on, in the order of the table above.
///
/// ```
/// let registry = retry_transports::registry();
/// let names: Vec<&str> = registry.registrations().iter().map(|r| r.name()).collect();
/// assert!(names.contains(&"memory")); // the default feature
/// ```
pub fn registry() -> Registry {
    #[allow(unused_mut)]
    let mut registry = Registry::new();
    #[cfg(feature = "amqp091")]
    registry.register(transport_amqp091::registration());
    #[cfg(feature = "amqp10")]
    registry.register(transport_amqp10::registration());
    #[cfg(feature = "nats")]
    registry.register(transport_nats::registration());
    #[cfg(feature = "memory")]
    registry.register(transport_memory::registration());
    registry
}

/// Connects to `url` with the transport its scheme calls for, with its defaults:
/// [`Registry::connect`] on the [`registry`].
pub async fn connect(url: &str) -> Result<DynTransport, ConnectError> {
    registry().connect(url).await
}

/// Connects to `url` with `options`: [`Registry::connect_with`] on the [`registry`].
///
/// ```
/// use retry_transports::{ConnectError, ConnectOptions};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let options = ConnectOptions::new().with_protocol("carrier-pigeon");
/// let err = retry_transports::connect_with("memory://", options).await.unwrap_err();
/// assert!(matches!(err, ConnectError::UnknownProtocol { .. }));
/// # });
/// ```
pub async fn connect_with(
    url: &str,
    options: ConnectOptions,
) -> Result<DynTransport, ConnectError> {
    registry().connect_with(url, options).await
}

// The README's Rust example is compiled and run with the doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
