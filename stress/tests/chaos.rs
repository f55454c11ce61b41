//! Chaos with a journal per message, bounded for CI, on a private RabbitMQ node this test
//! binary starts (`stress/chaos-node.sh`, port 5691) and that goes down when it exits:
//! consumer processes over AMQP 0-9-1 and AMQP 1.0 are SIGKILLed, have their connections
//! closed by the broker and live through a `stop_app`/`start_app`; poison messages abort
//! them. Nothing may be lost, every message ends as its script says, no message that is not
//! poison is charged a crash that its own solo run did not cause, suspects run alone, and
//! the poison is parked after exactly crash limit + 1 solo crashes. A failure prints every
//! offending message's journal.
//!
//! Without a RabbitMQ server to start, the tests skip loudly; with `REQUIRE_BROKER=1` they
//! fail instead. The full run (20,000 messages, 45 s of chaos) is the `chaos` binary.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use conformance::rabbitmq::runtime;
use conformance::suite::print_uncaptured;
use stress::chaos::consumer::Protocol;
use stress::chaos::driver::{self, ChaosConfig, ChaosOutcome};
use stress::chaos::node::PrivateNode;
use test_brokers::no_broker;

/// Not the by-hand runs' 5690, so both can run at once.
const PORT: u16 = 5691;

fn consumer() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_chaos_consumer"))
}

/// The private node, started by the first test that needs it; a watcher takes it down when
/// this test binary exits. One test at a time uses it: each restarts its application.
fn node(what: &str) -> Option<(MutexGuard<'static, ()>, PrivateNode)> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = STARTED.get_or_init(|| PrivateNode::up(PORT, Some(std::process::id())).map(drop));
    match started {
        Ok(()) => Some((turn, PrivateNode::attach(PORT))),
        Err(why) => {
            no_broker(what, &format!("no private RabbitMQ node: {why}"));
            None
        }
    }
}

fn check(outcome: &ChaosOutcome) {
    print_uncaptured(&format!("\n== {}\n", outcome.summary()));
    let problems = outcome.problems();
    if !problems.is_empty() {
        let mut details = outcome.reconciled.details.clone();
        if details.len() > 60_000 {
            let mut cut = 60_000;
            while !details.is_char_boundary(cut) {
                cut -= 1;
            }
            details.truncate(cut);
            details.push_str("\n[...]");
        }
        panic!(
            "{}\n{}\nconsumer run errors: {:?}\njournal: {}\n{details}",
            outcome.summary(),
            problems.join("\n"),
            outcome.exit_errors,
            outcome.journal.display(),
        );
    }
    let _ = std::fs::remove_file(&outcome.journal);
    let _ = std::fs::remove_file(outcome.journal.with_extension("stderr"));
}

/// The mix and faults, scaled down: 3,000 messages, 20 s of chaos with 5 SIGKILLs,
/// 4 forced connection closes and one `stop_app`/`start_app`.
///
/// One consumer process at a time: crash attribution is per process, so a suspect whose
/// connection drops while it runs alone is excused only by the process that saw the drop;
/// with two, the broker can hand it to the other, which counts a crash. The `chaos` binary
/// runs two and reports those as blamed across processes.
fn chaos(protocol: Protocol) {
    let what = format!("the chaos test on {}", protocol.name());
    let Some((_turn, node)) = node(&what) else {
        return;
    };
    let config = ChaosConfig {
        messages: 3_000,
        chaos: Duration::from_secs(20),
        kills: 5,
        closes: 4,
        app_restarts: 1,
        consumers: 1,
        settle_time: Duration::from_secs(90),
        ..ChaosConfig::full(protocol, consumer(), 29)
    };
    let outcome = runtime().block_on(driver::run(&config, &node));
    assert!(outcome.faults.kills == 5 && outcome.faults.app_restarts == 1);
    assert!(
        outcome.faults.closes.1 > 0,
        "no connection was closed: {}",
        outcome.summary()
    );
    check(&outcome);
}

/// Prefetch 20 and 3 % poison: each poison message takes its consumer process down with
/// up to 19 others, again and again.
fn poison_heavy(protocol: Protocol) {
    let what = format!("the poison-heavy chaos test on {}", protocol.name());
    let Some((_turn, node)) = node(&what) else {
        return;
    };
    let config = ChaosConfig {
        settle_time: Duration::from_secs(150),
        ..ChaosConfig::poison_heavy(protocol, consumer(), 12, 400, 12)
    };
    let outcome = runtime().block_on(driver::run(&config, &node));
    assert!(
        outcome.faults.aborts >= 12 * 2,
        "each poison message aborts at least its solo runs: {}",
        outcome.summary()
    );
    check(&outcome);
}

/// A consumer stopped by its shutdown signal mid-stream leaves nothing for the next one to
/// receive redelivered.
fn graceful(protocol: Protocol) {
    let what = format!("the graceful-shutdown test on {}", protocol.name());
    let Some((_turn, node)) = node(&what) else {
        return;
    };
    let out = runtime().block_on(driver::graceful_shutdown(
        protocol,
        consumer(),
        &node,
        1_000,
    ));
    print_uncaptured(&format!("\n== {}\n", out.summary()));
    assert!(
        out.handled_before > 0 && out.handled_before < out.messages,
        "the shutdown came mid-stream: {}",
        out.summary()
    );
    assert_eq!(out.handled, out.messages, "{}", out.summary());
    assert!(
        out.first_exit.starts_with("result=ok") && out.first_exit.contains("left-unsettled=0"),
        "the first consumer stopped cleanly: {}",
        out.summary()
    );
    assert_eq!(
        out.redelivered_after,
        0,
        "{}: redelivered {:?}; journal {}",
        out.summary(),
        out.redelivered_ids,
        out.journal.display()
    );
    let _ = std::fs::remove_file(&out.journal);
    let _ = std::fs::remove_file(out.journal.with_extension("stderr"));
}

#[test]
fn amqp091_chaos_loses_nothing_and_blames_no_one() {
    chaos(Protocol::Amqp091);
}

#[test]
fn amqp10_chaos_loses_nothing_and_blames_no_one() {
    chaos(Protocol::Amqp10);
}

#[test]
fn amqp091_poison_heavy_chaos_blames_only_the_poison() {
    poison_heavy(Protocol::Amqp091);
}

#[test]
fn amqp10_poison_heavy_chaos_blames_only_the_poison() {
    poison_heavy(Protocol::Amqp10);
}

#[test]
fn amqp091_graceful_shutdown_redelivers_nothing() {
    graceful(Protocol::Amqp091);
}

#[test]
fn amqp10_graceful_shutdown_redelivers_nothing() {
    graceful(Protocol::Amqp10);
}
