//! The conformance suite on transport-amqp10 against the local RabbitMQ's AMQP 1.0 plugin.

mod expected;

use std::time::Duration;

use conformance::rabbitmq::{BrokerEnv, runtime};
use conformance::{Amqp10Harness, suite};

#[test]
fn conformance_suite_on_transport_amqp10() {
    runtime().block_on(async {
        let Some(env) = BrokerEnv::detect("the conformance suite on transport-amqp10", true).await
        else {
            return;
        };
        let report = suite::run_concurrently(
            "transport-amqp10 (RabbitMQ 3.x, AMQP 1.0)",
            &suite::all(),
            move || Amqp10Harness::connect(env.clone(), expected::AMQP10),
            Duration::from_secs(150),
        )
        .await;
        report.print();
        report.assert_passed();
        report.assert_skipped_exactly(expected::AMQP10_SKIPS);
    });
}
