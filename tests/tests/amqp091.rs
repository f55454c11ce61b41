//! The conformance suite on transport-amqp091 against the local RabbitMQ, and the
//! differential check: the memory model and RabbitMQ make the same decisions.

use std::time::Duration;

use conformance::rabbitmq::{BrokerEnv, runtime};
use conformance::storm::{StormConfig, storm};
use conformance::suite::{self, print_uncaptured};
use conformance::{Amqp091Harness, Harness, MemoryHarness};

#[test]
fn conformance_suite_on_transport_amqp091() {
    runtime().block_on(async {
        let Some(env) =
            BrokerEnv::detect("the conformance suite on transport-amqp091", false).await
        else {
            return;
        };
        let report = suite::run_concurrently(
            "transport-amqp091 (RabbitMQ)",
            &suite::all(),
            move || Amqp091Harness::connect(env.clone()),
            Duration::from_secs(150),
        )
        .await;
        report.print();
        report.assert_passed();
        let (_, _, skipped, _) = report.counts();
        assert_eq!(skipped, 0, "AMQP 0-9-1 on RabbitMQ supports every scenario");
    });
}

/// For the same seeded storm, every message's sequence of decisions (its terminals, with
/// their attempts and delays) is the same on the memory model as on RabbitMQ.
#[test]
fn memory_and_rabbitmq_make_the_same_decisions() {
    let config = StormConfig {
        messages: 300,
        seed: 0xd1ff,
        prefetch: 20,
    };
    let memory = MemoryHarness::new();
    let modelled = memory.block_on(storm(&memory, &config));

    runtime().block_on(async {
        let Some(env) = BrokerEnv::detect("the differential check on transport-amqp091", false)
            .await
        else {
            return;
        };
        let h = Amqp091Harness::connect(env).await;
        let run = std::panic::AssertUnwindSafe(storm(&h, &config));
        let real = futures::FutureExt::catch_unwind(run).await;
        h.cleanup().await;
        let real = real.unwrap_or_else(|p| std::panic::resume_unwind(p));

        assert_eq!(
            modelled.terminals.keys().collect::<Vec<_>>(),
            real.terminals.keys().collect::<Vec<_>>()
        );
        let mut decisions = 0;
        for (id, expected) in &modelled.terminals {
            let got = &real.terminals[id];
            assert_eq!(
                got, expected,
                "{id}: RabbitMQ decided {got:?}, the memory model {expected:?}"
            );
            decisions += got.len();
        }
        assert_eq!(
            (modelled.handled, modelled.parked),
            (real.handled, real.parked)
        );
        print_uncaptured(&format!(
            "\n== differential check, seed {:#x}: {} messages, {decisions} decisions, identical on transport-memory and RabbitMQ (AMQP 0-9-1)\n   memory:   {}\n   RabbitMQ: {}\n",
            config.seed,
            modelled.published,
            modelled.summary(),
            real.summary()
        ));
    });
}
