//! The scenarios: one `pub async fn` each, generic over the [`Harness`], returning a
//! [`Verdict`] or panicking with what went wrong.
//!
//! Every scenario declares its own uniquely named topology, checks the terminals the
//! consumer reported, the handler runs (attempt numbers, the engine's headers, when they
//! happened), what reached the parking queue, and that nothing was left behind in any queue
//! of the plan. Delays are checked exactly on a virtual clock and as lower bounds on a real
//! broker ([`Timing`]).
//!
//! Every public function of this module is a scenario, and every scenario is named once, in
//! [`for_each_scenario!`](crate::for_each_scenario) below. The crate does not compile while
//! a public function here is missing from that list (the source of this file is read at
//! compile time and compared with it), and a listed name that is not a scenario does not
//! resolve. [`conformance_tests!`](crate::conformance_tests) and
//! [`suite::all`](crate::suite::all) take the scenarios from the list, so a scenario added
//! here runs on every transport with nothing else to edit. Building blocks for scenarios
//! live in [`support`](crate::support), not here.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use retry_core::headers::{ATTEMPTS, CRASHES, DELAY, SUSPECT};
use retry_core::{
    Cascade, CrashAction, DeadLetterReason, DelayStrategy, HeaderValue, Headers, Jitter,
    ParkedRecord, RetryPolicy, Terminal, TopologyPlan, Transport,
};

use crate::drive::{Ended, assert_waited, drive, wait_until};
use crate::harness::{Harness, Need, ParkedMessage, TestMessage, Timing, TopologyFaults};
use crate::journal::{Journal, ScriptedHandler, Step, permanent_cause, transient_cause};
use crate::storm::{StormConfig, storm};
use crate::support::{
    Setup, WITHIN, assert_nothing_left, delay_queue, ms, setup, setup_cascade, setup_with_faults,
    unmet,
};
use crate::verdict::Verdict;

/// Calls the macro `callback` with every scenario of [`scenarios`](crate::scenarios): the
/// one list of them.
///
/// `for_each_scenario!(path::to::callback => ARGS)` expands to
/// `path::to::callback! { (ARGS) [success, transient_then_success, ...] }`: the arguments
/// in parentheses, then the scenario names in brackets. Each name is a function of
/// [`scenarios`](crate::scenarios) with the signature
/// `pub async fn NAME<H: Harness>(h: &H) -> Verdict`.
///
/// [`conformance_tests!`](crate::conformance_tests) and [`suite::all`](crate::suite::all)
/// are built on it; a harness author rarely needs it directly. A new scenario goes into
/// `tests/src/scenarios.rs` as a public function and into this list: the crate does not
/// compile with one and not the other.
///
/// ```
/// macro_rules! count {
///     (() [$($name:ident),* $(,)?]) => { [$(stringify!($name)),*].len() };
/// }
/// let n = conformance::for_each_scenario!(count => );
/// assert_eq!(n, conformance::suite::NAMES.len());
/// ```
#[macro_export]
macro_rules! for_each_scenario {
    ($($callback:tt)::+ => $($args:tt)*) => {
        $($callback)::+! { ($($args)*) [
            success,
            transient_then_success,
            attempts_exhausted_parked,
            permanent_parked,
            retry_after,
            immediate_then_delayed,
            redelivered_isolated,
            crash_limit_parked,
            crash_limit_run_handler,
            poison_with_bystanders,
            refused_publish_not_lost,
            no_head_of_line_blocking,
            no_head_of_line_blocking_any_delay,
            transport_declares_topology,
            seeded_storm,
            parking_lot,
        ] }
    };
}

/// The `(queue, reason)` of each `x-death` entry.
fn deaths(headers: &Headers) -> Vec<(&str, &str)> {
    headers
        .get("x-death")
        .and_then(HeaderValue::as_array)
        .unwrap_or_default()
        .iter()
        .filter_map(HeaderValue::as_table)
        .map(|t| {
            let field = |name| {
                t.get(name)
                    .and_then(HeaderValue::as_str)
                    .unwrap_or_default()
            };
            (field("queue"), field("reason"))
        })
        .collect()
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).expect("test delays fit")
}

/// Publishes `messages` to the work queue.
async fn publish_all<H: Harness>(h: &H, queue: &str, messages: &[TestMessage]) {
    for m in messages {
        h.publish(queue, m).await;
    }
}

/// Runs one consumer on a fresh connection until `done` holds, then stops it and closes
/// the connection.
async fn run_until<H: Harness>(
    h: &H,
    builder: impl FnOnce(Arc<H::Transport>) -> retry_core::Consumer<Arc<H::Transport>, ScriptedHandler>,
    what: &str,
    done: impl Fn() -> bool,
) -> retry_core::RunReport {
    let t = h.transport().await;
    let consumer = builder(Arc::clone(&t));
    let (ended, ()) = drive(consumer, |_| {
        wait_until(h, WITHIN, || what.to_owned(), done)
    })
    .await;
    h.close(t).await;
    ended.report()
}

/// The wait of a retry as observed: exact on a virtual clock, a lower bound on the wall.
fn describe_wait(timing: Timing, waited: Duration, delay: Duration) -> String {
    match timing {
        Timing::Virtual => format!("{delay:.1?} delay took exactly {waited:.1?} of virtual time"),
        Timing::Wall { slack } => format!(
            "{delay:.1?} delay came back after {waited:.1?} (bound {:.1?})",
            delay.saturating_sub(slack)
        ),
    }
}

