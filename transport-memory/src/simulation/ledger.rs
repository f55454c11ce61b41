//! What the simulation knows about each message it follows: its script, its handler runs
//! and how each delivery of it ended.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use retry_core::{DeadLetterReason, HeaderValue, Message, ParkedRecord, Terminal, Timestamp};

use crate::broker::Broker;
use crate::broker::fault::Rng;
use crate::broker::hash::FastMap;
use crate::broker::message::{MessageKey, QueuedMessage};
use crate::broker::trace::{EventKind, MessageRef};
use crate::simulation::lock;
use crate::simulation::report::{Fate, Happened, MessageReport, Run};
use crate::simulation::script::{Script, Step};

/// What the simulation knows about each message.
pub(crate) struct Ledger {
    inner: Mutex<LedgerState>,
}

struct LedgerState {
    /// Entries by message id, looked up on every handler run; the entries stay put.
    index: FastMap<String, usize>,
    entries: Vec<Entry>,
    default_script: Script,
    crash_requests: Vec<u32>,
    rng: Rng,
    crash_rate: f64,
    connection_drop_rate: f64,
}

impl LedgerState {
    /// Follows message `id` from `now`; returns its entry's index.
    fn add(&mut self, id: &str, now: Timestamp, script: Script) -> usize {
        let i = self.entries.len();
        self.entries.push(Entry::new(now, script));
        self.index.insert(id.to_owned(), i);
        i
    }
}

struct Entry {
    key: MessageKey,
    published_at: Timestamp,
    script: Script,
    runs: Vec<Run>,
    terminals: Vec<(Timestamp, Terminal)>,
    order: Vec<Happened>,
}

impl Entry {
    fn new(published_at: Timestamp, script: Script) -> Self {
        // Room for the runs the script plans, each with its end, so that following a message
        // does not grow its lists run by run.
        let runs = script.listed();
        Entry {
            key: MessageKey(0),
            published_at,
            script,
            runs: Vec::with_capacity(runs),
            terminals: Vec::with_capacity(runs),
            order: Vec::with_capacity(2 * runs),
        }
    }

    fn report(
        &self,
        id: &str,
        parked: &[&QueuedMessage],
        located: Option<&(Vec<Arc<str>>, bool)>,
        lost_fetches: u32,
        parking: &str,
    ) -> MessageReport {
        let mut handled = None;
        let mut ended = parked.len() as u32;
        let mut dropped = None;
        let mut delays = Vec::new();
        let mut crashes = 0;
        let mut isolations = 0;
        for (at, t) in &self.terminals {
            match *t {
                Terminal::Handled { attempt } => {
                    ended += 1;
                    handled.get_or_insert(Fate::Handled { at: *at, attempt });
                }
                Terminal::Dropped { reason } => {
                    ended += 1;
                    dropped.get_or_insert(reason);
                }
                Terminal::Retried { delay, .. } => delays.push(delay),
                Terminal::Diverted { crashes: c, delay } => {
                    delays.push(delay);
                    crashes = crashes.max(c);
                }
                Terminal::Isolated => isolations += 1,
                Terminal::DeadLettered { .. } | Terminal::Requeued { .. } => {}
            }
        }
        for m in parked {
            crashes = crashes.max(ParkedRecord::decode(&m.headers).crashes);
        }
        let fate = if let Some(h) = handled {
            h
        } else if let Some(m) = parked.first() {
            Fate::Parked {
                reason: parked_reason(m),
            }
        } else if let Some(reason) = dropped {
            Fate::Dropped { reason }
        } else {
            match located {
                Some((queues, _)) if !queues.is_empty() => Fate::Pending {
                    queue: queues
                        .iter()
                        .find(|q| &***q != parking)
                        .map(|q| q.to_string()),
                },
                Some((_, true)) => Fate::Pending { queue: None },
                _ => Fate::Lost,
            }
        };
        MessageReport {
            id: id.to_owned(),
            published_at: self.published_at,
            fate,
            runs: self.runs.clone(),
            terminals: self.terminals.clone(),
            delays,
            crashes,
            isolations,
            lost_fetches,
            duplicates: ended.saturating_sub(1),
            order: self.order.clone(),
        }
    }
}

/// Why a parked copy was parked: the engine's reason, or the broker's when the broker
/// dead-lettered it.
fn parked_reason(m: &QueuedMessage) -> String {
    if let Some(r) = ParkedRecord::decode(&m.headers).reason {
        return r.as_str().to_owned();
    }
    match m.headers.get("x-first-death-reason") {
        Some(HeaderValue::Str(r)) => r.clone(),
        _ => DeadLetterReason::AttemptsExhausted.as_str().to_owned(),
    }
}

