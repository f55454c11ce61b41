//! The broker's URLs, from the environment or the local broker's defaults: the tests' own,
//! from test-brokers.

pub use test_brokers::{amqp_url, amqp10_url};
