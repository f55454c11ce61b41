//! Operating a consumer: storm control when a downstream dies, and metrics that agree
//! with the run's own report. All on virtual time.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use retry_core::{
    Consumer, DeadLetterReason, Handler, HandlerError, Message, RetryPolicy, RunReport, SoloGate,
    StormControl, Subscription, TopologyPlan, Transport,
};
use transport_memory::{Broker, ConsumerState, Outgoing, Report, Script, Simulation, Step};

const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);
const MESSAGES: usize = 5_000;

/// A handler whose downstream is down until told otherwise; it counts its runs.
#[derive(Clone, Default)]
struct Downstream {
    down: Arc<AtomicBool>,
    runs_while_down: Arc<AtomicU64>,
}

#[async_trait]
impl Handler for Downstream {
    async fn handle(&self, _msg: &Message) -> Result<(), HandlerError> {
        if self.down.load(Ordering::SeqCst) {
            self.runs_while_down.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::transient("payments API: connection refused"));
        }
        Ok(())
    }
}

/// The report the simulation's one consumer returned when it was shut down.
fn finished_run(report: &Report) -> RunReport {
    match &report.consumers[0].state {
        ConsumerState::Finished(run) => *run,
        other => panic!("the consumer did not finish: {other:?}"),
    }
}

/// What an outage did to the queue.
#[derive(Debug)]
struct Outage {
    parked_during: u64,
    runs_during: u64,
    report: Report,
    run: RunReport,
}

/// 5,000 messages queued; the downstream is down for 10 minutes, then up. The policy's
/// delays total 2 minutes (4 runs per message), so without storm control everything is
/// parked long before the downstream is back.
fn outage(storm: Option<StormControl>) -> Outage {
    let policy = RetryPolicy::delays([10 * SECOND, 30 * SECOND, 80 * SECOND])
        .build()
        .unwrap();
    let downstream = Downstream::default();
    downstream.down.store(true, Ordering::SeqCst);
    let mut builder = Simulation::builder("payments", policy)
        .with_handler(downstream.clone())
        .with_default_script(Script::succeed().taking(Duration::from_millis(50)))
        .with_prefetch(10)
        .with_horizon(24 * 60 * MINUTE);
    if let Some(storm) = storm {
        builder = builder.with_storm_control(storm);
    }
    let mut sim = builder.build().unwrap();
    for i in 0..MESSAGES {
        sim.publish(
            format!("p{i:04}"),
            Script::succeed().taking(Duration::from_millis(50)),
        )
        .unwrap();
    }
    let during = sim.run_for(10 * MINUTE);
    downstream.down.store(false, Ordering::SeqCst);
    sim.run_until_quiet();
    let report = sim.shutdown();
    let run = finished_run(&report);
    Outage {
        parked_during: during.totals().parked,
        runs_during: downstream.runs_while_down.load(Ordering::SeqCst),
        report,
        run,
    }
}

#[test]
fn without_storm_control_an_outage_parks_the_whole_queue() {
    let outage = outage(None);
    let totals = outage.report.totals();
    println!(
        "without storm control: {} of {MESSAGES} parked during the outage, {} handler runs during it",
        outage.parked_during, outage.runs_during
    );
    assert_eq!(outage.parked_during, MESSAGES as u64);
    assert_eq!(totals.parked, MESSAGES as u64);
    assert_eq!(outage.runs_during, 4 * MESSAGES as u64);
    assert_eq!(outage.run.storm_pauses, 0);
}

#[test]
fn storm_control_holds_the_queue_through_an_outage_and_handles_all_of_it_after() {
    let storm = StormControl::consecutive_failures(10)
        .with_cool_down(5 * SECOND, MINUTE)
        .with_probes(3);
    let outage = outage(Some(storm));
    let totals = outage.report.totals();
    println!(
        "with storm control: {} parked, {} handled, {} handler runs during the outage, {} pauses",
        totals.parked, totals.handled, outage.runs_during, outage.run.storm_pauses
    );
    assert_eq!((totals.parked, totals.lost, totals.pending), (0, 0, 0));
    assert_eq!(totals.handled, MESSAGES as u64);
    // The 10 runs under way (prefetch 10) tripped it, then one probe failed after each
    // cool-down: 5 s, 10 s, 20 s and 40 s, then every minute until the 10 minutes were up.
    let failed_probes = 4 + (10 * 60 - (5 + 10 + 20 + 40)) / 60;
    assert_eq!(outage.runs_during, 10 + failed_probes);
    assert_eq!(outage.run.storm_pauses, 1 + failed_probes);
    // Held deliveries waited unsettled, never requeued: none came back redelivered, so
    // nothing was isolated and no crash was counted, and every delivery got one run.
    assert_eq!((outage.run.isolated, outage.run.diverted), (0, 0));
    assert_eq!(totals.deliveries, totals.runs);
    assert!(
        outage
            .report
            .messages
            .values()
            .all(|m| m.crashes == 0 && m.isolations == 0)
    );
}

