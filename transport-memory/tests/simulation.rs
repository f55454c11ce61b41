//! The real consumer driver on the simulated broker: scripted handlers, crash loops, and
//! the virtual times at which things happen.

use std::time::Duration;

use retry_core::{
    CrashAction, DeadLetterReason, Exhausted, HandlerError, Message, ParkedRecord, QueueType,
    RetryPolicy, Terminal,
};
use transport_memory::{
    ConsumerState, Fate, Report, Script, SimEvent, Simulation, SimulationBuilder, Step, Stop,
};

/// A simulation that gives up after six virtual hours (every schedule here ends well
/// before), so a crash loop the engine fails to stop fails the test quickly instead of
/// spinning to the default one-year horizon.
fn simulation(queue: &str, policy: RetryPolicy) -> SimulationBuilder {
    Simulation::builder(queue, policy).with_horizon(Duration::from_secs(6 * 3600))
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn mins(n: u64) -> Duration {
    Duration::from_secs(60 * n)
}

/// 1 min, 10 min, 1 h: four runs at most.
fn policy() -> RetryPolicy {
    RetryPolicy::delays([mins(1), mins(10), mins(60)])
        .build()
        .unwrap()
}

/// Runs one message, "m", with `script` on a default simulation of queue "orders".
fn run_one(script: Script) -> (Simulation, Report) {
    let mut sim = simulation("orders", policy()).build().unwrap();
    sim.publish("m", script).unwrap();
    let report = sim.run_until_quiet();
    (sim, report)
}

fn since_start(report: &Report, at: retry_core::Timestamp) -> Duration {
    at.saturating_duration_since(report.started_at)
}

fn run_times(report: &Report, id: &str) -> Vec<Duration> {
    report
        .message(id)
        .unwrap()
        .runs
        .iter()
        .map(|r| since_start(report, r.at))
        .collect()
}

#[test]
fn a_poison_message_is_parked_after_exactly_the_crash_limit_of_solo_crashes() {
    for limit in [0, 1, 3, 5] {
        let policy = RetryPolicy::delays([mins(1), mins(10)])
            .with_crash_limit(limit)
            .build()
            .unwrap();
        let mut sim = simulation("comments", policy)
            .with_prefetch(1)
            .build()
            .unwrap();
        sim.publish("poison", Script::always(Step::Crash)).unwrap();
        let report = sim.run_until_quiet();
        assert_eq!(report.stop, Stop::Quiet);

        let poison = report.message("poison").unwrap();
        assert_eq!(
            poison.fate,
            Fate::Parked {
                reason: "crash-loop".into()
            },
            "crash limit {limit}"
        );
        // Its first crash, in the work lane, only makes it a suspect. The crash limit is
        // how many solo crashes it survives: each is diverted through the crash delay, and
        // the next one parks it.
        assert_eq!(poison.isolations, 1);
        assert_eq!(poison.runs.len() as u32, limit + 2, "crash limit {limit}");
        assert!(!poison.runs[0].solo);
        assert!(poison.runs[1..].iter().all(|r| r.solo));
        assert!(poison.runs.iter().all(|r| r.step == Step::Crash));
        assert_eq!(poison.delays, vec![mins(1); limit as usize]);
        assert_eq!(poison.crashes, limit + 1);
        let diverted = poison
            .terminals
            .iter()
            .filter(|(_, t)| matches!(t, Terminal::Diverted { .. }))
            .count();
        assert_eq!(diverted as u32, limit);
        let crashed = report
            .consumers
            .iter()
            .filter(|c| c.state == ConsumerState::Crashed)
            .count();
        assert_eq!(crashed as u32, limit + 2, "one process died per run");

        let parked = sim.broker().messages("comments.parking").unwrap();
        let record = ParkedRecord::decode(&parked[0].headers);
        assert_eq!(record.reason, Some(DeadLetterReason::CrashLoop));
        assert_eq!(record.crashes, limit + 1);
        assert_eq!(record.origin_queue, Some("comments"));
        assert_eq!(
            record.attempts, 0,
            "crashes are not counted as failed attempts"
        );
    }
}

#[test]
fn run_handler_sends_a_crashed_suspect_straight_back_to_run_alone() {
    let policy = RetryPolicy::delays([mins(1)])
        .with_on_crash(CrashAction::RunHandler)
        .with_crash_limit(2)
        .build()
        .unwrap();
    let mut sim = simulation("orders", policy)
        .with_prefetch(1)
        .with_restart_delay(secs(5))
        .build()
        .unwrap();
    sim.publish("poison", Script::always(Step::Crash)).unwrap();
    let report = sim.run_until_quiet();
    let m = report.message("poison").unwrap();
    assert_eq!(m.crashes, 3);
    assert_eq!(m.delays, [Duration::ZERO; 2], "no crash delay");
    // A run per process, each 5 s restart apart.
    assert_eq!(
        run_times(&report, "poison"),
        [Duration::ZERO, secs(5), secs(10), secs(15)]
    );
    assert_eq!(
        m.fate,
        Fate::Parked {
            reason: "crash-loop".into()
        }
    );
}

#[test]
fn a_poison_message_next_to_a_flaky_one_with_exact_virtual_times() {
    let mut sim = simulation("comments", policy())
        .with_prefetch(1)
        .with_restart_delay(secs(5))
        .build()
        .unwrap();
    sim.publish("poison", Script::always(Step::Crash)).unwrap();
    sim.publish("flaky", Script::fail_times(2)).unwrap();
    let report = sim.run_until_quiet();

    // The poison message crashes consumer 1 at once. Consumer 2 starts 5 s later, finds it
    // redelivered, isolates it and runs it alone: it dies again. Consumer 3 (10 s) finds it
    // redelivered from the isolation queue, counts crash 1 and diverts it through the 1 min
    // crash delay; every later solo crash costs the 1 min delay plus a 5 s restart.
    assert_eq!(
        run_times(&report, "poison"),
        [Duration::ZERO, secs(5), secs(70), secs(135), secs(200)]
    );
    assert_eq!(
        report.fate("poison"),
        Some(&Fate::Parked {
            reason: "crash-loop".into()
        })
    );
    // The flaky one was prefetched behind the poison message when consumer 2 died, so it
    // comes back a suspect once (never a crash) and runs alone on consumer 3 at 10 s; then
    // it follows its schedule: fail, 1 min, fail, 10 min, success. At 70 s it is back in
    // the work queue as the poison message is back in the isolation queue: the flaky run
    // ends before the poison message's solo run starts, at the same virtual instant.
    let flaky = report.message("flaky").unwrap();
    assert_eq!(flaky.crashes, 0);
    assert_eq!(flaky.delays, [mins(1), mins(10)]);
    assert!(matches!(flaky.fate, Fate::Handled { attempt: 3, .. }));
    assert_eq!(
        run_times(&report, "flaky"),
        [secs(10), secs(70), secs(70) + mins(10)],
        "{}",
        report.message("flaky").unwrap().timeline(report.started_at)
    );
    let totals = report.totals();
    assert_eq!((totals.published, totals.handled, totals.parked), (2, 1, 1));
}

#[test]
fn fail_three_times_then_succeed_follows_the_delays_exactly() {
    let (_, report) = run_one(Script::fail_times(3));
    let m = report.message("m").unwrap();
    assert_eq!(m.delays, [mins(1), mins(10), mins(60)]);
    assert_eq!(
        run_times(&report, "m"),
        [Duration::ZERO, mins(1), mins(11), mins(71)]
    );
    let attempts: Vec<u32> = m.runs.iter().map(|r| r.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 4]);
    assert!(matches!(m.fate, Fate::Handled { attempt: 4, .. }));
    assert_eq!(report.elapsed(), mins(71));
}

