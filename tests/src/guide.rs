//! The guide's Rust snippets, compiled and run as doc tests (`cargo test --doc -p
//! conformance`). The guide is plain Markdown in `docs/`, one file per chapter; this crate
//! depends on every transport, so each chapter's snippets compile here whichever crates
//! they use. A chapter added to `docs/` gets an item here.

/// `docs/README.md`: the table of contents.
#[doc = include_str!("../../docs/README.md")]
struct Contents;

/// `docs/concepts.md`.
#[doc = include_str!("../../docs/concepts.md")]
struct Concepts;

/// `docs/policies.md`.
#[doc = include_str!("../../docs/policies.md")]
struct Policies;

/// `docs/embedding.md`.
#[doc = include_str!("../../docs/embedding.md")]
struct Embedding;

/// `docs/operating.md`.
#[doc = include_str!("../../docs/operating.md")]
struct Operating;

/// `docs/parking-lot.md`.
#[doc = include_str!("../../docs/parking-lot.md")]
struct ParkingLot;

/// `docs/clusters.md`.
#[doc = include_str!("../../docs/clusters.md")]
struct Clusters;

/// `docs/transports.md`.
#[doc = include_str!("../../docs/transports.md")]
struct Transports;

/// `docs/benchmarks.md`.
#[doc = include_str!("../../docs/benchmarks.md")]
struct Benchmarks;

/// `docs/limitations.md`.
#[doc = include_str!("../../docs/limitations.md")]
struct Limitations;

/// `docs/testing.md`.
#[doc = include_str!("../../docs/testing.md")]
struct Testing;

