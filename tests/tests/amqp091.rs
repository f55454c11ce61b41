//! The conformance suite on transport-amqp091 against the local RabbitMQ: one test per
//! scenario, `scenario::NAME`, each on a runtime and a harness of its own.

mod expected;

use conformance::Amqp091Harness;

conformance::conformance_tests! {
    /// Every scenario on transport-amqp091; each skips with a loud notice without a broker,
    /// and fails instead when `REQUIRE_BROKER` is set.
    mod scenario {
        harness: Amqp091Harness,
        run: |s| Amqp091Harness::run(s, expected::AMQP091),
        skips: expected::AMQP091_SKIPS,
    }
}
