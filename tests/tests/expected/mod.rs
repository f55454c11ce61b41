//! What each transport under test must declare, and which scenarios it may skip, written
//! down here by hand: never read back from the transport under test. A harness checks every
//! connection it opens against these capabilities, each scenario's test asserts that it
//! skipped if and only if its transport's list here names it, and one test per transport
//! checks that every name here is a scenario. A transport that loses a capability fails
//! loudly instead of skipping the scenarios that need it.

// Each test target uses the part for the transports it runs.
#![allow(dead_code)]

use retry_core::Capabilities;

/// transport-memory models everything the engine uses except a native delay.
pub const MEMORY: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: true,
    native_delays: false,
    dead_letter_exchange: true,
    declares_topology: true,
};

/// On transport-memory every scenario runs.
pub const MEMORY_SKIPS: &[&str] = &[];

/// transport-amqp091 on RabbitMQ 3.10: quorum queues count deliveries; no native delay.
pub const AMQP091: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: true,
    native_delays: false,
    dead_letter_exchange: true,
    declares_topology: true,
};

/// On AMQP 0-9-1 every scenario runs.
pub const AMQP091_SKIPS: &[&str] = &[];

/// transport-amqp10 on RabbitMQ 3.10's AMQP 1.0 plugin: the plugin cannot declare queues
/// with arguments (topology is declared over AMQP 0-9-1 and only verified), and its
/// `delivery-count` stays 0.
pub const AMQP10: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: false,
    native_delays: false,
    dead_letter_exchange: true,
    declares_topology: false,
};

/// On AMQP 1.0 the scenarios that need the transport to declare a plan itself skip: the one
/// that checks it, and the delay cascade (whose bindings the RabbitMQ 3.x plugin cannot
/// declare or inspect, so the transport refuses it).
pub const AMQP10_SKIPS: &[&str] = &[
    "no_head_of_line_blocking_any_delay",
    "transport_declares_topology",
];

/// transport-nats on NATS 2.9 with JetStream: the server holds delayed clones itself (a nak
/// with a delay); there is no dead-letter exchange, and `num_delivered`, which counts naks
/// as much as crashes, is read as a redelivered flag, not as a delivery count.
pub const NATS: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: false,
    native_delays: true,
    dead_letter_exchange: false,
    declares_topology: true,
};

/// On NATS the delay cascade is refused (its levels dead-letter into each other): the server already holds every clone for exactly
/// its own delay, so per-delay queues take any delay without one waiting behind another
/// (`transport-nats/tests/nats.rs` checks that), and a cascade's exchanges have no NATS
/// form.
pub const NATS_SKIPS: &[&str] = &["no_head_of_line_blocking_any_delay"];
