//! Many messages with seeded random outcomes: exact accounting, and every message's
//! decisions compared with what the pure engine decides for the same outcomes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use retry_core::{
    AttemptState, DeadLetterReason, Decision, Jitter, Outcome, RetryPolicy, Terminal, Timestamp,
    decide, message_identity, splitmix64,
};

use crate::drive::{drive, wait_until};
use crate::harness::{Harness, TestMessage};
use crate::journal::{Journal, Step, permanent_cause, transient_cause};
use crate::support::{assert_nothing_left, ms, setup};

/// The shape of a storm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StormConfig {
    /// How many messages.
    pub messages: usize,
    /// Seeds every message's outcomes.
    pub seed: u64,
    /// The consumer's prefetch.
    pub prefetch: u16,
    /// How many messages may show duplicates (see [`StormReport::duplicates`]) before the
    /// storm fails. Without injected faults nothing duplicates a message, on the memory
    /// model or on a real broker: 0. A storm that injects faults that can duplicate (lost
    /// confirms, duplicated deliveries) allows at most as many as it injects.
    pub max_duplicates: usize,
}

/// What a storm did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StormReport {
    /// Messages published.
    pub published: usize,
    /// Distinct messages whose handler succeeded.
    pub handled: usize,
    /// Distinct messages found in the parking queue.
    pub parked: usize,
    /// Messages seen more than once at the same step: a handler run repeated for the same
    /// attempt, more than one final terminal, or more than one parked copy. At most
    /// [`StormConfig::max_duplicates`].
    pub duplicates: usize,
    /// Deliveries the consumer received.
    pub deliveries: u64,
    /// Every message's terminals, in order, by message id.
    pub terminals: BTreeMap<String, Vec<Terminal>>,
    /// How long the storm took on the harness's clock.
    pub took: Duration,
}

impl StormReport {
    /// One line for the suite's report.
    pub fn summary(&self) -> String {
        let decided = if self.duplicates == 0 {
            "every message"
        } else {
            "every message without a duplicate"
        };
        format!(
            "published {} = handled {} + parked {}; {} deliveries, {} duplicated messages, {decided} decided as the engine decides; took {:.1?}",
            self.published, self.handled, self.parked, self.deliveries, self.duplicates, self.took
        )
    }
}

/// The storm's policy, with short delays so a storm is quick on a real broker: one
/// immediate retry, then delays of 100, 200 and 300 ms with equal jitter (seeded by each
/// message's id, so a message gets the same delays on every transport).
pub fn storm_policy() -> RetryPolicy {
    RetryPolicy::delays([ms(100), ms(200), ms(300)])
        .with_immediate_retries(1, ms(10))
        .with_jitter(Jitter::Equal)
        .build()
        .expect("the storm policy is valid")
}

/// What the handler does for message `index` on `attempt`, from `seed` alone: a function
/// of the attempt rather than of the run, so a redelivered duplicate decides the same.
pub fn storm_step(seed: u64, index: usize, attempt: u32) -> Step {
    let draw = splitmix64(seed ^ splitmix64(index as u64) ^ splitmix64(u64::from(attempt) << 40));
    match draw % 100 {
        0..55 => Step::Succeed,
        55..85 => Step::Fail,
        85..90 => Step::Permanent,
        _ => Step::RetryAfter(ms(20 + (draw >> 32) % 400)),
    }
}

fn outcome(step: Step, attempt: u32) -> Outcome {
    match step {
        Step::Succeed => Outcome::Success,
        Step::Fail => Outcome::Transient(transient_cause(attempt)),
        Step::Permanent => Outcome::Permanent(permanent_cause(attempt)),
        Step::RetryAfter(d) => Outcome::RetryAfter(d, String::new()),
        Step::Hang => unreachable!("storms never hang"),
    }
}

/// The terminals the engine's pure decision function gives a message whose handler does
/// `script(attempt)`, with no crashes: what every transport must report.
pub fn expected_terminals(
    policy: &RetryPolicy,
    identity: u64,
    script: impl Fn(u32) -> Step,
) -> Vec<Terminal> {
    let now = Timestamp::from_millis(0);
    let mut out = Vec::new();
    let mut attempt = 1;
    let mut first_failure = None;
    // Every step either ends the message or uses up an attempt.
    for _ in 0..=policy.max_attempts() {
        let state = AttemptState {
            attempt,
            crashes: 0,
            first_failure,
            identity,
        };
        let outcome = outcome(script(attempt), attempt);
        if outcome != Outcome::Success && first_failure.is_none() {
            first_failure = Some(now);
        }
        match decide(policy, &state, &outcome, now) {
            Decision::Ack => {
                out.push(Terminal::Handled { attempt });
                return out;
            }
            Decision::RetryInProcess { .. } => attempt += 1,
            Decision::Retry { delay } => {
                out.push(Terminal::Retried {
                    attempts: attempt,
                    delay,
                });
                attempt += 1;
            }
            Decision::DeadLetter { reason } => {
                out.push(Terminal::DeadLettered { reason });
                return out;
            }
            Decision::Drop { reason } => {
                out.push(Terminal::Dropped { reason });
                return out;
            }
            Decision::Isolate | Decision::Divert { .. } => {
                unreachable!("no crashes in a storm")
            }
        }
    }
    panic!("the policy allowed more than max_attempts runs: {out:?}");
}