/// Three messages, each handled on its first run and acknowledged.
pub async fn success<H: Harness>(h: &H) -> Verdict {
    let policy = RetryPolicy::delays([ms(300)]).build().expect("policy");
    let s = setup(h, "ok", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let messages: Vec<_> = (1..=3)
        .map(|i| TestMessage::new(format!("ok-{i}")))
        .collect();
    publish_all(h, &s.queue, &messages).await;

    let report = run_until(
        h,
        |t| {
            s.consumer(t, &journal, journal.handler(|_| Step::Succeed), 4)
                .build()
                .expect("consumer")
        },
        "three messages handled",
        || journal.finished() == 3,
    )
    .await;

    for m in &messages {
        assert_eq!(
            journal.terminals_of(&m.id),
            [Terminal::Handled { attempt: 1 }]
        );
        let runs = journal.runs_of(&m.id);
        assert_eq!(runs.len(), 1, "{}: {runs:?}", m.id);
        assert_eq!(runs[0].headers.get(ATTEMPTS), None);
    }
    assert_eq!((report.received, report.handled), (3, 3), "{report:?}");
    assert!(h.take_parked(&s.plan).await.is_empty());
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed(["3 messages handled on attempt 1, acked once".to_owned()])
}

/// Two transient failures, then success: each retry goes through the delay the policy
/// gives, and comes back no sooner.
pub async fn transient_then_success<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let delays = [ms(200), ms(400), ms(600)];
    let policy = RetryPolicy::delays(delays).build().expect("policy");
    let s = setup(h, "transient", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("flaky");
    h.publish(&s.queue, &m).await;

    let report = run_until(
        h,
        |t| {
            let handler = journal.handler(|r| {
                if r.run <= 2 {
                    Step::Fail
                } else {
                    Step::Succeed
                }
            });
            s.consumer(t, &journal, handler, 4)
                .build()
                .expect("consumer")
        },
        "flaky handled",
        || journal.is_finished(&m.id),
    )
    .await;

    assert_eq!(
        journal.terminals_of(&m.id),
        [
            Terminal::Retried {
                attempts: 1,
                delay: delays[0]
            },
            Terminal::Retried {
                attempts: 2,
                delay: delays[1]
            },
            Terminal::Handled { attempt: 3 },
        ]
    );
    let runs = journal.runs_of(&m.id);
    assert_eq!(runs.len(), 3, "{runs:?}");
    let timing = h.capabilities().timing;
    let death_records = h.capabilities().death_records;
    let mut notes = Vec::new();
    for i in 1..runs.len() {
        let delay = delays[i - 1];
        let run = &runs[i];
        assert_eq!(run.info.attempt, i as u32 + 1);
        assert_eq!(
            run.headers.get(ATTEMPTS).and_then(HeaderValue::as_i64),
            Some(i as i64)
        );
        assert_eq!(
            run.headers.get(DELAY).and_then(HeaderValue::as_i64),
            Some(millis(delay))
        );
        if death_records {
            let queue = s.delay_queue(delay);
            assert!(
                deaths(&run.headers).contains(&(queue.as_str(), "expired")),
                "run {} did not come through {queue}: x-death {:?}",
                i + 1,
                deaths(&run.headers)
            );
        }
        let waited = run.at - runs[i - 1].at;
        assert_waited(timing, &format!("retry {i}"), waited, delay);
        notes.push(describe_wait(timing, waited, delay));
    }
    if death_records {
        notes.push("x-death shows each delay queue expired it".to_owned());
    } else {
        notes.push("x-death not visible: checked x-retry-delay only".to_owned());
    }
    assert_eq!((report.retried, report.handled), (2, 1), "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed(notes)
}

/// Every attempt fails: after the last one the message is parked, with the engine's
/// diagnostics and its body intact.
pub async fn attempts_exhausted_parked<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let delays = [ms(100), ms(200)];
    let policy = RetryPolicy::delays(delays).build().expect("policy");
    let s = setup(h, "exhaust", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("doomed");
    h.publish(&s.queue, &m).await;

    let report = run_until(
        h,
        |t| {
            s.consumer(t, &journal, journal.handler(|_| Step::Fail), 4)
                .build()
                .expect("consumer")
        },
        "doomed parked",
        || journal.is_finished(&m.id),
    )
    .await;

    assert_eq!(
        journal.terminals_of(&m.id),
        [
            Terminal::Retried {
                attempts: 1,
                delay: delays[0]
            },
            Terminal::Retried {
                attempts: 2,
                delay: delays[1]
            },
            Terminal::DeadLettered {
                reason: DeadLetterReason::AttemptsExhausted
            },
        ]
    );
    assert_eq!(journal.runs_of(&m.id).len(), 3);
    let parked = h.take_parked(&s.plan).await;
    let p = only_parked(&parked, &m);
    let record = p.record();
    assert_eq!(record.reason, Some(DeadLetterReason::AttemptsExhausted));
    assert_eq!((record.attempts, record.crashes), (3, 0));
    assert_eq!(record.last_error, Some(transient_cause(3).as_str()));
    assert_eq!(record.origin_queue, Some(s.queue.as_str()));
    assert_eq!(record.origin_exchange, Some(""));
    assert_eq!(record.origin_routing_key, Some(s.queue.as_str()));
    assert_eq!(record.delay, None, "a parked copy carries no delay");
    assert!(record.malformed.is_empty(), "{:?}", record.malformed);
    let (first, last) = (
        record.first_failure.expect("first failure recorded"),
        record.last_failure.expect("last failure recorded"),
    );
    let span = last.saturating_duration_since(first);
    assert_waited(
        h.capabilities().timing,
        "first to last failure",
        span,
        delays[0] + delays[1],
    );
    assert_eq!((report.retried, report.dead_lettered), (2, 1), "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "parked after 3 attempts: reason attempts-exhausted, last error kept, origin {}, failures {span:.1?} apart",
        s.queue,
    )])
}

