//! The transport layer: the retry engine's [`Transport`](retry_core::Transport) on the broker
//! model. This is where the engine's types meet the model's: deliveries and their facts are
//! built from what the broker hands out ([`delivery`]), topology plans are declared
//! ([`provision`]), and broker errors become transport errors ([`error`]).
//!
//! * [`connection`]: [`MemoryTransport`](connection::MemoryTransport), one client connection,
//!   and [`Broker::connect`](crate::Broker::connect);
//! * [`subscription`]: [`MemorySubscription`](subscription::MemorySubscription), one
//!   consumer;
//! * [`link`]: which connection a transport uses now, and recovery onto a new one.

pub(crate) mod admin;
pub(crate) mod confirms;
pub(crate) mod connection;
pub(crate) mod delivery;
pub(crate) mod error;
pub(crate) mod link;
pub(crate) mod provision;
pub(crate) mod subscription;