#[test]
fn attempts_run_out_and_the_message_is_parked_with_its_record() {
    let mut sim = simulation("orders", policy()).build().unwrap();
    sim.publish("doomed", Script::always(Step::fail("db down")))
        .unwrap();
    let report = sim.run_until_quiet();
    let m = report.message("doomed").unwrap();
    assert_eq!(m.runs.len(), 4);
    assert_eq!(
        m.fate,
        Fate::Parked {
            reason: "attempts-exhausted".into()
        }
    );
    let parked = sim.broker().messages("orders.parking").unwrap();
    let record = ParkedRecord::decode(&parked[0].headers);
    assert_eq!(record.attempts, 4);
    assert_eq!(record.last_error, Some("db down"));
    assert_eq!(record.origin_queue, Some("orders"));
}

#[test]
fn a_crash_on_attempt_two_makes_a_suspect_that_recovers_alone_uncounted() {
    let (_, report) = run_one(Script::steps([
        Step::fail("timeout"),
        Step::Crash,
        Step::Succeed,
    ]));
    let m = report.message("m").unwrap();
    let steps: Vec<&Step> = m.runs.iter().map(|r| &r.step).collect();
    assert_eq!(
        steps,
        [&Step::fail("timeout"), &Step::Crash, &Step::Succeed]
    );
    // The crash does not use up an attempt: the solo run after it is attempt 2 again.
    let attempts: Vec<u32> = m.runs.iter().map(|r| r.attempt).collect();
    assert_eq!(attempts, [1, 2, 2]);
    let solo: Vec<bool> = m.runs.iter().map(|r| r.solo).collect();
    assert_eq!(solo, [false, false, true]);
    assert_eq!(m.delays, [mins(1)]);
    assert_eq!((m.crashes, m.isolations), (0, 1));
    assert!(matches!(m.fate, Fate::Handled { attempt: 2, .. }));
}