fn only_parked<'a>(parked: &'a [ParkedMessage], m: &TestMessage) -> &'a ParkedMessage {
    assert_eq!(parked.len(), 1, "parking queue: {parked:?}");
    let p = &parked[0];
    assert_eq!(p.id.as_deref(), Some(m.id.as_str()));
    assert_eq!(
        p.body, m.body,
        "the parked body is the original's, byte for byte"
    );
    p
}

/// A permanent failure is parked at once, without a retry.
pub async fn permanent_parked<H: Harness>(h: &H) -> Verdict {
    let policy = RetryPolicy::delays([ms(200), ms(400)])
        .build()
        .expect("policy");
    let s = setup(h, "perm", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("bad-schema");
    h.publish(&s.queue, &m).await;

    let report = run_until(
        h,
        |t| {
            s.consumer(t, &journal, journal.handler(|_| Step::Permanent), 4)
                .build()
                .expect("consumer")
        },
        "bad-schema parked",
        || journal.is_finished(&m.id),
    )
    .await;

    assert_eq!(
        journal.terminals_of(&m.id),
        [Terminal::DeadLettered {
            reason: DeadLetterReason::Permanent
        }]
    );
    assert_eq!(journal.runs_of(&m.id).len(), 1);
    let parked = h.take_parked(&s.plan).await;
    let record = only_parked(&parked, &m).record();
    assert_eq!(record.reason, Some(DeadLetterReason::Permanent));
    assert_eq!((record.attempts, record.crashes), (1, 0));
    assert_eq!(record.last_error, Some(permanent_cause(1).as_str()));
    assert_eq!(record.origin_queue, Some(s.queue.as_str()));
    assert_eq!(report.dead_lettered, 1, "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed(["parked on the first run with reason permanent".to_owned()])
}

/// A handler's retry-after is honoured, clamped to the policy's delay bounds at both ends.
pub async fn retry_after<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let (short, long) = (ms(100), ms(2_000));
    let policy = RetryPolicy::delays([short, long]).build().expect("policy");
    let s = setup(h, "after", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    // (message, what the handler asks for, the delay the engine should use). The 600 ms one
    // rides the 2 s level with a per-message TTL, so it must be ahead of the 2 s one there:
    // prefetch 1 keeps the publish order.
    let cases = [
        ("ra-600ms", ms(600), ms(600)),
        ("ra-1ms", ms(1), short),
        ("ra-1h", Duration::from_secs(3_600), long),
    ];
    let messages: Vec<_> = cases
        .iter()
        .map(|(id, _, _)| TestMessage::new(*id))
        .collect();
    publish_all(h, &s.queue, &messages).await;

    let asks: Vec<(String, Duration)> = cases
        .iter()
        .map(|(id, d, _)| ((*id).to_owned(), *d))
        .collect();
    let report = run_until(
        h,
        |t| {
            let handler = journal.handler(move |r| {
                if r.run > 1 {
                    return Step::Succeed;
                }
                let asked = asks.iter().find(|(id, _)| *id == r.id).map(|(_, d)| *d);
                Step::RetryAfter(asked.expect("a known message"))
            });
            s.consumer(t, &journal, handler, 1)
                .build()
                .expect("consumer")
        },
        "every retry-after message handled",
        || journal.finished() == cases.len(),
    )
    .await;

    let timing = h.capabilities().timing;
    let mut notes = Vec::new();
    for (id, asked, delay) in cases {
        assert_eq!(
            journal.terminals_of(id),
            [
                Terminal::Retried { attempts: 1, delay },
                Terminal::Handled { attempt: 2 }
            ],
            "{id} asked for {asked:?}"
        );
        let runs = journal.runs_of(id);
        assert_eq!(
            runs[1].headers.get(DELAY).and_then(HeaderValue::as_i64),
            Some(millis(delay))
        );
        let waited = runs[1].at - runs[0].at;
        assert_waited(timing, id, waited, delay);
        notes.push(format!(
            "asked {asked:?} → {}",
            describe_wait(timing, waited, delay)
        ));
    }
    assert_eq!((report.retried, report.handled), (3, 3), "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed(notes)
}

/// Two immediate (in-process) retries on the same delivery, then a delayed one through the
/// broker, then success.
pub async fn immediate_then_delayed<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let (wait, delay) = (ms(50), ms(300));
    let policy = RetryPolicy::delays([delay])
        .with_immediate_retries(2, wait)
        .build()
        .expect("policy");
    let s = setup(h, "immediate", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("warming-up");
    h.publish(&s.queue, &m).await;

    let report = run_until(
        h,
        |t| {
            let handler = journal.handler(|r| {
                if r.run <= 3 {
                    Step::Fail
                } else {
                    Step::Succeed
                }
            });
            s.consumer(t, &journal, handler, 4)
                .build()
                .expect("consumer")
        },
        "warming-up handled",
        || journal.is_finished(&m.id),
    )
    .await;

    assert_eq!(
        journal.terminals_of(&m.id),
        [
            Terminal::Retried { attempts: 3, delay },
            Terminal::Handled { attempt: 4 }
        ]
    );
    let runs = journal.runs_of(&m.id);
    let attempts: Vec<u32> = runs.iter().map(|r| r.info.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 4]);
    for r in &runs[..3] {
        // The first three runs are one delivery: no delayed copy was involved yet.
        assert_eq!(r.headers.get(DELAY), None, "{r:?}");
    }
    assert_eq!(
        runs[3].headers.get(DELAY).and_then(HeaderValue::as_i64),
        Some(millis(delay))
    );
    assert_eq!(
        runs[3].headers.get(ATTEMPTS).and_then(HeaderValue::as_i64),
        Some(3)
    );
    let timing = h.capabilities().timing;
    let mut notes = Vec::new();
    for (i, expected) in [(1, wait), (2, wait), (3, delay)] {
        let waited = runs[i].at - runs[i - 1].at;
        assert_waited(timing, &format!("run {}", i + 1), waited, expected);
        notes.push(describe_wait(timing, waited, expected));
    }
    assert_eq!(
        (report.received, report.retried, report.handled),
        (2, 1, 1),
        "three runs on one delivery, one on the delayed copy: {report:?}"
    );
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed(notes)
}

/// Runs a consumer with `prefetch` that hangs on `victim` until its run count passes
/// `runs_before` (then kills it and crashes its connection) or until `finished` holds (then
/// stops it). Returns whether it was killed.
async fn crash_on_run<H: Harness>(
    h: &H,
    s: &Setup,
    journal: &Journal,
    handler: ScriptedHandler,
    (victim, prefetch): (&str, u16),
    finished: impl Fn() -> bool,
) -> bool {
    let runs_before = journal.runs_of(victim).len();
    let t = h.transport().await;
    let consumer = s
        .consumer(Arc::clone(&t), journal, handler, prefetch)
        .build()
        .expect("consumer");
    let (ended, ()) = drive(consumer, |control| async move {
        wait_until(
            h,
            WITHIN,
            || format!("{victim} neither ran again nor finished"),
            || journal.runs_of(victim).len() > runs_before || finished(),
        )
        .await;
        if journal.runs_of(victim).len() > runs_before {
            control.kill();
        } else {
            control.stop();
        }
    })
    .await;
    match ended {
        Ended::Killed => {
            h.crash(t).await;
            true
        }
        Ended::Stopped(_) => {
            h.close(t).await;
            false
        }
    }
}

/// A consumer dies holding a message; the next consumer gets it back redelivered: a
/// suspect, cloned into the isolation queue without a run and without a crash counted,
/// then run alone and handled.
pub async fn redelivered_isolated<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::CrashConsumer]) {
        return skip;
    }
    let policy = RetryPolicy::delays([ms(300)]).build().expect("policy");
    let s = setup(h, "suspect", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("victim");
    h.publish(&s.queue, &m).await;
    let script = |r: &crate::RunInfo| {
        if r.run == 1 {
            Step::Hang
        } else {
            Step::Succeed
        }
    };

    let killed = crash_on_run(h, &s, &journal, journal.handler(script), (&m.id, 1), || {
        false
    })
    .await;
    assert!(killed, "the first consumer was killed mid-handler");
    let report = run_until(
        h,
        |t| {
            s.consumer(t, &journal, journal.handler(script), 4)
                .build()
                .expect("consumer")
        },
        "victim handled after the crash",
        || journal.is_finished(&m.id),
    )
    .await;

    assert_eq!(
        journal.terminals_of(&m.id),
        [Terminal::Isolated, Terminal::Handled { attempt: 1 }]
    );
    let runs = journal.runs_of(&m.id);
    assert_eq!(runs.len(), 2, "{runs:?}");
    let alone = &runs[1];
    assert!(
        alone.headers.get(SUSPECT).is_some(),
        "the suspect's copy ran"
    );
    // Counters of 0 are not written: absent, they read as 0.
    let record = ParkedRecord::decode(&alone.headers);
    assert_eq!(
        (record.crashes, record.attempts),
        (0, 0),
        "no crash counted"
    );
    assert_eq!(alone.headers.get(DELAY), None);
    let isolated_at = journal.terminal_records_of(&m.id)[0].at;
    assert!(isolated_at <= alone.at, "isolated before it ran alone");
    assert_eq!(
        (
            report.received,
            report.isolated,
            report.suspects,
            report.handled
        ),
        (2, 1, 1, 1),
        "{report:?}"
    );
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "redelivered copy isolated without a run or a crash; ran alone {:.1?} later and was handled",
        alone.at.saturating_sub(isolated_at)
    )])
}

