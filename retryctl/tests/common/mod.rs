//! Shared helpers for the `retryctl` tests: transport-amqp091's broker test helpers (skipping
//! without a broker, unique names, raw lapin access for setup and inspection, `rabbitmqctl`),
//! the same file rather than a copy, and the broker's AMQP 1.0 URL.

#![allow(dead_code, unused_imports)]

#[path = "../../../transport-amqp091/tests/common/mod.rs"]
mod amqp091;

pub use amqp091::*;

/// The same broker's AMQP 1.0 URL (no virtual host path), as transport-amqp10's tests take
/// it.
pub fn url10() -> String {
    std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}