#[test]
fn a_handler_that_always_panics_is_retried_then_parked() {
    let (mut sim, report) = run_one(Script::always(Step::panic("index out of bounds")));
    let m = report.message("m").unwrap();
    assert_eq!(m.runs.len(), 4);
    assert_eq!(
        m.fate,
        Fate::Parked {
            reason: "attempts-exhausted".into()
        }
    );
    let parked = sim.broker().messages("orders.parking").unwrap();
    assert_eq!(
        ParkedRecord::decode(&parked[0].headers).last_error,
        Some("index out of bounds"),
        "the panic message is the recorded cause"
    );
    let report = sim.shutdown();
    let ConsumerState::Finished(run) = &report.consumers[0].state else {
        panic!("consumer did not finish: {:?}", report.consumers[0].state)
    };
    assert_eq!(run.handler_panics, 4);
}

#[test]
fn a_permanent_error_is_parked_at_once() {
    let (_, report) = run_one(Script::always(Step::permanent("schema mismatch")));
    let m = report.message("m").unwrap();
    assert_eq!(m.runs.len(), 1);
    assert!(m.delays.is_empty());
    assert_eq!(
        m.fate,
        Fate::Parked {
            reason: "permanent".into()
        }
    );
    assert_eq!(report.elapsed(), Duration::ZERO);
}

#[test]
fn a_hanging_handler_is_cancelled_at_the_handler_timeout() {
    let mut sim = simulation("orders", policy())
        .with_handler_timeout(secs(20))
        .build()
        .unwrap();
    sim.publish("m", Script::steps([Step::Hang, Step::Succeed]))
        .unwrap();
    let report = sim.run_until_quiet();
    assert_eq!(
        run_times(&report, "m"),
        [Duration::ZERO, secs(20) + mins(1)]
    );
    assert!(matches!(
        report.fate("m"),
        Some(Fate::Handled { attempt: 2, .. })
    ));
}