/// A poison message kills every consumer that runs it. Its first crash, beside the
/// others, only makes it a suspect; each solo crash is counted and diverted through the
/// crash delay; past the crash limit it is parked with reason `crash-loop`. The other
/// messages are handled.
pub async fn crash_limit_parked<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::CrashConsumer, Need::DelayedRetries]) {
        return skip;
    }
    let limit = 2;
    let policy = RetryPolicy::delays([ms(300)])
        .with_crash_limit(limit)
        .build()
        .expect("policy");
    crash_loop(h, "crashloop", policy, 1, limit).await
}

/// With [`CrashAction::RunHandler`] a suspect that took its consumer down goes straight
/// back to the isolation queue, counted, and runs alone again: no crash delay.
pub async fn crash_limit_run_handler<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::CrashConsumer]) {
        return skip;
    }
    let limit = 2;
    let policy = RetryPolicy::delays([ms(300)])
        .with_crash_limit(limit)
        .with_on_crash(CrashAction::RunHandler)
        .build()
        .expect("policy");
    crash_loop(h, "crashrun", policy, 1, limit).await
}

/// A poison message sharing a prefetch window of 10 with nine bystanders that are still
/// running when it kills their consumer: only the poison is ever blamed. The bystanders
/// come back as suspects once, run alone and are handled, with no crash recorded.
pub async fn poison_with_bystanders<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::CrashConsumer, Need::DelayedRetries]) {
        return skip;
    }
    let limit = 1;
    let policy = RetryPolicy::delays([ms(300)])
        .with_crash_limit(limit)
        .build()
        .expect("policy");
    crash_loop(h, "bystanders", policy, 10, limit).await
}

