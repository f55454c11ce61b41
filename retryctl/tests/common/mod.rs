//! Shared helpers for the `retryctl` tests: transport-amqp091's test glue (the broker's
//! config or a loud skip, the transport, a consumer in the background), the same file rather
//! than a copy, with the broker-level helpers of test-brokers it re-exports, and the
//! broker's AMQP 1.0 URL.

#![allow(dead_code, unused_imports)]

#[path = "../../../transport-amqp091/tests/common/mod.rs"]
mod amqp091;

pub use amqp091::*;

pub use test_brokers::amqp10_url;