fn storm_id(seed: u64, index: usize) -> String {
    format!("s{seed:x}-{index:04}")
}

fn storm_index(id: &str) -> usize {
    let (_, n) = id.rsplit_once('-').expect("a storm id");
    n.parse().expect("a storm index")
}

/// Publishes `config.messages` messages, consumes them all at `config.prefetch` with
/// outcomes drawn from `config.seed`, and checks:
///
/// * accounting: every message ends handled or parked, never both, and
///   handled + parked = published (counting distinct messages, so a duplicate is not
///   mistaken for a message); the parking queue holds exactly the parked ones, with the
///   reason the engine gave;
/// * duplicates: at most `config.max_duplicates` messages show one (0 unless the caller
///   injects faults that can duplicate);
/// * decisions: each message's terminals equal [`expected_terminals`] for its outcomes
///   (messages with duplicates, only possible within the allowance, are left out of this
///   check: a duplicate's terminals are interleaved with the original's);
/// * nothing is left in any queue.
pub async fn storm<H: Harness>(h: &H, config: &StormConfig) -> StormReport {
    let policy = storm_policy();
    let s = setup(h, "storm", policy.clone(), false).await;
    let journal = Journal::new(h.stopwatch());
    let messages: Vec<TestMessage> = (0..config.messages)
        .map(|i| TestMessage::new(storm_id(config.seed, i)))
        .collect();
    let started = h.stopwatch().elapsed();
    for m in &messages {
        h.publish(&s.queue, m).await;
    }

    let seed = config.seed;
    let t = h.transport().await;
    let handler = journal.handler(move |r| storm_step(seed, storm_index(&r.id), r.attempt));
    let consumer = s
        .consumer(
            std::sync::Arc::clone(&t),
            &journal,
            handler,
            config.prefetch,
        )
        .build()
        .expect("consumer");
    let n = messages.len();
    let (ended, ()) = drive(consumer, |_| {
        wait_until(
            h,
            Duration::from_secs(120),
            || format!("{} of {n} messages finished", journal.finished()),
            || journal.finished() == n,
        )
    })
    .await;
    h.close(t).await;
    let report = ended.report();
    let took = h.stopwatch().elapsed() - started;

    let terminals = journal.terminals_by_message();
    let runs = journal.runs();
    let mut duplicated = BTreeSet::new();
    let mut seen_runs = BTreeSet::new();
    for r in &runs {
        if !seen_runs.insert((r.info.id.clone(), r.info.attempt)) {
            duplicated.insert(r.info.id.clone());
        }
    }
    let mut handled = BTreeSet::new();
    let mut dead_lettered: BTreeMap<String, DeadLetterReason> = BTreeMap::new();
    for (id, ts) in &terminals {
        let finals = ts.iter().filter(|t| t.is_final()).count();
        if finals > 1 {
            duplicated.insert(id.clone());
        }
        for t in ts {
            match t {
                Terminal::Handled { .. } => {
                    handled.insert(id.clone());
                }
                Terminal::DeadLettered { reason } => {
                    dead_lettered.insert(id.clone(), *reason);
                }
                _ => {}
            }
        }
    }

    let parked_messages = h.take_parked(&s.plan).await;
    let mut parked: BTreeMap<String, DeadLetterReason> = BTreeMap::new();
    for p in &parked_messages {
        let id = p.id.clone().expect("parked messages keep their id");
        let reason = p.record().reason.expect("parked messages say why");
        if parked.insert(id.clone(), reason).is_some() {
            duplicated.insert(id);
        }
    }
    assert!(
        duplicated.len() <= config.max_duplicates,
        "duplicated messages: {}, at most {} allowed: {duplicated:?}",
        duplicated.len(),
        config.max_duplicates
    );
    assert_eq!(
        parked, dead_lettered,
        "the parking queue holds exactly the messages reported parked, for the same reasons"
    );
    let both: Vec<_> = handled
        .intersection(&parked.keys().cloned().collect())
        .cloned()
        .collect();
    assert!(both.is_empty(), "handled and parked: {both:?}");
    let published: BTreeSet<String> = messages.iter().map(|m| m.id.clone()).collect();
    let ended_somewhere: BTreeSet<String> = handled.iter().chain(parked.keys()).cloned().collect();
    let lost: Vec<_> = published.difference(&ended_somewhere).collect();
    assert!(lost.is_empty(), "lost: {lost:?}");
    assert_eq!(
        handled.len() + parked.len(),
        published.len(),
        "handled + parked = published"
    );

    for m in &messages {
        if duplicated.contains(&m.id) {
            continue;
        }
        let index = storm_index(&m.id);
        let identity = message_identity(Some(&m.id), &m.body);
        let expected = expected_terminals(&policy, identity, |a| storm_step(seed, index, a));
        assert_eq!(
            terminals.get(&m.id).map(Vec::as_slice),
            Some(expected.as_slice()),
            "{} decided differently from the engine",
            m.id
        );
    }
    assert_nothing_left(h, &s.plan).await;

    StormReport {
        published: published.len(),
        handled: handled.len(),
        parked: parked.len(),
        duplicates: duplicated.len(),
        deliveries: report.received,
        terminals,
        took,
    }
}
