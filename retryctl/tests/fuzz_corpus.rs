//! The corpora of the fuzz targets in `fuzz/`, replayed on stable as plain tests: every
//! input the fuzzer kept (`fuzz/corpus/TARGET`), and every crash it found, kept once fixed
//! (`fuzz/regressions/TARGET`), runs through the same function its target runs, so a
//! decoder that regresses on one fails here in seconds. The fuzzing itself runs by hand:
//! see `fuzz/README.md`.

use std::path::{Path, PathBuf};

/// Runs `body` on every file of target `name`'s corpus, which must hold some, and of its
/// regressions, if it has any.
fn replay(name: &str, body: fn(&[u8])) {
    let fuzz = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let inputs = run_all(&fuzz.join("corpus").join(name), body)
        .unwrap_or_else(|e| panic!("the corpus of {name}: {e}"));
    assert!(inputs > 0, "the corpus of {name} is empty");
    let _ = run_all(&fuzz.join("regressions").join(name), body);
}

/// Runs `body` on every file in `dir`; how many there were.
fn run_all(dir: &Path, body: fn(&[u8])) -> std::io::Result<usize> {
    let mut inputs = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let data = std::fs::read(&path)?;
        let outcome = std::panic::catch_unwind(|| body(&data));
        assert!(outcome.is_ok(), "{} fails", path.display());
        inputs += 1;
    }
    Ok(inputs)
}

#[test]
fn engine_headers() {
    replay("engine_headers", retry_core::fuzzing::engine_headers);
}

#[test]
fn amqp091_inspect() {
    replay("amqp091_inspect", transport_amqp091::fuzzing::inspect);
}

#[test]
fn amqp091_tap() {
    replay("amqp091_tap", transport_amqp091::fuzzing::tap);
}

#[test]
fn amqp091_amqp10_sections() {
    replay(
        "amqp091_amqp10_sections",
        transport_amqp091::fuzzing::amqp10_sections,
    );
}

#[test]
fn amqp10_scan() {
    replay("amqp10_scan", transport_amqp10::fuzzing::scan);
}

#[test]
fn amqp10_tap() {
    replay("amqp10_tap", transport_amqp10::fuzzing::tap);
}

#[test]
fn nats_header_block() {
    replay("nats_header_block", transport_nats::fuzzing::header_block);
}

#[test]
fn nats_header_value() {
    replay("nats_header_value", transport_nats::fuzzing::header_value);
}

#[test]
fn console_packed() {
    replay("console_packed", retryctl::fuzzing::packed);
}

#[test]
fn console_form() {
    replay("console_form", retryctl::fuzzing::form);
}