async fn crash_loop<H: Harness>(
    h: &H,
    scenario: &str,
    policy: RetryPolicy,
    prefetch: u16,
    limit: u32,
) -> Verdict {
    let s = setup(h, scenario, policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let poison = TestMessage::new("poison");
    let count = if prefetch > 1 { 9 } else { 3 };
    let bystanders: Vec<_> = (1..=count)
        .map(|i| TestMessage::new(format!("by-{i}")))
        .collect();
    publish_all(h, &s.queue, &bystanders[..1]).await;
    h.publish(&s.queue, &poison).await;
    publish_all(h, &s.queue, &bystanders[1..]).await;
    // With a shared window the bystanders are still running when the poison strikes the
    // first consumer. Later consumers run them at once: one that first runs there, beside
    // others, must not hold up the drain before a solo phase.
    let first_consumer = Arc::new(AtomicBool::new(prefetch > 1));
    let script = |in_first: Arc<AtomicBool>| {
        move |r: &crate::RunInfo| {
            if r.id == "poison" || (r.run == 1 && in_first.load(Ordering::SeqCst)) {
                Step::Hang
            } else {
                Step::Succeed
            }
        }
    };

    // Each consumer dies on the poison's run; the last one parks it without running it.
    let all_done = || journal.finished() == 1 + bystanders.len();
    let mut consumers = 0;
    let mut crashes = 0;
    loop {
        consumers += 1;
        assert!(
            consumers <= limit + 3,
            "still looping after {consumers} consumers (crash limit {limit}); the poison ended {:?}",
            journal.terminals_of(&poison.id)
        );
        let killed = crash_on_run(
            h,
            &s,
            &journal,
            journal.handler(script(Arc::clone(&first_consumer))),
            (&poison.id, prefetch),
            all_done,
        )
        .await;
        first_consumer.store(false, Ordering::SeqCst);
        if !killed {
            break;
        }
        crashes += 1;
    }

    // One crash beside the others (not counted), then one more solo crash than the limit.
    let poison_story = || {
        format!(
            "the poison's terminals {:?}, its runs {:?}",
            journal.terminals_of(&poison.id),
            journal.runs_of(&poison.id)
        )
    };
    assert_eq!(crashes, limit + 2, "{}", poison_story());
    assert_eq!(consumers, limit + 3, "{}", poison_story());
    let delay = match s.policy.on_crash() {
        CrashAction::Divert => s.policy.crash_delay(),
        CrashAction::RunHandler => Duration::ZERO,
    };
    let expected: Vec<Terminal> = [Terminal::Isolated]
        .into_iter()
        .chain((1..=limit).map(|crashes| Terminal::Diverted { crashes, delay }))
        .chain([Terminal::DeadLettered {
            reason: DeadLetterReason::CrashLoop,
        }])
        .collect();
    assert_eq!(journal.terminals_of(&poison.id), expected);
    let runs = journal.runs_of(&poison.id);
    assert_eq!(runs.len() as u32, limit + 2, "{runs:?}");
    for (i, r) in runs.iter().enumerate() {
        let crashes = r
            .headers
            .get(CRASHES)
            .and_then(HeaderValue::as_i64)
            .unwrap_or(0);
        assert_eq!(crashes, i.saturating_sub(1) as i64, "run {}: {r:?}", i + 1);
    }
    let mut bystander_runs = 0;
    for b in &bystanders {
        let terminals = journal.terminals_of(&b.id);
        assert!(
            matches!(terminals.last(), Some(Terminal::Handled { .. })),
            "{}: {terminals:?}",
            b.id
        );
        assert!(
            terminals
                .iter()
                .all(|t| matches!(t, Terminal::Isolated | Terminal::Handled { .. })),
            "{} was blamed: {terminals:?}",
            b.id
        );
        for r in journal.runs_of(&b.id) {
            assert!(
                r.headers
                    .get(CRASHES)
                    .and_then(HeaderValue::as_i64)
                    .unwrap_or(0)
                    == 0,
                "{} ran with a crash recorded: {r:?}",
                b.id
            );
            bystander_runs += 1;
        }
    }
    let parked = h.take_parked(&s.plan).await;
    let record = only_parked(&parked, &poison).record();
    assert_eq!(record.reason, Some(DeadLetterReason::CrashLoop));
    assert_eq!((record.crashes, record.attempts), (limit + 1, 0));
    assert_eq!(record.origin_queue, Some(s.queue.as_str()));
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "parked crash-loop after {} solo crashes (limit {limit}) over {consumers} consumers at prefetch {prefetch}; {} bystanders handled in {bystander_runs} runs, none blamed",
        limit + 1,
        bystanders.len()
    )])
}

