//! The conformance suite on transport-memory, on its virtual clock.

mod expected;

use conformance::{MemoryHarness, suite};

#[test]
fn conformance_suite_on_transport_memory() {
    let report = MemoryHarness::run_suite(&suite::all(), expected::MEMORY);
    report.print();
    report.assert_passed();
    report.assert_skipped_exactly(expected::MEMORY_SKIPS);
    let (run, _, _, _) = report.counts();
    assert_eq!(
        run + expected::MEMORY_SKIPS.len(),
        suite::all::<MemoryHarness>().len()
    );
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
