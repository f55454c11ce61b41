//! The conformance suite on transport-memory, on its virtual clock.

use conformance::{MemoryHarness, suite};

#[test]
fn conformance_suite_on_transport_memory() {
    let report = MemoryHarness::run_suite(&suite::all());
    report.print();
    report.assert_passed();
    let (run, _, skipped, _) = report.counts();
    assert_eq!(skipped, 0, "the memory model supports every scenario");
    assert_eq!(run, suite::all::<MemoryHarness>().len());
}