/// The broker refuses every retry's clone: after the publish retries the original is
/// requeued, not acknowledged, so nothing is lost. It comes back redelivered, is isolated as
/// a suspect (no crash counted), runs alone and is handled.
pub async fn refused_publish_not_lost<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(
        h,
        &[
            Need::RefusePublishes,
            Need::PublisherConfirms,
            Need::DelayedRetries,
        ],
    ) {
        return skip;
    }
    let delay = ms(200);
    let policy = RetryPolicy::delays([delay])
        .with_publish_retries(2, ms(20))
        .build()
        .expect("policy");
    let s = setup_with_faults(h, "refused", policy, false, |plan| TopologyFaults {
        refuse_publishes_to: vec![delay_queue(plan, delay)],
    })
    .await;
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("must-not-be-lost");
    h.publish(&s.queue, &m).await;

    let t = h.transport().await;
    h.prepare(&t, &s.plan).await;
    let handler = journal.handler(|r| {
        if r.run == 1 {
            Step::Fail
        } else {
            Step::Succeed
        }
    });
    // The harness changed the refusing queue's arguments: the consumer must not redeclare.
    let consumer = s
        .consumer(Arc::clone(&t), &journal, handler, 1)
        .with_provision(false)
        .build()
        .expect("consumer");
    let (ended, ()) = drive(consumer, |_| {
        wait_until(
            h,
            WITHIN,
            || format!("{} handled", m.id),
            || journal.is_finished(&m.id),
        )
    })
    .await;
    h.close(t).await;
    let report = ended.report();

    let terminals = journal.terminals_of(&m.id);
    assert_eq!(terminals.len(), 3, "{terminals:?}");
    let Terminal::Requeued { cause } = terminals[0] else {
        panic!("the refused clone must requeue the original: {terminals:?}");
    };
    assert_ne!(cause, retry_core::Confirm::Ack);
    assert_eq!(
        terminals[1..],
        [Terminal::Isolated, Terminal::Handled { attempt: 1 }]
    );
    let runs = journal.runs_of(&m.id);
    assert_eq!(runs.len(), 2);
    assert!(
        runs[1].headers.get(SUSPECT).is_some(),
        "the suspect's copy ran"
    );
    let record = ParkedRecord::decode(&runs[1].headers);
    assert_eq!(record.crashes, 0, "no crash counted");
    assert_eq!(
        (
            report.requeued,
            report.isolated,
            report.diverted,
            report.handled
        ),
        (1, 1, 0, 1),
        "{report:?}"
    );
    assert!(h.take_parked(&s.plan).await.is_empty());
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "clone refused 3 times ({cause:?}), original requeued, isolated as a suspect with 0 crashes, run alone, handled: published 1 = handled 1"
    )])
}

/// A 1 s retry published behind a 10 s one comes back first: delays do not queue behind
/// each other.
pub async fn no_head_of_line_blocking<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let (fast, slow) = (Duration::from_secs(1), Duration::from_secs(10));
    let policy = RetryPolicy::delays([fast, slow]).build().expect("policy");
    let s = setup(h, "hol", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let (first, second) = (TestMessage::new("slow-10s"), TestMessage::new("fast-1s"));
    publish_all(h, &s.queue, &[first.clone(), second.clone()]).await;

    let report = run_until(
        h,
        |t| {
            let handler = journal.handler(move |r| match (r.run, r.id.as_str()) {
                (1, "slow-10s") => Step::RetryAfter(slow),
                (1, _) => Step::RetryAfter(fast),
                _ => Step::Succeed,
            });
            // Prefetch 1: the 10 s clone is published before the 1 s one.
            s.consumer(t, &journal, handler, 1)
                .build()
                .expect("consumer")
        },
        "both messages handled",
        || journal.finished() == 2,
    )
    .await;

    let slow_runs = journal.runs_of(&first.id);
    let fast_runs = journal.runs_of(&second.id);
    assert!(
        slow_runs[0].at <= fast_runs[0].at,
        "the 10 s retry was scheduled first"
    );
    assert!(
        fast_runs[1].at < slow_runs[1].at,
        "the 1 s retry came back at {:?}, after the 10 s one at {:?}",
        fast_runs[1].at,
        slow_runs[1].at
    );
    let timing = h.capabilities().timing;
    let fast_wait = fast_runs[1].at - fast_runs[0].at;
    let slow_wait = slow_runs[1].at - slow_runs[0].at;
    assert_waited(timing, "fast retry", fast_wait, fast);
    assert_waited(timing, "slow retry", slow_wait, slow);
    assert_eq!(
        journal.terminals_of(&second.id),
        [
            Terminal::Retried {
                attempts: 1,
                delay: fast
            },
            Terminal::Handled { attempt: 2 }
        ]
    );
    assert_eq!((report.retried, report.handled), (2, 2), "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "1 s retry back after {fast_wait:.1?}, before the 10 s one (back after {slow_wait:.1?})"
    )])
}

