//! The differential check: one scripted workload with faults, run on the memory model and on
//! a real broker, and what the broker *produced* for each delivery compared between the two.
//!
//! Each run records every delivery as its transport received it ([`Recorded`]), plus what
//! ended in the parking queue. A delivery is named by its message id and its index among
//! that message's deliveries (1, 2, ... in arrival order), so the two runs are matched
//! without relying on timing. For each delivery the comparison takes, after
//! [normalising](Normalized) what legitimately differs (the unique work-queue name inside
//! every queue, exchange and routing key; `x-death` times):
//!
//! * the queue it came from, and the exchange and routing key it carried;
//! * the redelivered flag;
//! * `x-delivery-count`;
//! * every `x-death` record, in order, with all its fields but `time` (`queue`, `reason`,
//!   `count`, `exchange`, `routing-keys`, `original-expiration`), and the `x-first-death-*`
//!   headers;
//!
//! and for each queue, the order in which its deliveries arrived. The decisions (each
//! message's terminals) are compared too.
//!
//! The workload ([`run`]) is timed so that its order is the same on a virtual clock and on a
//! loaded machine's wall clock: consumers run at prefetch 1, everything that lands in one
//! queue from different sources lands there at least 600 ms apart, and consumers are killed
//! only when they hold exactly the deliveries the script says. It runs once on classic and
//! once on quorum queues, with:
//!
//! * a crash: a consumer killed holding three deliveries, which come back redelivered (with
//!   `x-delivery-count` on quorum queues), are isolated as suspects and run alone; one of
//!   them kills its solo consumer too, comes back redelivered from the isolation queue, is
//!   counted a crash and goes through the crash-delay queue (an `x-death` of its own);
//! * a refused publish (classic queues only, see [`refuses`]): a delay queue at
//!   `x-max-length` 0 with `reject-publish` refuses a retry's clone, the original is
//!   requeued and comes back redelivered;
//! * per-message TTLs: a retry-after shorter than its delay level rides that level with an
//!   `expiration` (`original-expiration` in `x-death`), once alone at the head, once behind a
//!   full-length delay that holds it back (only a queue's head expires);
//! * plain retries through two delay levels, a success, and a permanent failure parked.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{HeaderValue, Headers, RetryPolicy, Terminal};

use crate::recording::{DeliveryLog, Observed, Recorded};
use conformance::drive::{Ended, drive, wait_until};
use conformance::harness::{Harness, TestMessage, TopologyFaults};
use conformance::journal::{Journal, Step};
use conformance::support::{Setup, assert_nothing_left, delay_queue, ms, setup_with_faults};

/// The first delay level, and the crash delay.
pub const FIRST: Duration = Duration::from_millis(600);
/// The second delay level.
pub const SECOND: Duration = Duration::from_secs(3);
/// The third delay level: its queue refuses every publish.
pub const REFUSED: Duration = Duration::from_secs(4);
/// A retry-after that rides the second level with a per-message TTL.
pub const SHORT: Duration = Duration::from_millis(1_500);

/// How long any one phase may take before the run fails: generous, it bounds a broken run.
const WITHIN: Duration = Duration::from_secs(30);

/// The messages of the crash phase, in publish order: the first consumer takes all three.
pub const CRASH_PHASE: [&str; 3] = ["b1", "b2", "poison"];

/// The messages of the main phase, in publish order. `ra-alone` goes into the second level
/// before `ra-full` and `ra-behind`, so it is alone at that queue's head; `refused` is last,
/// so its publish retries and solo run hold nothing else up.
pub const MAIN_PHASE: [&str; 11] = [
    "ok-1",
    "fail1-1",
    "fail2-1",
    "ra-alone",
    "ra-full",
    "ra-behind",
    "ok-2",
    "fail1-2",
    "fail2-2",
    "perm",
    "refused",
];

/// Whether the case refuses publishes into the [`REFUSED`] level. Only on classic queues:
/// a RabbitMQ 3.10 quorum queue declared with `x-max-length` 0 and `reject-publish`
/// confirms the publish that takes it past the limit and refuses only the ones after it
/// (four publishes in a row: ack, nack, nack, nack; a classic queue nacks all four). The
/// model follows that, but a level that takes the first clone is no refusal to compare.
pub fn refuses(quorum: bool) -> bool {
    !quorum
}

