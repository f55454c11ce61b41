//! The conformance suite on transport-memory, on its virtual clock: one test per scenario
//! (`scenario::NAME`), and the storm with injected duplicates.

mod expected;

use conformance::{MemoryHarness, suite};

conformance::conformance_tests! {
    /// Every scenario on transport-memory, each on a broker of its own.
    mod scenario {
        harness: MemoryHarness,
        run: |s| MemoryHarness::run(s, expected::MEMORY),
        skips: expected::MEMORY_SKIPS,
    }
}

/// The storm with injected duplicate deliveries: the accounting stays exact, and the
/// duplicates stay within the allowance the test gives for the faults it injects.
#[test]
fn storm_with_duplicated_deliveries_stays_within_its_allowance() {
    let injected = 5;
    let h = MemoryHarness::new(expected::MEMORY);
    h.broker().duplicate_deliveries(injected);
    let config = conformance::storm::StormConfig {
        messages: 300,
        seed: 0xd0b1e,
        prefetch: 20,
        max_duplicates: injected as usize,
    };
    let report = h.block_on(conformance::storm::storm(&h, &config));
    suite::print_uncaptured(&format!(
        "\n== storm with {injected} duplicated deliveries on transport-memory: {}\n",
        report.summary()
    ));
    assert!(report.duplicates > 0, "the injected duplicates were seen");
}