/// With the delay cascade, any delay comes back on time: a 1.5 s retry-after published
/// behind a 3 s one (which the per-delay topology would hold in the same 3 s queue), and
/// retries whose delays the policy's full jitter picks (which it would hold in the 1 s queue
/// in publish order). Each comes back after its own delay rounded up to the cascade's unit
/// (exactly, on virtual time), and every retry due a unit or more before another comes back
/// first (on a real broker, one due at least a unit plus a margin before).
pub async fn no_head_of_line_blocking_any_delay<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DeclaresTopology, Need::DeadLetterExchange]) {
        return skip;
    }
    let (short_level, long_level) = (Duration::from_secs(1), Duration::from_secs(3));
    let policy = RetryPolicy::delays([short_level, long_level])
        .with_jitter(Jitter::Full)
        .build()
        .expect("policy");
    let s = setup_cascade(h, "hol-any", policy, Cascade::new()).await;
    let cascade = s.plan.cascade().expect("a cascade plan").clone();
    let (slow, fast) = (long_level, ms(1_500));
    let mut messages = vec![TestMessage::new("slow-3s"), TestMessage::new("fast-1.5s")];
    messages.extend((1..=6).map(|i| TestMessage::new(format!("jittered-{i}"))));
    publish_all(h, &s.queue, &messages).await;

    let journal = Journal::new(h.stopwatch());
    let report = run_until(
        h,
        |t| {
            let handler = journal.handler(move |r| match (r.run, r.id.as_str()) {
                (1, "slow-3s") => Step::RetryAfter(slow),
                (1, "fast-1.5s") => Step::RetryAfter(fast),
                (1, _) => Step::Fail,
                _ => Step::Succeed,
            });
            // Prefetch 1: the clones are published in the messages' order.
            s.consumer(t, &journal, handler, 1)
                .build()
                .expect("consumer")
        },
        "every message handled",
        || journal.finished() == messages.len(),
    )
    .await;

    let timing = h.capabilities().timing;
    // (id, delay the engine chose, when it was due, when it came back)
    let mut retries = Vec::new();
    let mut fast_wait = Duration::ZERO;
    for m in &messages {
        let Some(Terminal::Retried { delay, .. }) = journal.terminals_of(&m.id).first().copied()
        else {
            panic!("{} was not retried first", m.id);
        };
        let runs = journal.runs_of(&m.id);
        assert_eq!(runs.len(), 2, "{}: {runs:?}", m.id);
        let waited = runs[1].at - runs[0].at;
        // The delay rounded up to the unit, worked out here rather than asked of the plan.
        let unit = cascade.unit().as_nanos();
        let rounded = Duration::from_nanos(
            u64::try_from(delay.as_nanos().div_ceil(unit) * unit).expect("test delays fit"),
        );
        assert_waited(timing, &m.id, waited, rounded);
        if delay == fast {
            fast_wait = waited;
        }
        retries.push((m.id.clone(), delay, runs[0].at + delay, runs[1].at));
    }
    let margin = match timing {
        Timing::Virtual => cascade.unit(),
        // Scenarios run side by side on a small machine: each hop through a level can
        // be late by a few milliseconds.
        Timing::Wall { .. } => cascade.unit() + ms(200),
    };
    for (a, _, due_a, back_a) in &retries {
        for (b, _, due_b, back_b) in &retries {
            if *due_a + margin <= *due_b {
                assert!(
                    back_a < back_b,
                    "{a} was due at {due_a:?}, before {b} at {due_b:?}, but came back at {back_a:?}, after it ({back_b:?})"
                );
            }
        }
    }
    assert_eq!((report.retried, report.handled), (8, 8), "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    let delays: Vec<String> = retries
        .iter()
        .map(|(_, d, _, _)| format!("{d:.0?}"))
        .collect();
    Verdict::passed([
        describe_wait(timing, fast_wait, fast),
        format!(
            "delays {} through a {}-level cascade, each back in due order",
            delays.join(", "),
            cascade.levels()
        ),
    ])
}

/// The transport declares a plan itself, idempotently, and the declared delay queue routes
/// a retry back.
pub async fn transport_declares_topology<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DeclaresTopology, Need::DelayedRetries]) {
        return skip;
    }
    let delay = ms(200);
    let policy = RetryPolicy::delays([delay]).build().expect("policy");
    let queue = h.unique_queue("declare");
    let plan = TopologyPlan::new(&queue, &policy).expect("plan");
    h.track(&plan);
    let t = h.transport().await;
    t.provision(&plan)
        .await
        .expect("the transport declares the plan");
    t.provision(&plan)
        .await
        .expect("declaring the same plan again is a no-op");
    let s = Setup {
        queue,
        policy,
        plan,
        quorum: false,
        strategy: DelayStrategy::default(),
    };
    let journal = Journal::new(h.stopwatch());
    let m = TestMessage::new("after-declare");
    h.publish(&s.queue, &m).await;
    let handler = journal.handler(|r| {
        if r.run == 1 {
            Step::Fail
        } else {
            Step::Succeed
        }
    });
    let consumer = s
        .consumer(Arc::clone(&t), &journal, handler, 4)
        .build()
        .expect("consumer");
    let (ended, ()) = drive(consumer, |_| {
        wait_until(
            h,
            WITHIN,
            || format!("{} handled", m.id),
            || journal.is_finished(&m.id),
        )
    })
    .await;
    h.close(t).await;
    let report = ended.report();
    assert_eq!(
        journal.terminals_of(&m.id),
        [
            Terminal::Retried { attempts: 1, delay },
            Terminal::Handled { attempt: 2 }
        ]
    );
    assert_eq!(report.handled, 1, "{report:?}");
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([format!(
        "{} queues declared twice; the retry came back through the declared delay queue",
        s.plan.queues().len()
    )])
}

/// 1,000 messages with seeded random outcomes at prefetch 50: every message is accounted
/// for exactly, every message's decisions are the engine's, and no message is duplicated
/// (no faults are injected).
pub async fn seeded_storm<H: Harness>(h: &H) -> Verdict {
    if let Some(skip) = unmet(h, &[Need::DelayedRetries]) {
        return skip;
    }
    let config = StormConfig {
        messages: 1_000,
        seed: 0x5eed,
        prefetch: 50,
        // No faults are injected, on any harness: nothing may duplicate a message.
        max_duplicates: 0,
    };
    let report = storm(h, &config).await;
    Verdict::passed([report.summary()])
}