#[test]
fn retry_after_and_slow_handlers_take_virtual_time() {
    let (_, report) =
        run_one(Script::steps([Step::retry_after(mins(10), "429"), Step::Succeed]).taking(secs(3)));
    assert_eq!(report.message("m").unwrap().delays, [mins(10)]);
    // Each run takes 3 s: the retry is scheduled at 3 s and runs at 10 min 3 s.
    assert_eq!(
        run_times(&report, "m"),
        [Duration::ZERO, mins(10) + secs(3)]
    );
    assert_eq!(report.elapsed(), mins(10) + secs(6));
}

#[test]
fn bystanders_of_a_crash_run_alone_once_and_are_never_blamed() {
    let mut sim = simulation("orders", policy())
        .with_prefetch(10)
        .build()
        .unwrap();
    sim.publish("poison", Script::always(Step::Crash)).unwrap();
    for i in 0..3 {
        // Slow enough to be in flight when the poison message kills the process.
        sim.publish(format!("ok{i}"), Script::succeed().taking(secs(1)))
            .unwrap();
    }
    let report = sim.run_until_quiet();
    assert_eq!(
        report.fate("poison"),
        Some(&Fate::Parked {
            reason: "crash-loop".into()
        })
    );
    for i in 0..3 {
        let m = report.message(&format!("ok{i}")).unwrap();
        assert_eq!(m.crashes, 0, "held when the process died, but never blamed");
        assert!(m.isolations >= 1, "redelivered, so a suspect");
        assert!(m.runs.iter().all(|r| r.step == Step::Succeed));
        assert!(matches!(m.fate, Fate::Handled { .. }), "{:?}", m.fate);
    }
    let totals = report.totals();
    assert_eq!((totals.handled, totals.parked), (3, 1));
    assert_eq!((totals.pending, totals.lost), (0, 0));
}

#[test]
fn a_crash_during_the_drain_never_blames_the_waiting_suspect() {
    // Two consumers. "w" runs on consumer 1 for 20 s, then kills it. "s" kills consumer 2
    // after 12 s, comes back redelivered to consumer 1, and is isolated there while "w"
    // still runs: consumer 1 drains, waiting for "w", and dies during the drain. The suspect
    // was never taken from the isolation queue (had it been, its 12 s run would have been
    // under way when consumer 1 died, and it would have been blamed).
    let mut sim = simulation("orders", policy())
        .with_consumers(2)
        .with_prefetch(10)
        .with_restart_delay(secs(60))
        .build()
        .unwrap();
    for (id, script) in [
        ("w", Script::always(Step::Crash).taking(secs(20))),
        (
            "s",
            Script::steps([Step::Crash, Step::Succeed]).taking(secs(12)),
        ),
    ] {
        let id = id.to_owned();
        sim.schedule(Duration::from_millis(1), SimEvent::Publish { id, script });
    }
    let report = sim.run_until_quiet();

    let s = report.message("s").unwrap();
    let consumers: Vec<(u32, bool)> = s.runs.iter().map(|r| (r.consumer, r.solo)).collect();
    assert_eq!(consumers[0], (2, false), "{consumers:?}");
    assert!(
        s.terminals
            .iter()
            .any(|(at, t)| *t == Terminal::Isolated && since_start(&report, *at) < secs(20)),
        "isolated while w ran: {:?}",
        s.terminals
    );
    assert!(s.runs[1].solo);
    assert!(
        since_start(&report, s.runs[1].at) > secs(20),
        "after the drain's crash"
    );
    assert_eq!(s.crashes, 0);
    assert!(matches!(s.fate, Fate::Handled { .. }));
    let w = report.message("w").unwrap();
    assert_eq!(
        w.fate,
        Fate::Parked {
            reason: "crash-loop".into()
        }
    );
}