/// The messages of the main phase for a case on quorum queues or not: [`MAIN_PHASE`],
/// without `refused` where the case does not refuse.
pub fn main_phase(quorum: bool) -> Vec<&'static str> {
    MAIN_PHASE
        .into_iter()
        .filter(|id| refuses(quorum) || *id != "refused")
        .collect()
}

/// The workload's policy: delays of 600 ms, 3 s and 4 s (the crash delay is the first),
/// and two quick publish retries before a refused clone's original is requeued.
pub fn policy() -> RetryPolicy {
    RetryPolicy::delays([FIRST, SECOND, REFUSED])
        .with_publish_retries(2, ms(20))
        .build()
        .expect("the differential policy is valid")
}

/// What the handler does on run `run` of message `id`.
pub fn script(id: &str, run: u32) -> Step {
    match (id, run) {
        // Held by the first consumer when it dies.
        ("b1" | "b2" | "poison", 1) => Step::Hang,
        // Kills the consumer it runs alone on, too.
        ("poison", 2) => Step::Hang,
        ("fail1-1" | "fail1-2", 1) => Step::Fail,
        ("fail2-1" | "fail2-2", 1 | 2) => Step::Fail,
        ("ra-alone" | "ra-behind", 1) => Step::RetryAfter(SHORT),
        ("ra-full", 1) => Step::RetryAfter(SECOND),
        ("refused", 1) => Step::RetryAfter(REFUSED),
        ("perm", 1) => Step::Permanent,
        _ => Step::Succeed,
    }
}

/// What one run of the workload produced.
#[derive(Clone, Debug)]
pub struct DifferentialRun {
    /// The work queue's name, which every other name of the plan is derived from.
    pub work_queue: String,
    /// Every delivery in arrival order, then the parking queue's messages in its order.
    pub deliveries: Vec<Observed>,
    /// Every message's terminals, in attempt order.
    pub terminals: BTreeMap<String, Vec<Terminal>>,
}

/// Runs the workload on `h`, on quorum queues if `quorum`; `name` tells the cases apart.
pub async fn run<H: Harness>(h: &H, name: &str, quorum: bool) -> DifferentialRun {
    let s = setup_with_faults(h, name, policy(), quorum, |plan| TopologyFaults {
        refuse_publishes_to: if refuses(quorum) {
            vec![delay_queue(plan, REFUSED)]
        } else {
            Vec::new()
        },
    })
    .await;
    let journal = Journal::new(h.stopwatch());
    let log = DeliveryLog::new();
    let phase = Phase {
        h,
        s: &s,
        journal: &journal,
        log: &log,
    };

    // The crash phase, alone in the queues.
    for id in CRASH_PHASE {
        h.publish(&s.queue, &TestMessage::new(id)).await;
    }
    phase
        .consume(3, End::Kill, "the first consumer to hold all three", || {
            journal.runs().len() == CRASH_PHASE.len()
        })
        .await;
    phase
        .consume(1, End::Kill, "poison to run alone", || {
            journal.runs_of("poison").len() == 2
        })
        .await;
    for id in ["b1", "b2"] {
        assert!(
            journal.is_finished(id),
            "{id} ran alone before poison did, and was settled: {:?}",
            journal.terminals_of(id)
        );
    }
    phase
        .consume(1, End::Stop, "poison handled after its crash delay", || {
            journal.is_finished("poison")
        })
        .await;

    // The main phase.
    let main = main_phase(quorum);
    for id in &main {
        h.publish(&s.queue, &TestMessage::new(*id)).await;
    }
    let all = CRASH_PHASE.len() + main.len();
    phase
        .consume(1, End::Stop, "every message finished", || {
            journal.finished() == all
        })
        .await;

    for p in h.take_parked(&s.plan).await {
        log.push(Observed {
            queue: s.plan.parking_queue().to_owned(),
            id: p.id.clone().unwrap_or_default(),
            exchange: None,
            routing_key: None,
            redelivered: None,
            headers: p.headers,
        });
    }
    assert_nothing_left(h, &s.plan).await;
    DifferentialRun {
        work_queue: s.queue.clone(),
        deliveries: log.snapshot(),
        terminals: journal.terminals_by_message(),
    }
}

/// What every phase of one run shares: the harness, the topology, the journal of handler
/// runs and terminals, and the delivery log.
struct Phase<'a, H> {
    h: &'a H,
    s: &'a Setup,
    journal: &'a Journal,
    log: &'a DeliveryLog,
}

/// How a phase's consumer ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Killed where it stands, its connection crashed: what it holds goes back redelivered.
    Kill,
    /// Stopped, its connection closed.
    Stop,
}

