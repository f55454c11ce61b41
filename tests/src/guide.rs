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

/// `docs/console.md`.
#[doc = include_str!("../../docs/console.md")]
struct Console;

/// `docs/clusters.md`.
#[doc = include_str!("../../docs/clusters.md")]
struct Clusters;

/// `docs/tls.md`.
#[doc = include_str!("../../docs/tls.md")]
struct Tls;

/// `docs/transports.md`.
#[doc = include_str!("../../docs/transports.md")]
struct Transports;

/// `docs/new-transport.md`.
#[doc = include_str!("../../docs/new-transport.md")]
struct NewTransport;

/// `docs/benchmarks.md`.
#[doc = include_str!("../../docs/benchmarks.md")]
struct Benchmarks;

/// `docs/limitations.md`.
#[doc = include_str!("../../docs/limitations.md")]
struct Limitations;

/// `docs/testing.md`.
#[doc = include_str!("../../docs/testing.md")]
struct Testing;

// The crates' READMEs that no crate of their own compiles (transport-memory's README is its
// own crate's doc test, and the root README is retry-core's).

/// `retry-core/README.md`.
#[doc = include_str!("../../retry-core/README.md")]
struct RetryCoreReadme;

/// `transport-amqp091/README.md`.
#[doc = include_str!("../../transport-amqp091/README.md")]
struct Amqp091Readme;

/// `transport-amqp10/README.md`.
#[doc = include_str!("../../transport-amqp10/README.md")]
struct Amqp10Readme;
