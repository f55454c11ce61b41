//! The conformance suite on transport-memory behind a `DynTransport`, as the registry
//! hands transports out: the erasure of tags and subscriptions changes no outcome, so every
//! scenario passes as it does on the concrete type (`tests/memory.rs`).

mod expected;

use conformance::{ErasedHarness, MemoryHarness};

conformance::conformance_tests! {
    /// Every scenario on transport-memory behind a `DynTransport`, each on a broker of its
    /// own, on its virtual clock.
    mod scenario {
        harness: ErasedHarness<MemoryHarness>,
        run: |s| {
            let h = ErasedHarness::new(MemoryHarness::new(expected::MEMORY));
            h.inner().block_on(s.run(&h))
        },
        skips: expected::MEMORY_SKIPS,
    }
}

/// A scenario's consumer really runs on the erased type: a connection the harness hands
/// out is a `DynTransport` over transport-memory's.
#[test]
fn the_harness_hands_out_erased_connections() {
    use conformance::Harness;
    let h = ErasedHarness::new(MemoryHarness::new(expected::MEMORY));
    let t = h.inner().block_on(h.transport());
    assert!(t.type_name().contains("MemoryTransport"), "{t:?}");
}
