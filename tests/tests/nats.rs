//! The conformance suite on transport-nats against the local NATS server with JetStream:
//! one test per scenario (`scenario::NAME`), each on a runtime and a harness of its own.

mod expected;

use conformance::NatsHarness;

conformance::conformance_tests! {
    /// Every scenario on transport-nats; each skips with a loud notice without a server,
    /// and fails instead when `REQUIRE_NATS` is set.
    mod scenario {
        harness: NatsHarness,
        run: |s| NatsHarness::run(s, expected::NATS),
        skips: expected::NATS_SKIPS,
    }
}