impl<H: Harness> Phase<'_, H> {
    /// Runs a consumer with `prefetch` on a recorded connection until `until` holds, then
    /// ends it as `end` says.
    async fn consume(&self, prefetch: u16, end: End, what: &str, until: impl Fn() -> bool) {
        let h = self.h;
        let t = h.transport().await;
        h.prepare(&t, &self.s.plan).await;
        let handler = self.journal.handler(|r| script(&r.id, r.run));
        // The harness declared the refusing queue with other arguments: never redeclare.
        let consumer = self
            .s
            .consumer(
                Recorded::new(Arc::clone(&t), self.log.clone()),
                self.journal,
                handler,
                prefetch,
            )
            .with_provision(false)
            .build()
            .expect("consumer");
        let (ended, ()) = drive(consumer, |control| async move {
            wait_until(h, WITHIN, || what.to_owned(), &until).await;
            match end {
                End::Kill => control.kill(),
                End::Stop => control.stop(),
            }
        })
        .await;
        match (end, ended) {
            (End::Kill, Ended::Killed) => h.crash(t).await,
            (End::Stop, Ended::Stopped(_)) => h.close(t).await,
            (_, ended) => panic!("{what}: the consumer was to {end:?}, it ended {ended:?}"),
        }
    }
}

/// A delivery with what legitimately differs between two runs taken out: the work queue's
/// name becomes `{W}` in every string, and `x-death` times are dropped. Values are written
/// out canonically (strings quoted, integers bare, whatever their AMQP width).
#[derive(Clone, PartialEq, Eq)]
pub struct Normalized {
    /// The queue it came from.
    pub queue: String,
    /// `exchange / routing key`, where observed.
    pub route: Option<String>,
    /// The redelivered flag, where observed.
    pub redelivered: Option<bool>,
    /// `x-delivery-count`.
    pub delivery_count: Option<String>,
    /// `x-death`, in order, each record's fields but `time`.
    pub x_death: Vec<BTreeMap<String, String>>,
    /// `x-first-death-queue`, `-reason` and `-exchange`.
    pub first_death: [Option<String>; 3],
}

impl fmt::Debug for Normalized {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "from {}", self.queue)?;
        if let Some(route) = &self.route {
            write!(f, " via {route}")?;
        }
        match self.redelivered {
            Some(true) => f.write_str(", redelivered")?,
            Some(false) => f.write_str(", first delivery")?,
            None => {}
        }
        if let Some(n) = &self.delivery_count {
            write!(f, ", x-delivery-count {n}")?;
        }
        for d in &self.x_death {
            let fields: Vec<String> = d.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            write!(f, ", x-death {{{}}}", fields.join(", "))?;
        }
        if self.first_death.iter().any(Option::is_some) {
            write!(f, ", x-first-death {:?}", self.first_death)?;
        }
        Ok(())
    }
}

impl Normalized {
    /// Normalises `o`, observed on a run whose work queue is `work_queue`.
    pub fn of(o: &Observed, work_queue: &str) -> Self {
        let name = |s: &str| s.replace(work_queue, "{W}");
        let value = |v: &HeaderValue| canonical(v, work_queue);
        let x_death = match o.headers.get("x-death") {
            None => Vec::new(),
            Some(HeaderValue::Array(entries)) => entries
                .iter()
                .map(|e| match e {
                    HeaderValue::Table(t) => t
                        .iter()
                        .filter(|(k, _)| *k != "time")
                        .map(|(k, v)| (k.to_owned(), value(v)))
                        .collect(),
                    other => BTreeMap::from([("?".to_owned(), value(other))]),
                })
                .collect(),
            Some(other) => vec![BTreeMap::from([("?".to_owned(), value(other))])],
        };
        let header = |h: &Headers, k: &str| h.get(k).map(value);
        Normalized {
            queue: name(&o.queue),
            route: match (&o.exchange, &o.routing_key) {
                (Some(x), Some(k)) => Some(format!("{:?} / {:?}", name(x), name(k))),
                _ => None,
            },
            redelivered: o.redelivered,
            // RabbitMQ 3.10's quorum queues put `x-delivery-count: 0` on a first delivery
            // taken with `basic.get` (and none on a consumer's): the model must too.
            delivery_count: header(&o.headers, "x-delivery-count"),
            x_death,
            first_death: [
                header(&o.headers, "x-first-death-queue"),
                header(&o.headers, "x-first-death-reason"),
                header(&o.headers, "x-first-death-exchange"),
            ],
        }
    }
}

