//! # transport-kit
//!
//! What every transport of the retry engine would otherwise write again: the pieces that are
//! the same whatever the broker.
//!
//! * [`amqp10`]: one reader of AMQP 1.0 encodings, for every place bytes in that encoding
//!   come in from the network.
//! * [`forward`]: a forwarding layer: a decorator of a transport overrides only what it
//!   changes and forwards the rest.
//! * [`settings`]: the connection settings every transport has (the node list and its
//!   order, the connect, operation and publish timeouts, the TLS settings), and with the
//!   feature `tls` the rustls client built from them.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod amqp10;
pub mod forward;
pub mod settings;