/// The parking lot through the public API: three messages parked for three reasons
/// (`permanent`, `attempts-exhausted`, and one without the engine's headers, `unknown`),
/// browsed without being taken; the permanent one replayed by reason, with its counters
/// reset and its history kept, and handled by the consumer on attempt 1; the two others
/// left parked unchanged; one of them purged by id.
pub async fn parking_lot<H: Harness>(h: &H) -> Verdict {
    use retry_core::headers::{PREVIOUS_ERROR, PREVIOUS_REASON, REPLAYED_AT, REPLAYS};
    use retry_core::{ParkedFilter, ParkedReason, ParkingLot, ReplayOptions};

    let policy = RetryPolicy::delays([ms(100)])
        .with_max_attempts(1)
        .build()
        .expect("policy");
    let s = setup(h, "lot", policy, false).await;
    let journal = Journal::new(h.stopwatch());
    let (perm, exhaust, stray) = (
        TestMessage::new("lot-perm"),
        TestMessage::new("lot-exhaust"),
        TestMessage::new("lot-stray"),
    );
    publish_all(h, &s.queue, &[perm.clone(), exhaust.clone()]).await;
    // Parked by something else than the engine: no `x-retry-*` header at all.
    h.publish(s.plan.parking_queue(), &stray).await;
    let fixed = Arc::new(AtomicBool::new(false));
    let script = {
        let fixed = Arc::clone(&fixed);
        move |run: &crate::journal::RunInfo| match run.id.as_str() {
            "lot-perm" if fixed.load(Ordering::SeqCst) => Step::Succeed,
            "lot-perm" => Step::Permanent,
            _ => Step::Fail,
        }
    };
    let consumer = |t| {
        s.consumer(t, &journal, journal.handler(script.clone()), 4)
            .build()
            .expect("consumer")
    };
    run_until(h, consumer, "two messages parked", || {
        journal.is_finished(&perm.id) && journal.is_finished(&exhaust.id)
    })
    .await;

    let transport = h.transport().await;
    let lot = ParkingLot::new(Arc::clone(&transport), &s.plan);
    let browse = |filter: ParkedFilter| {
        let lot = &lot;
        async move {
            let mut seen = Vec::new();
            let report = lot
                .browse(&filter, |p| {
                    seen.push(p);
                    std::ops::ControlFlow::Continue(())
                })
                .await
                .expect("browse");
            (report, seen)
        }
    };
    let reasons = |seen: &[retry_core::ParkedMessage]| {
        let mut r: Vec<(String, String)> = seen
            .iter()
            .map(|p| (p.id().unwrap_or("?").to_owned(), p.reason().to_string()))
            .collect();
        r.sort();
        r
    };
    let (report, before) = browse(ParkedFilter::all()).await;
    assert_eq!(
        reasons(&before),
        [
            ("lot-exhaust".to_owned(), "attempts-exhausted".to_owned()),
            ("lot-perm".to_owned(), "permanent".to_owned()),
            ("lot-stray".to_owned(), "unknown".to_owned()),
        ],
        "{report:?}"
    );
    // Browsing took nothing: a second look sees the same three.
    let (_, again) = browse(ParkedFilter::all()).await;
    assert_eq!(
        reasons(&again),
        reasons(&before),
        "browsing removed messages"
    );

    // Replay the permanent one, now that its bug is fixed.
    fixed.store(true, Ordering::SeqCst);
    let replayed = lot
        .replay(
            &ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent)),
            ReplayOptions::default(),
            |_| {},
        )
        .await
        .expect("replay");
    assert_eq!(
        (replayed.matched, replayed.replayed, replayed.left),
        (1, 1, 2),
        "{replayed:?}"
    );
    assert_eq!(h.ready(&s.queue).await, 1, "the copy is in the work queue");

    // The other two are still parked, unchanged: body, id and headers.
    let (_, after) = browse(ParkedFilter::all()).await;
    let unchanged = |id: &str| {
        let find = |list: &[retry_core::ParkedMessage]| {
            list.iter().find(|p| p.id() == Some(id)).map(|p| {
                (
                    p.message().body().to_vec(),
                    p.message().headers().clone(),
                    p.message().properties().clone(),
                )
            })
        };
        assert_eq!(find(&after), find(&before), "{id} changed while parked");
        assert!(find(&after).is_some(), "{id} left the parking queue");
    };
    unchanged(&exhaust.id);
    unchanged(&stray.id);
    assert_eq!(after.len(), 2, "{:?}", reasons(&after));

    // The consumer handles the copy on attempt 1, with reset counters and its history.
    run_until(h, consumer, "the replayed copy handled", || {
        journal.terminals_of(&perm.id).len() == 2
    })
    .await;
    let runs = journal.runs_of(&perm.id);
    let last = runs.last().expect("a run of the copy");
    assert_eq!(
        (last.info.attempt, last.step),
        (1, Step::Succeed),
        "{runs:?}"
    );
    let h2 = &last.headers;
    assert_eq!(
        h2.get(ATTEMPTS).and_then(HeaderValue::as_u64).unwrap_or(0),
        0
    );
    assert_eq!(
        h2.get(CRASHES).and_then(HeaderValue::as_u64).unwrap_or(0),
        0
    );
    assert_eq!(h2.get(REPLAYS).and_then(HeaderValue::as_u64), Some(1));
    assert!(h2.get(REPLAYED_AT).and_then(HeaderValue::as_u64).is_some());
    assert_eq!(
        h2.get(PREVIOUS_REASON).and_then(HeaderValue::as_str),
        Some("permanent")
    );
    assert_eq!(
        h2.get(PREVIOUS_ERROR).and_then(HeaderValue::as_str),
        Some(permanent_cause(1).as_str())
    );
    assert!(h2.get(retry_core::headers::REASON).is_none());
    assert_eq!(
        journal.terminals_of(&perm.id).last(),
        Some(&Terminal::Handled { attempt: 1 })
    );

    // Purge by id removes that one only.
    let purged = lot
        .purge(&ParkedFilter::ids([exhaust.id.as_str()]), |_| {})
        .await
        .expect("purge");
    assert_eq!((purged.purged, purged.left), (1, 1), "{purged:?}");
    let (_, rest) = browse(ParkedFilter::all()).await;
    assert_eq!(
        reasons(&rest),
        [("lot-stray".to_owned(), "unknown".to_owned())]
    );
    let cleared = lot
        .purge(&ParkedFilter::all(), |_| {})
        .await
        .expect("purge all");
    assert_eq!(cleared.purged, 1);
    h.close(transport).await;
    assert_nothing_left(h, &s.plan).await;
    Verdict::passed([
        "browsed 3 parked messages (permanent, attempts-exhausted, unknown) without taking any"
            .to_owned(),
        "replayed 1 by reason: handled on attempt 1 with reset counters; 2 left unchanged"
            .to_owned(),
        "purged 1 by id".to_owned(),
    ])
}
