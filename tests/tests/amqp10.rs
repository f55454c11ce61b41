//! The conformance suite on transport-amqp10 against the local RabbitMQ's AMQP 1.0 plugin:
//! one test per scenario (`scenario::NAME`), each on a runtime and a harness of its own.

mod expected;

use conformance::Amqp10Harness;

conformance::conformance_tests! {
    /// Every scenario on transport-amqp10; each skips with a loud notice without a broker,
    /// and fails instead when `REQUIRE_BROKER` is set.
    mod scenario {
        harness: Amqp10Harness,
        run: |s| Amqp10Harness::run(s, expected::AMQP10),
        skips: expected::AMQP10_SKIPS,
    }
}