#[test]
fn a_quorum_delivery_limit_backs_up_the_engine_when_no_clone_can_be_published() {
    // Every publish is refused, so a failed message can be neither retried nor isolated:
    // it is requeued each time, and the broker's delivery count grows until its limit
    // parks it.
    let policy = RetryPolicy::delays([mins(1)])
        .with_publish_retries(0, Duration::ZERO)
        .build()
        .unwrap();
    let mut sim = simulation("orders", policy)
        .with_queue_type(QueueType::Quorum)
        .with_delivery_limit(2)
        .with_prefetch(1)
        .build()
        .unwrap();
    sim.publish("m", Script::always(Step::fail("down")))
        .unwrap();
    sim.schedule(Duration::ZERO, SimEvent::RefusePublishes(1_000));
    let report = sim.run_until_quiet();
    let m = report.message("m").unwrap();
    assert_eq!(
        m.runs.len(),
        1,
        "a redelivery is a suspect, never run in the work lane"
    );
    assert_eq!(
        m.fate,
        Fate::Parked {
            reason: "delivery_limit".into()
        }
    );
    assert_eq!(m.crashes, 0);
}

#[test]
fn dropping_on_exhaustion_is_reported_as_dropped() {
    let policy = RetryPolicy::delays([mins(1)])
        .with_on_exhausted(Exhausted::Drop)
        .build()
        .unwrap();
    let mut sim = simulation("orders", policy).build().unwrap();
    sim.publish("m", Script::always(Step::fail("nope")))
        .unwrap();
    let report = sim.run_until_quiet();
    assert_eq!(
        report.fate("m"),
        Some(&Fate::Dropped {
            reason: DeadLetterReason::AttemptsExhausted
        })
    );
}

#[test]
fn your_own_handler_runs_under_simulated_crashes() {
    async fn handle(msg: Message) -> Result<(), HandlerError> {
        if msg.attempt() < 2 {
            return Err(HandlerError::transient("cold cache"));
        }
        Ok(())
    }
    let mut sim = simulation("orders", policy())
        .with_handler(handle)
        .build()
        .unwrap();
    sim.publish("a", Script::succeed()).unwrap();
    sim.publish("b", Script::steps([Step::Crash, Step::Succeed]))
        .unwrap();
    let report = sim.run_until_quiet();
    let a = report.message("a").unwrap();
    assert_eq!(a.runs[0].step, Step::fail("cold cache"));
    assert!(matches!(a.fate, Fate::Handled { attempt: 2, .. }));
    let b = report.message("b").unwrap();
    assert_eq!(b.runs[0].step, Step::Crash);
    assert_eq!((b.crashes, b.isolations), (0, 1), "a suspect, not a crash");
    assert!(b.runs[1].solo);
    assert!(matches!(b.fate, Fate::Handled { .. }));
}

#[test]
fn scheduled_events_happen_at_their_virtual_time() {
    let mut sim = simulation("orders", policy()).build().unwrap();
    sim.schedule(
        mins(5),
        SimEvent::Publish {
            id: "late".into(),
            script: Script::succeed(),
        },
    );
    let report = sim.run_until_quiet();
    assert_eq!(run_times(&report, "late"), [mins(5)]);

    let report = sim.run_for(mins(30));
    assert_eq!(
        report.elapsed(),
        mins(35),
        "run_for ends exactly 30 min later"
    );
}

#[test]
fn a_simulation_without_consumers_work_stops_at_the_horizon() {
    let mut sim = simulation("orders", policy())
        .with_horizon(mins(30))
        .build()
        .unwrap();
    sim.publish("m", Script::always(Step::fail("x"))).unwrap();
    let report = sim.run_until_quiet();
    assert_eq!(report.stop, Stop::Horizon);
    assert_eq!(
        report.fate("m"),
        Some(&Fate::Pending {
            queue: Some("orders.retry.1h".into())
        })
    );
}

#[test]
fn duplicate_ids_are_refused() {
    let mut sim = simulation("orders", policy()).build().unwrap();
    sim.publish("m", Script::succeed()).unwrap();
    assert!(sim.publish("m", Script::succeed()).is_err());
}