fn canonical(v: &HeaderValue, work_queue: &str) -> String {
    match v {
        HeaderValue::Str(s) => format!("{:?}", s.replace(work_queue, "{W}")),
        HeaderValue::Bytes(b) => match std::str::from_utf8(b) {
            Ok(s) => format!("{:?}", s.replace(work_queue, "{W}")),
            Err(_) => format!("{b:?}"),
        },
        HeaderValue::Int(n) => n.to_string(),
        HeaderValue::UInt(n) => n.to_string(),
        HeaderValue::Array(items) => {
            let items: Vec<String> = items.iter().map(|i| canonical(i, work_queue)).collect();
            format!("[{}]", items.join(", "))
        }
        HeaderValue::Table(t) => {
            let fields: BTreeMap<&str, String> = t
                .iter()
                .map(|(k, v)| (k, canonical(v, work_queue)))
                .collect();
            format!("{fields:?}")
        }
        HeaderValue::Timestamp(_) => "<time>".to_owned(),
        other => format!("{other:?}"),
    }
}

/// A delivery's name in both runs: its message id and its index among that message's
/// deliveries, from 1, in arrival order.
pub type DeliveryKey = (String, usize);

/// A run's deliveries by key, and each queue's arrival order.
#[derive(Clone, Debug, Default)]
pub struct Indexed {
    /// Every delivery, normalised.
    pub deliveries: BTreeMap<DeliveryKey, Normalized>,
    /// For each (normalised) queue, its deliveries in arrival order.
    pub order: BTreeMap<String, Vec<DeliveryKey>>,
}

impl Indexed {
    /// Indexes `run`.
    pub fn of(run: &DifferentialRun) -> Self {
        let mut out = Indexed::default();
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for o in &run.deliveries {
            let n = counts.entry(o.id.as_str()).or_default();
            *n += 1;
            let key = (o.id.clone(), *n);
            let normal = Normalized::of(o, &run.work_queue);
            out.order
                .entry(normal.queue.clone())
                .or_default()
                .push(key.clone());
            out.deliveries.insert(key, normal);
        }
        out
    }
}

/// What a comparison covered.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Compared {
    /// Deliveries compared (parked messages included).
    pub deliveries: usize,
    /// Of which redelivered.
    pub redelivered: usize,
    /// Of which carried `x-delivery-count`.
    pub delivery_counts: usize,
    /// Of which carried `x-death`.
    pub with_x_death: usize,
    /// Queues whose arrival order was compared.
    pub queues: usize,
}

/// Panics unless `real` produced, delivery for delivery, what `model` produced (see the
/// module docs for what is compared); returns what was compared. `real_name` names the real
/// broker in the messages.
pub fn assert_same_deliveries(
    model: &DifferentialRun,
    real: &DifferentialRun,
    real_name: &str,
) -> Compared {
    let m = Indexed::of(model);
    let r = Indexed::of(real);
    let keys = |i: &Indexed| i.deliveries.keys().cloned().collect::<BTreeSet<_>>();
    let (mk, rk) = (keys(&m), keys(&r));
    if mk != rk {
        let ids: BTreeSet<&str> = mk
            .symmetric_difference(&rk)
            .map(|(id, _)| id.as_str())
            .collect();
        let list = |i: &Indexed, id: &str| -> String {
            i.deliveries
                .range((id.to_owned(), 0)..=(id.to_owned(), usize::MAX))
                .map(|((_, n), d)| format!("\n    {n}: {d:?}"))
                .collect()
        };
        let detail: Vec<String> = ids
            .iter()
            .map(|id| {
                format!(
                    "{id}\n  memory model:{}\n  {real_name}:{}",
                    list(&m, id),
                    list(&r, id)
                )
            })
            .collect();
        panic!(
            "the memory model and {real_name} made different deliveries ({} and {}):\n{}\nterminals: memory model {:?}, {real_name} {:?}",
            mk.len(),
            rk.len(),
            detail.join("\n"),
            ids.iter()
                .map(|id| model.terminals.get(*id))
                .collect::<Vec<_>>(),
            ids.iter()
                .map(|id| real.terminals.get(*id))
                .collect::<Vec<_>>(),
        );
    }
    let differing: Vec<String> = m
        .deliveries
        .iter()
        .filter(|(k, d)| r.deliveries[*k] != **d)
        .map(|((id, n), d)| {
            format!(
                "{id} delivery {n}:\n  memory model: {d:?}\n  {real_name}: {:?}",
                r.deliveries[&(id.clone(), *n)]
            )
        })
        .collect();
    assert!(
        differing.is_empty(),
        "{} of {} deliveries differ between the memory model and {real_name}:\n{}",
        differing.len(),
        m.deliveries.len(),
        differing.join("\n")
    );
    assert_eq!(
        m.order.keys().collect::<Vec<_>>(),
        r.order.keys().collect::<Vec<_>>(),
        "queues delivered from: memory model (left), {real_name} (right)"
    );
    for (queue, order) in &m.order {
        assert_eq!(
            order, &r.order[queue],
            "arrival order in {queue}: memory model (left), {real_name} (right)"
        );
    }
    assert_eq!(
        model.terminals, real.terminals,
        "terminals: memory model (left), {real_name} (right)"
    );
    let all = m.deliveries.values();
    Compared {
        deliveries: m.deliveries.len(),
        redelivered: all.clone().filter(|d| d.redelivered == Some(true)).count(),
        delivery_counts: all.clone().filter(|d| d.delivery_count.is_some()).count(),
        with_x_death: all.filter(|d| !d.x_death.is_empty()).count(),
        queues: m.order.len(),
    }
}