/// Counters, by name and labels, from a debugging recorder's snapshot.
fn counters(
    recorder: &DebuggingRecorder,
) -> (
    BTreeMap<String, u64>,
    BTreeMap<String, usize>,
    BTreeMap<String, f64>,
) {
    let (mut counts, mut samples, mut gauges) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
    for (key, _, _, value) in recorder.snapshotter().snapshot().into_vec() {
        let key = key.key();
        let labels: Vec<String> = key
            .labels()
            .filter(|l| l.key() != "queue")
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        match value {
            DebugValue::Counter(n) => {
                counts.insert(name, n);
            }
            DebugValue::Histogram(v) => {
                samples.insert(name, v.len());
            }
            DebugValue::Gauge(g) => {
                gauges.insert(name, g.into_inner());
            }
        }
    }
    (counts, samples, gauges)
}

#[test]
fn metrics_agree_with_the_run_report() {
    let policy = RetryPolicy::delays([10 * SECOND, MINUTE]).build().unwrap();
    let recorder = DebuggingRecorder::new();
    let (report, sim_report) = metrics::with_local_recorder(&recorder, || {
        let mut sim = Simulation::builder("orders", policy)
            .with_handler_timeout(5 * SECOND)
            .build()
            .unwrap();
        for i in 0..40 {
            let script = match i % 8 {
                0..=2 => Script::succeed(),
                3 => Script::fail_times(1),
                4 => Script::fail_times(2),
                5 => Script::always(Step::fail("down")),
                6 => Script::always(Step::permanent("bad payload")),
                _ => Script::steps([Step::panic("bug"), Step::retry_after(20 * SECOND, "429")]),
            };
            sim.publish(format!("o{i}"), script).unwrap();
        }
        sim.run_until_quiet();
        let report = sim.shutdown();
        let run = finished_run(&report);
        (run, report)
    });
    let (counts, samples, gauges) = counters(&recorder);
    let count = |name: &str| {
        counts
            .get(name)
            .copied()
            .unwrap_or_else(|| panic!("no {name} in {counts:#?}"))
    };
    let parked = |reason: DeadLetterReason| {
        count(&format!(
            "retry_terminals_total{{lane=work,terminal=parked,reason={reason}}}"
        ))
    };

    assert_eq!(
        count("retry_deliveries_total{lane=work}")
            + count("retry_deliveries_total{lane=isolation}"),
        report.received
    );
    assert_eq!(
        count("retry_terminals_total{lane=work,terminal=handled}"),
        report.handled
    );
    assert_eq!(
        count("retry_terminals_total{lane=work,terminal=retried}"),
        report.retried
    );
    assert_eq!(
        parked(DeadLetterReason::AttemptsExhausted) + parked(DeadLetterReason::Permanent),
        report.dead_lettered
    );
    assert_eq!(parked(DeadLetterReason::Permanent), 5);
    // Always failing, and panicking then asking to retry after 20 s, 5 each.
    assert_eq!(parked(DeadLetterReason::AttemptsExhausted), 10);
    assert_eq!(report.handled, 25);
    let all_terminals: u64 = counts
        .iter()
        .filter(|(k, _)| k.starts_with("retry_terminals_total"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(all_terminals, report.accounted());

    let runs = sim_report.totals().runs as usize;
    let handler_samples: usize = samples
        .iter()
        .filter(|(k, _)| k.starts_with("retry_handler_seconds"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(handler_samples, runs);
    assert_eq!(samples["retry_handler_seconds{lane=work,outcome=panic}"], 5);
    assert_eq!(
        samples["retry_handler_seconds{lane=work,outcome=retry-after}"],
        10
    );
    assert_eq!(
        samples["retry_handled_attempt{lane=work}"],
        report.handled as usize
    );
    assert_eq!(
        samples["retry_publish_confirm_seconds{lane=work}"] as u64,
        report.retried + report.dead_lettered
    );
    assert_eq!(gauges["retry_in_flight{}"], 0.0);
    assert_eq!(gauges["retry_storm_paused{}"], 0.0);
}

/// A span's fields, as text.
type SpanFields = BTreeMap<String, String>;

/// The fields of every `delivery` span (`None` for other spans), by span id.
#[derive(Clone, Default)]
struct DeliverySpans(Arc<Mutex<Vec<Option<SpanFields>>>>);

/// Records fields into a map, as text.
struct Fields<'a>(&'a mut SpanFields);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl tracing::Subscriber for DeliverySpans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut spans = self.0.lock().unwrap();
        let fields = (span.metadata().name() == "delivery").then(|| {
            let mut fields = BTreeMap::new();
            span.record(&mut Fields(&mut fields));
            fields
        });
        spans.push(fields);
        tracing::span::Id::from_u64(spans.len() as u64)
    }

    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut spans = self.0.lock().unwrap();
        if let Some(Some(fields)) = spans.get_mut(span.into_u64() as usize - 1) {
            values.record(&mut Fields(fields));
        }
    }

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn the_attempts_of_one_message_share_its_message_id_in_their_spans() {
    let policy = RetryPolicy::delays([10 * SECOND]).build().unwrap();
    let spans = DeliverySpans::default();
    tracing::subscriber::with_default(spans.clone(), || {
        let mut sim = Simulation::builder("orders", policy).build().unwrap();
        sim.publish("flaky", Script::fail_times(1)).unwrap();
        sim.publish("fine", Script::succeed()).unwrap();
        sim.run_until_quiet();
    });
    let spans = spans.0.lock().unwrap();
    let of = |id: &str| -> Vec<Vec<(String, String)>> {
        spans
            .iter()
            .flatten()
            .filter(|f| f.get("message_id").map(String::as_str) == Some(id))
            .map(|f| {
                ["lane", "attempt", "crashes", "outcome", "terminal"]
                    .iter()
                    .map(|k| (k.to_string(), f.get(*k).cloned().unwrap_or_default()))
                    .collect()
            })
            .collect()
    };
    let fields = |attempt: &str, outcome: &str, terminal: &str| {
        [
            ("lane", "work"),
            ("attempt", attempt),
            ("crashes", "0"),
            ("outcome", outcome),
            ("terminal", terminal),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .to_vec()
    };
    assert_eq!(
        of("flaky"),
        [
            fields("1", "transient", "Retried { attempts: 1, delay: 10s }"),
            fields("2", "success", "Handled { attempt: 2 }"),
        ]
    );
    assert_eq!(
        of("fine"),
        [fields("1", "success", "Handled { attempt: 1 }")]
    );
}

/// A message that `broker` has delivered once and got back unsettled: the next consumer
/// receives it redelivered, as a suspect.
fn redelivered(broker: &Broker, plan: &TopologyPlan, body: &str) {
    broker.block_on(async {
        let first = broker.connect();
        first.provision(plan).await.unwrap();
        broker
            .publish(Outgoing::to_queue(plan.work_queue(), body.into()))
            .unwrap();
        let sub = first.consume(plan.work_queue(), 1).await.unwrap();
        assert!(sub.recv().await.unwrap().is_some());
    });
}

/// A consumer on the in-memory broker runs suspects alone through its broker's gate, not
/// the process's: while a consumer of another test holds the process's gate (here, a
/// handler that blocks its thread in the middle of a solo run), a simulation's suspect
/// still runs, where before it waited on a gate no virtual clock can release and the
/// executor stopped ("nothing is due on the virtual clock").
#[test]
fn an_in_memory_consumer_does_not_wait_on_the_process_gate() {
    let policy = RetryPolicy::delays([MINUTE]).build().unwrap();
    let (holding, held) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let elsewhere = std::thread::spawn({
        let policy = policy.clone();
        move || {
            let broker = Broker::new();
            let plan = TopologyPlan::new("elsewhere", &policy).unwrap();
            redelivered(&broker, &plan, "suspect");
            let released = Mutex::new(released);
            let handler = move |_: Message| {
                holding.send(()).unwrap();
                released.lock().unwrap().recv().unwrap();
                async { Ok::<(), HandlerError>(()) }
            };
            let consumer = Consumer::builder(broker.connect(), "elsewhere", policy, handler)
                .with_solo_gate(SoloGate::process())
                .build()
                .unwrap();
            broker.block_on(consumer.run(broker.sleep(MINUTE))).unwrap()
        }
    });
    held.recv()
        .expect("the other consumer runs its suspect alone");

    let broker = Broker::new();
    let plan = TopologyPlan::new("here", &policy).unwrap();
    redelivered(&broker, &plan, "suspect");
    let consumer = Consumer::builder(broker.connect(), "here", policy, |_: Message| async {
        Ok::<(), HandlerError>(())
    })
    .build()
    .unwrap();
    assert!(!consumer.solo_gate().same_as(&SoloGate::process()));
    let report = broker.block_on(consumer.run(broker.sleep(MINUTE))).unwrap();
    assert_eq!((report.suspects, report.handled), (1, 1), "{report:?}");

    release.send(()).unwrap();
    let other = elsewhere.join().unwrap();
    assert_eq!((other.suspects, other.handled), (1, 1), "{other:?}");
}

/// Consumers on one in-memory broker share its gate, as consumers of one process do.
#[test]
fn consumers_on_one_in_memory_broker_share_its_gate() {
    let policy = RetryPolicy::delays([MINUTE]).build().unwrap();
    let broker = Broker::new();
    let build = |queue: &str| {
        let handle = |_: Message| async { Ok::<(), HandlerError>(()) };
        Consumer::builder(broker.connect(), queue, policy.clone(), handle)
            .build()
            .unwrap()
    };
    let (orders, invoices) = (build("orders"), build("invoices"));
    assert!(orders.solo_gate().same_as(invoices.solo_gate()));
    let other = Broker::new();
    let handle = |_: Message| async { Ok::<(), HandlerError>(()) };
    let elsewhere = Consumer::builder(other.connect(), "orders", policy.clone(), handle)
        .build()
        .unwrap();
    assert!(!elsewhere.solo_gate().same_as(orders.solo_gate()));
}