impl Ledger {
    pub(crate) fn new(
        default_script: Script,
        rng: Rng,
        crash_rate: f64,
        connection_drop_rate: f64,
    ) -> Self {
        Ledger {
            inner: Mutex::new(LedgerState {
                index: FastMap::default(),
                entries: Vec::new(),
                default_script,
                crash_requests: Vec::new(),
                rng,
                crash_rate,
                connection_drop_rate,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        lock(&self.inner)
    }

    /// How many messages it follows.
    pub(crate) fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether it follows message `id`.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.lock().index.contains_key(id)
    }

    /// Follows message `id`, published at `now` with key `key`.
    pub(crate) fn add(&self, id: &str, now: Timestamp, script: Script, key: MessageKey) {
        let mut ledger = self.lock();
        let i = ledger.add(id, now, script);
        ledger.entries[i].key = key;
    }

    /// The consumers a handler asked to crash since the last call.
    pub(crate) fn take_crash_requests(&self) -> Vec<u32> {
        std::mem::take(&mut self.lock().crash_requests)
    }

    /// Asks for consumer `number` to crash.
    pub(crate) fn request_crash(&self, number: u32) {
        self.lock().crash_requests.push(number);
    }

    /// The story of every message it follows, by id: `parked` holds the copies in the
    /// parking queue `parking`, `copies` where the broker holds copies of each,
    /// `lost_fetches` how many fetches of each were lost in flight.
    pub(crate) fn reports(
        &self,
        parked: &[QueuedMessage],
        copies: &HashMap<Arc<str>, (Vec<Arc<str>>, bool)>,
        lost_fetches: &FastMap<Arc<str>, u32>,
        parking: &str,
    ) -> BTreeMap<String, MessageReport> {
        let mut parked_by_id: HashMap<&str, Vec<&QueuedMessage>> = HashMap::new();
        for m in parked {
            parked_by_id.entry(&m.label).or_default().push(m);
        }
        let ledger = self.lock();
        // In id order already: the map's own sort then finds one sorted run, rather than
        // moving whole reports about.
        let mut ids: Vec<(&String, &usize)> = ledger.index.iter().collect();
        ids.sort_unstable_by(|a, b| a.0.cmp(b.0));
        ids.into_iter()
            .map(|(id, &i)| {
                let entry = &ledger.entries[i];
                let parked = parked_by_id.get(id.as_str()).map_or(&[][..], Vec::as_slice);
                let located = copies.get(id.as_str());
                let lost = lost_fetches.get(id.as_str()).copied().unwrap_or(0);
                (id.clone(), entry.report(id, parked, located, lost, parking))
            })
            .collect()
    }

    /// Starts a handler run: records it and says what it does.
    pub(crate) fn begin(
        &self,
        id: &str,
        attempt: u32,
        consumer: u32,
        solo: bool,
        now: Timestamp,
    ) -> Begun {
        let mut guard = self.lock();
        let l = &mut *guard;
        let crash = l.rng.chance(l.crash_rate);
        let drop_connection = l.rng.chance(l.connection_drop_rate);
        let i = match l.index.get(id) {
            Some(&i) => i,
            None => {
                // A message the simulation did not publish: followed from its first run.
                let script = l.default_script.clone();
                l.add(id, now, script)
            }
        };
        let entry = &mut l.entries[i];
        let step = if crash {
            Step::Crash
        } else {
            entry.script.step(entry.runs.len()).clone()
        };
        let run = entry.runs.len();
        entry.order.push(Happened::Run(run));
        entry.runs.push(Run {
            at: now,
            attempt,
            consumer,
            solo,
            step: step.clone(),
            ended: false,
        });
        Begun {
            key: entry.key,
            run,
            step,
            takes: entry.script.takes(),
            drop_connection,
        }
    }

    /// Run `run` of `id` came to its end, doing `step` (your own handler's outcome, or
    /// the script's step).
    pub(crate) fn end(&self, id: &str, run: usize, step: Step) {
        let mut l = self.lock();
        let i = l.index.get(id).copied();
        if let Some(r) = i.and_then(|i| l.entries[i].runs.get_mut(run)) {
            r.step = step;
            r.ended = true;
        }
    }

    pub(crate) fn terminal(&self, broker: &Broker, msg: &Message, terminal: &Terminal) {
        let id = message_id(msg);
        let now = broker.now();
        let mut l = self.lock();
        let i = l.index.get(id).copied();
        let key = match i.map(|i| &mut l.entries[i]) {
            Some(entry) => {
                entry.order.push(Happened::Ended(entry.terminals.len()));
                entry.terminals.push((now, *terminal));
                entry.key
            }
            None => MessageKey(0),
        };
        let terminal = *terminal;
        broker.shared.with(|s| {
            if s.tracing() {
                let message = message_ref(key, id);
                s.record(|| EventKind::Terminal { message, terminal });
            }
        });
    }
}

/// What a handler run is to do.
pub(crate) struct Begun {
    pub(crate) key: MessageKey,
    /// The run's index among the message's runs.
    pub(crate) run: usize,
    pub(crate) step: Step,
    pub(crate) takes: Duration,
    pub(crate) drop_connection: bool,
}

/// The header that names the message a copy is of, for messages published with
/// [`Simulation::publish_labelled`](crate::Simulation::publish_labelled), whose ids or
/// bodies may be shared.
pub(crate) const LABEL: &str = "x-simulation-label";

/// The id the simulation follows a message by: its label, or else its `message-id`.
pub(crate) fn message_id(msg: &Message) -> &str {
    if let Some(label) = msg.headers().get(LABEL).and_then(|v| v.as_str()) {
        return label;
    }
    msg.properties()
        .message_id
        .as_deref()
        .unwrap_or("(no message-id)")
}

/// How the trace names a message the simulation follows.
pub(crate) fn message_ref(key: MessageKey, id: &str) -> MessageRef {
    MessageRef {
        key,
        label: Arc::from(id),
    }
}
