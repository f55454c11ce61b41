//! The differential check: for the same scripted workload with faults, the memory model
//! produces the deliveries RabbitMQ produces (see `stress::differential`).

use std::time::Instant;

use conformance::rabbitmq::{BrokerEnv, runtime};
use conformance::suite::print_uncaptured;
use conformance::{Amqp091Harness, Harness, MemoryHarness};
use retry_core::Capabilities;
use stress::differential::{self, DifferentialRun};

/// What transport-memory and transport-amqp091 on RabbitMQ 3.10 must declare, written down
/// as the conformance suite's `tests/expected` does, never read back from the transport:
/// both count deliveries, neither has a native delay.
const EXPECTED: Capabilities = Capabilities {
    publisher_confirms: true,
    delivery_count: true,
    native_delays: false,
    dead_letter_exchange: true,
    declares_topology: true,
};

/// The workload's cases: (name, quorum queues).
const CASES: [(&str, bool); 2] = [("diff-classic", false), ("diff-quorum", true)];

/// Every delivery of the differential workload (see `stress::differential`) is the
/// same on the memory model as on RabbitMQ: queue, route, redelivered flag,
/// `x-delivery-count`, normalised `x-death`, and each queue's arrival order.
#[test]
fn memory_model_and_rabbitmq_produce_the_same_deliveries() {
    let modelled: Vec<DifferentialRun> = CASES
        .iter()
        .map(|&(name, quorum)| {
            let h = MemoryHarness::new(EXPECTED);
            let run = h.block_on(differential::run(&h, name, quorum));
            differential::assert_covers_workload(&run, quorum);
            run
        })
        .collect();

    runtime().block_on(async {
        let Some(env) = BrokerEnv::detect("the differential check on transport-amqp091", false)
            .await
        else {
            return;
        };
        let started = Instant::now();
        let h = Amqp091Harness::connect(env, EXPECTED).await;
        let runs = futures::future::join_all(
            CASES
                .iter()
                .map(|&(name, quorum)| differential::run(&h, name, quorum)),
        );
        let real = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(runs)).await;
        h.cleanup().await;
        let real = real.unwrap_or_else(|p| std::panic::resume_unwind(p));
        let took = started.elapsed();

        let mut lines = Vec::new();
        let mut total = 0;
        for (((name, _), model), real) in CASES.iter().zip(&modelled).zip(&real) {
            let c = differential::assert_same_deliveries(model, real, &format!("RabbitMQ ({name})"));
            total += c.deliveries;
            lines.push(format!(
                "   {name}: {} deliveries in {} queues ({} redelivered, {} with x-delivery-count, {} with x-death), {} messages' terminals",
                c.deliveries,
                c.queues,
                c.redelivered,
                c.delivery_counts,
                c.with_x_death,
                model.terminals.len()
            ));
        }
        print_uncaptured(&format!(
            "\n== differential check: {total} deliveries compared, identical on transport-memory and RabbitMQ (AMQP 0-9-1): queue and route, redelivered, x-delivery-count, x-death, arrival order; RabbitMQ run took {:.1} s\n{}\n",
            took.as_secs_f64(),
            lines.join("\n")
        ));
    });
}