/// Panics unless `run` went through every path the workload is there to exercise, so that
/// two runs cannot agree by both doing nothing: redeliveries after the crash and after the
/// requeue, `x-delivery-count` on quorum queues, and `x-death` records from every delay
/// level used, the crash-delay queue and a per-message TTL.
pub fn assert_covers_workload(run: &DifferentialRun, quorum: bool) {
    let i = Indexed::of(run);
    let get = |id: &str, n: usize| {
        i.deliveries
            .get(&(id.to_owned(), n))
            .unwrap_or_else(|| panic!("{id} has no delivery {n}: {:?}", i.deliveries.keys()))
    };
    let death = |d: &Normalized| -> Vec<(String, String)> {
        d.x_death
            .iter()
            .map(|e| {
                (
                    e.get("queue").cloned().unwrap_or_default(),
                    e.get("reason").cloned().unwrap_or_default(),
                )
            })
            .collect()
    };
    let expired = |queue: &str| vec![(format!("{queue:?}"), "\"expired\"".to_owned())];
    let retry = |d: Duration| format!("{{W}}.retry.{}", retry_core::format_delay(d));
    // The crash: back redelivered to the work queue, then from the isolation queue.
    for id in CRASH_PHASE {
        assert_eq!(get(id, 2).redelivered, Some(true), "{id}: {:?}", get(id, 2));
        assert_eq!(get(id, 2).queue, "{W}");
        assert_eq!(get(id, 3).queue, "{W}.suspect");
    }
    assert_eq!(get("poison", 4).redelivered, Some(true));
    assert_eq!(
        death(get("poison", 5)),
        expired(&format!("{{W}}.crash.{}", retry_core::format_delay(FIRST)))
    );
    // The requeued original of the refused clone.
    if refuses(quorum) {
        assert_eq!(get("refused", 2).redelivered, Some(true));
        assert_eq!(get("refused", 3).queue, "{W}.suspect");
        assert!(matches!(
            run.terminals["refused"].first(),
            Some(Terminal::Requeued { .. })
        ));
    }
    if quorum {
        for (id, n) in [("b1", 2), ("b2", 2), ("poison", 2), ("poison", 4)] {
            assert_eq!(get(id, n).delivery_count.as_deref(), Some("1"), "{id} {n}");
        }
    }
    // Delay levels, and per-message TTLs alone and held back.
    assert_eq!(death(get("fail1-1", 2)), expired(&retry(FIRST)));
    assert_eq!(death(get("fail2-1", 3)), expired(&retry(SECOND)));
    for id in ["ra-alone", "ra-behind"] {
        let d = get(id, 2);
        assert_eq!(death(d), expired(&retry(SECOND)), "{id}");
        assert_eq!(
            d.x_death[0].get("original-expiration").map(String::as_str),
            Some(format!("{:?}", SHORT.as_millis().to_string()).as_str()),
            "{id}: {d:?}"
        );
    }
    let back = &i.order["{W}"];
    let at = |id: &str| back.iter().position(|k| *k == (id.to_owned(), 2));
    assert!(
        at("ra-alone") < at("ra-full") && at("ra-full") < at("ra-behind"),
        "ra-alone came back first, ra-behind only after ra-full ahead of it: {back:?}"
    );
}
