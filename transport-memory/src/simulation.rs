//! `Simulation`: the real consumer driver on the in-memory broker, with scripted handlers,
//! crashes and faults, run on virtual time by a deterministic single-threaded executor.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{
    Consumer, ConsumerConfigError, DeadLetterReason, Handler, HandlerError, HeaderValue, Message,
    ParkedRecord, QueueType, RetryPolicy, RunReport, Terminal, Timestamp, TopologyError,
    TopologyPlan,
};

use crate::broker::Publishing;
use crate::broker::{Broker, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_START};
use crate::error::BrokerError;
use crate::executor::{Executor, TaskId};
use crate::fault::{FaultRates, Rng};
use crate::hash::FastMap;
use crate::message::{MessageKey, Outgoing};
use crate::report::{
    ConsumerReport, ConsumerState, Fate, Happened, MessageReport, Report, Run, Stop,
};
use crate::script::{Script, Step};
use crate::trace::Publisher;
use crate::trace::{EventKind, MessageRef};
use crate::transport::LinkHandle;

/// How far a run goes in virtual time unless told otherwise: a year.
pub const DEFAULT_HORIZON: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why a simulation could not be built or fed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimulationError {
    /// The topology plan could not be made.
    #[error(transparent)]
    Topology(#[from] TopologyError),
    /// The consumer settings were refused.
    #[error(transparent)]
    Consumer(#[from] ConsumerConfigError),
    /// The broker refused an operation.
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A message with this id was already published: the simulation follows messages by id.
    #[error("a message with id {0:?} was already published; ids must be unique")]
    DuplicateId(String),
    /// The broker did not take a publish.
    #[error("publishing {id:?} was not confirmed: {confirm:?}")]
    NotConfirmed {
        /// The message.
        id: String,
        /// The broker's answer.
        confirm: retry_core::Confirm,
    },
}

/// Something to do at a virtual time, set with [`Simulation::schedule`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimEvent {
    /// Publish a message to the work queue.
    Publish {
        /// Its id.
        id: String,
        /// What the handler does with it.
        script: Script,
    },
    /// Kill every consumer process (each restarts after the restart delay).
    CrashConsumers,
    /// Close every consumer's connection; the transports recover.
    CloseConnections,
    /// Lose the next `n` publishes through connections.
    LosePublishes(u32),
    /// Refuse the next `n` publishes through connections.
    RefusePublishes(u32),
    /// Lose the confirms of the next `n` publishes through connections.
    LoseConfirms(u32),
    /// Deliver the next `n` deliveries twice.
    DuplicateDeliveries(u32),
}

/// The consumer settings every simulated consumer process is built with.
#[derive(Clone)]
struct Settings {
    queue: String,
    policy: RetryPolicy,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    prefetch: u16,
    handler_timeout: Duration,
    shutdown_grace: Duration,
    consumer_timeout: Option<Duration>,
    consumers: u32,
    restart_delay: Duration,
    horizon: Duration,
    handler: Option<Arc<dyn Handler>>,
}

/// Builds a [`Simulation`]. Every setting has a default; see each method.
#[must_use = "a builder does nothing until `build()` is called"]
pub struct SimulationBuilder {
    settings: Settings,
    seed: u64,
    crash_rate: f64,
    connection_drop_rate: f64,
    faults: Option<FaultRates>,
    trace: bool,
    start: Timestamp,
    default_script: Script,
}

impl fmt::Debug for SimulationBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimulationBuilder")
            .field("queue", &self.settings.queue)
            .field("prefetch", &self.settings.prefetch)
            .field("consumers", &self.settings.consumers)
            .field("seed", &self.seed)
            .finish_non_exhaustive()
    }
}

impl SimulationBuilder {
    /// Quorum or classic queues (default classic).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.settings.queue_type = queue_type;
        self
    }

    /// Quorum queues: the broker's `x-delivery-limit` on the work queue (default none).
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.settings.delivery_limit = Some(limit);
        self
    }

    /// Each consumer's prefetch, and so its concurrent handlers (default 10).
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch;
        self
    }

    /// The driver's handler timeout (default 30 s).
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// The driver's shutdown grace (default 30 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.settings.shutdown_grace = grace;
        self
    }

    /// The broker's consumer timeout (default 30 min, as RabbitMQ; `None` turns it off).
    pub fn consumer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.settings.consumer_timeout = timeout;
        self
    }

    /// How many consumer processes run at once (default 1).
    pub fn consumers(mut self, n: u32) -> Self {
        self.settings.consumers = n.max(1);
        self
    }

    /// How long after a crash its replacement process starts (default 1 s).
    pub fn restart_delay(mut self, delay: Duration) -> Self {
        self.settings.restart_delay = delay;
        self
    }

    /// The virtual-time limit of [`Simulation::run_until_quiet`] (default
    /// [`DEFAULT_HORIZON`]).
    pub fn horizon(mut self, horizon: Duration) -> Self {
        self.settings.horizon = horizon;
        self
    }

    /// The seed of every random choice: random crashes, connection drops and broker faults
    /// (default 0). The same seed and script give the same trace.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The probability that a handler run crashes its consumer, on top of its script.
    pub fn crash_rate(mut self, p: f64) -> Self {
        self.crash_rate = p;
        self
    }

    /// The probability that a handler run starts with its consumer's connection dropped
    /// (the run goes on; the transport recovers).
    pub fn connection_drop_rate(mut self, p: f64) -> Self {
        self.connection_drop_rate = p;
        self
    }

    /// Random broker faults at these rates, seeded from the simulation's seed.
    pub fn faults(mut self, rates: FaultRates) -> Self {
        self.faults = Some(rates);
        self
    }

    /// Whether to record the event trace (default on).
    pub fn trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// The virtual time the simulation starts at (default [`DEFAULT_START`]).
    pub fn start_at(mut self, start: Timestamp) -> Self {
        self.start = start;
        self
    }

    /// The script of messages published without one (default: always succeed).
    pub fn default_script(mut self, script: Script) -> Self {
        self.default_script = script;
        self
    }

    /// Runs this handler instead of scripts: your own code, on simulated crashes and faults.
    /// Scripts still decide crashes ([`Step::Crash`]) and random crashes still apply; every
    /// other step is replaced by a call to the handler.
    pub fn handler(mut self, handler: impl Handler) -> Self {
        self.settings.handler = Some(Arc::new(handler));
        self
    }

    /// Makes the broker, declares the plan, and starts the consumer processes.
    pub fn build(self) -> Result<Simulation, SimulationError> {
        let s = &self.settings;
        let mut plan = TopologyPlan::builder(&s.queue, &s.policy).with_queue_type(s.queue_type);
        if let Some(limit) = s.delivery_limit {
            plan = plan.with_delivery_limit(limit);
        }
        let plan = plan.build()?;
        let broker = Broker::builder()
            .start_at(self.start)
            .consumer_timeout(s.consumer_timeout)
            .trace(self.trace)
            .build();
        broker.provision(&plan)?;
        if let Some(rates) = self.faults {
            // Its own stream, so broker faults and handler-run faults do not disturb each
            // other when one of them changes.
            broker.random_faults(self.seed ^ 0x5eed_fa17, rates);
        }
        let ledger = Arc::new(Ledger {
            inner: Mutex::new(LedgerState {
                index: FastMap::default(),
                entries: Vec::new(),
                default_script: self.default_script,
                crash_requests: Vec::new(),
                rng: Rng::new(self.seed),
                crash_rate: self.crash_rate,
                connection_drop_rate: self.connection_drop_rate,
            }),
        });
        let mut sim = Simulation {
            broker,
            plan,
            settings: self.settings,
            executor: Executor::default(),
            ledger,
            consumers: Vec::new(),
            schedule: BTreeMap::new(),
            next_event: 0,
            started_at: self.start,
            stopping: false,
            exits: Arc::default(),
        };
        for _ in 0..sim.settings.consumers {
            sim.attach()?;
        }
        Ok(sim)
    }
}

/// A simulation of consumers running the real retry driver ([`Consumer`]) on the in-memory
/// broker, in virtual time.
///
/// Build one with [`Simulation::builder`], publish messages with scripts saying what the
/// handler does on each run, run it, and read the [`Report`]. Consumer processes crash when
/// a script says [`Step::Crash`] (their connection dies holding their unacknowledged
/// deliveries) and restart after the restart delay.
///
/// The executor is single-threaded and deterministic: it polls woken tasks in wake order
/// until none is ready, then moves the virtual clock to the earliest deadline (a message
/// expiring in a queue, a timer from [`Transport::sleep`](retry_core::Transport::sleep), a
/// consumer timeout, a scheduled event), fires it, and repeats.
///
/// ```
/// use retry_core::RetryPolicy;
/// use transport_memory::{Fate, Script, Simulation, Step};
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([60, 600].map(Duration::from_secs)).build()?;
/// let mut sim = Simulation::builder("orders", policy).build()?;
/// sim.publish("flaky", Script::fail_times(2))?;
/// sim.publish("broken", Script::always(Step::permanent("bad payload")))?;
///
/// let report = sim.run_until_quiet();
/// assert!(matches!(report.fate("flaky"), Some(Fate::Handled { attempt: 3, .. })));
/// assert_eq!(report.message("flaky").unwrap().delays, [60, 600].map(Duration::from_secs));
/// assert_eq!(report.fate("broken"), Some(&Fate::Parked { reason: "permanent".into() }));
/// assert_eq!(report.elapsed(), Duration::from_secs(660)); // virtual time, not wall time
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Simulation {
    broker: Broker,
    plan: TopologyPlan,
    settings: Settings,
    executor: Executor,
    ledger: Arc<Ledger>,
    consumers: Vec<Slot>,
    schedule: BTreeMap<(Timestamp, u64), Scheduled>,
    next_event: u64,
    started_at: Timestamp,
    stopping: bool,
    /// Consumers whose run ended in an error, to be restarted.
    exits: Arc<Mutex<Vec<u32>>>,
}

impl fmt::Debug for Simulation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Simulation")
            .field("queue", &self.settings.queue)
            .field("now", &self.broker.now())
            .field("consumers", &self.consumers.len())
            .finish_non_exhaustive()
    }
}

enum Scheduled {
    User(SimEvent),
    Restart,
}

type Outcome = Arc<Mutex<Option<Result<RunReport, String>>>>;

struct Slot {
    number: u32,
    task: TaskId,
    link: LinkHandle,
    shutdown: Arc<Signal>,
    outcome: Outcome,
    crashed: bool,
}

impl Simulation {
    /// A builder for a simulation of `queue` under `policy`.
    pub fn builder(queue: impl Into<String>, policy: RetryPolicy) -> SimulationBuilder {
        SimulationBuilder {
            settings: Settings {
                queue: queue.into(),
                policy,
                queue_type: QueueType::Classic,
                delivery_limit: None,
                prefetch: 10,
                handler_timeout: Duration::from_secs(30),
                shutdown_grace: Duration::from_secs(30),
                consumer_timeout: Some(DEFAULT_CONSUMER_TIMEOUT),
                consumers: 1,
                restart_delay: Duration::from_secs(1),
                horizon: DEFAULT_HORIZON,
                handler: None,
            },
            seed: 0,
            crash_rate: 0.0,
            connection_drop_rate: 0.0,
            faults: None,
            trace: true,
            start: DEFAULT_START,
            default_script: Script::succeed(),
        }
    }

    /// The broker, for inspection and for faults of your own.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// The topology the simulation declared.
    pub fn plan(&self) -> &TopologyPlan {
        &self.plan
    }

    /// The virtual time.
    pub fn now(&self) -> Timestamp {
        self.broker.now()
    }

    /// Publishes a message with id `id` (its `message-id`; its body is the id's bytes) to
    /// the work queue, with the script its handler runs follow.
    pub fn publish(
        &mut self,
        id: impl Into<String>,
        script: Script,
    ) -> Result<(), SimulationError> {
        let id = id.into();
        let body = id.clone().into_bytes();
        let message = Outgoing::to_queue(self.settings.queue.clone(), body).with_message_id(id);
        self.publish_with(message, script).map(drop)
    }

    /// Publishes `message` (to whatever exchange and key it names) with the script its
    /// handler runs follow. It is followed by its `message-id`; one without gets `m<N>`.
    /// Returns the id.
    pub fn publish_with(
        &mut self,
        mut message: Outgoing,
        script: Script,
    ) -> Result<String, SimulationError> {
        let id = match &message.properties.message_id {
            Some(id) => id.clone(),
            None => {
                let n = self.ledger.lock().entries.len() + 1;
                let id = format!("m{n}");
                message.properties.message_id = Some(id.clone());
                id
            }
        };
        let now = self.broker.now();
        if self.ledger.lock().index.contains_key(&id) {
            return Err(SimulationError::DuplicateId(id));
        }
        let (confirm, key) = self.broker.shared.with(|s| {
            let confirm = s.publish(Publisher::Producer, Publishing::from(message));
            (confirm, s.last_key())
        });
        match confirm? {
            retry_core::Confirm::Ack => {
                let mut ledger = self.ledger.lock();
                let i = ledger.add(&id, now, script);
                ledger.entries[i].key = key;
                Ok(id)
            }
            confirm => Err(SimulationError::NotConfirmed { id, confirm }),
        }
    }

    /// Does `event` once the virtual clock has moved `after` past now.
    pub fn schedule(&mut self, after: Duration, event: SimEvent) {
        let at = self.broker.now() + after;
        self.push_schedule(at, Scheduled::User(event));
    }

    /// Kills every consumer process now; each restarts after the restart delay.
    pub fn crash_consumers(&mut self) {
        let live: Vec<u32> = self
            .consumers
            .iter()
            .filter(|s| !s.crashed && self.executor.is_live(s.task))
            .map(|s| s.number)
            .collect();
        for n in live {
            self.crash(n, "crashed by the test");
        }
        self.drain_ready();
    }

    /// Closes every live consumer's connection now, as a network failure would; the
    /// transports recover.
    pub fn close_connections(&mut self) {
        let conns: Vec<usize> = self
            .consumers
            .iter()
            .filter(|s| !s.crashed && self.executor.is_live(s.task))
            .map(|s| s.link.connection())
            .collect();
        for c in conns {
            self.broker.close_connection(c as u64, "connection dropped");
        }
        self.drain_ready();
    }

    /// Runs until nothing is left to do and nothing is due, or the horizon is reached.
    pub fn run_until_quiet(&mut self) -> Report {
        let horizon = self.broker.now() + self.settings.horizon;
        let stop = self.run_until(horizon);
        self.report_with(stop)
    }

    /// Runs for `d` of virtual time; the clock ends exactly `d` later.
    pub fn run_for(&mut self, d: Duration) -> Report {
        let horizon = self.broker.now() + d;
        let stop = self.run_until(horizon);
        if self.broker.now() < horizon {
            self.broker.shared.fire_due(horizon);
            self.drain_ready();
        }
        self.report_with(stop)
    }

    /// Stops every consumer gracefully (as a shutdown signal would) and runs until they have
    /// returned. Deliveries they still held go back to the broker.
    pub fn shutdown(&mut self) -> Report {
        self.stopping = true;
        for slot in &self.consumers {
            slot.shutdown.fire();
        }
        self.schedule
            .retain(|_, e| !matches!(e, Scheduled::Restart));
        let horizon = self.broker.now() + self.settings.horizon;
        let stop = self.run_until(horizon);
        self.report_with(stop)
    }

    /// Where things stand now.
    pub fn report(&self) -> Report {
        self.report_with(Stop::Quiet)
    }

    fn push_schedule(&mut self, at: Timestamp, event: Scheduled) {
        self.next_event += 1;
        self.schedule.insert((at, self.next_event), event);
    }

    fn attach(&mut self) -> Result<(), SimulationError> {
        let number = u32::try_from(self.consumers.len() + 1).unwrap_or(u32::MAX);
        let transport = self.broker.connect();
        let link = transport.link_handle();
        let connection = transport.connection_id();
        self.broker.shared.with(|s| {
            s.record(|| EventKind::ConsumerAttached {
                consumer: number,
                connection,
            });
        });
        let handler = SimHandler {
            ledger: self.ledger.clone(),
            broker: self.broker.clone(),
            consumer: number,
            link: link.clone(),
            custom: self.settings.handler.clone(),
            isolation: Arc::from(self.plan.isolation_queue()),
        };
        let s = &self.settings;
        let (queue_type, limit) = (s.queue_type, s.delivery_limit);
        let (ledger, broker) = (self.ledger.clone(), self.broker.clone());
        let consumer = Consumer::builder(transport, s.policy.clone(), handler)
            .queue(s.queue.clone())
            .prefetch(s.prefetch)
            .handler_timeout(s.handler_timeout)
            .shutdown_grace(s.shutdown_grace)
            .consumer_timeout(s.consumer_timeout.unwrap_or(Duration::MAX))
            .topology(move |b| {
                let b = b.with_queue_type(queue_type);
                match limit {
                    Some(n) => b.with_delivery_limit(n),
                    None => b,
                }
            })
            .on_terminal(move |msg, terminal| ledger.terminal(&broker, msg, terminal))
            .build()?;
        let shutdown = Arc::new(Signal::default());
        let outcome: Outcome = Arc::default();
        let (signal, out, broker) = (shutdown.clone(), outcome.clone(), self.broker.clone());
        let exits = self.exits.clone();
        let task = self.executor.spawn(async move {
            let result = consumer.run(signal.wait()).await;
            let text: Arc<str> = match &result {
                Ok(r) => Arc::from(format!(
                    "run returned: {} received, {} handled",
                    r.received, r.handled
                )),
                Err(e) => Arc::from(format!("run failed: {e}")),
            };
            broker.shared.with(|s| {
                s.record(|| EventKind::ConsumerStopped {
                    consumer: number,
                    outcome: text,
                });
            });
            let failed = result.is_err();
            *lock(&out) = Some(result.map_err(|e| e.to_string()));
            if failed {
                // A process whose consumer gave up exits; its supervisor starts another.
                lock(&exits).push(number);
            }
        });
        self.consumers.push(Slot {
            number,
            task,
            link,
            shutdown,
            outcome,
            crashed: false,
        });
        Ok(())
    }

    /// Kills consumer `number`: its future is dropped mid-flight and its connection closes
    /// with its deliveries unsettled.
    fn crash(&mut self, number: u32, reason: &str) {
        // Consumer numbers count from 1 in attach order.
        let Some(slot) = (number as usize)
            .checked_sub(1)
            .and_then(|i| self.consumers.get_mut(i))
        else {
            return;
        };
        if slot.crashed || !self.executor.is_live(slot.task) {
            return;
        }
        slot.crashed = true;
        let (task, conn) = (slot.task, slot.link.connection());
        let reason: Arc<str> = Arc::from(reason);
        self.broker.shared.with(|s| {
            let why = reason.clone();
            s.record(|| EventKind::ConsumerCrashed {
                consumer: number,
                reason: why,
            });
            s.close_connection(conn, &format!("consumer {number} died: {reason}"));
        });
        self.executor.cancel(task);
        if !self.stopping {
            let at = self.broker.now() + self.settings.restart_delay;
            self.push_schedule(at, Scheduled::Restart);
        }
    }

    /// Polls woken tasks until none is ready, carrying out crashes as handlers ask.
    fn drain_ready(&mut self) {
        while self.executor.poll_next() {
            let requests = std::mem::take(&mut self.ledger.lock().crash_requests);
            for number in requests {
                self.crash(number, "a handler crashed the process");
            }
            let exits = std::mem::take(&mut *lock(&self.exits));
            if !exits.is_empty() && !self.stopping {
                let at = self.broker.now() + self.settings.restart_delay;
                for _ in exits {
                    self.push_schedule(at, Scheduled::Restart);
                }
            }
        }
    }

    fn run_until(&mut self, horizon: Timestamp) -> Stop {
        loop {
            // Scheduled events come first at their instant, so a fault set for time t
            // applies to everything that happens at t.
            let now = self.broker.now();
            while let Some(entry) = self.schedule.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let event = entry.remove();
                self.carry_out(event);
            }
            self.drain_ready();
            let due_now = self
                .schedule
                .first_key_value()
                .is_some_and(|((at, _), _)| *at <= self.broker.now());
            if due_now {
                continue;
            }
            let scheduled = self.schedule.keys().next().map(|(at, _)| *at);
            let next = [self.broker.next_deadline(), scheduled]
                .into_iter()
                .flatten()
                .min();
            match next {
                None => return Stop::Quiet,
                Some(t) if t > horizon => return Stop::Horizon,
                Some(t) => {
                    self.broker.shared.fire_due(t);
                }
            }
        }
    }

    fn carry_out(&mut self, event: Scheduled) {
        match event {
            Scheduled::Restart => {
                if !self.stopping {
                    // Settings were valid when the simulation was built, so this cannot fail.
                    let _ = self.attach();
                }
            }
            Scheduled::User(e) => match e {
                SimEvent::Publish { id, script } => {
                    let _ = self.publish(id, script);
                }
                SimEvent::CrashConsumers => self.crash_consumers(),
                SimEvent::CloseConnections => self.close_connections(),
                SimEvent::LosePublishes(n) => self.broker.lose_publishes(n),
                SimEvent::RefusePublishes(n) => self.broker.refuse_publishes(n),
                SimEvent::LoseConfirms(n) => self.broker.lose_confirms(n),
                SimEvent::DuplicateDeliveries(n) => self.broker.duplicate_deliveries(n),
            },
        }
    }

    fn report_with(&self, stop: Stop) -> Report {
        let (copies, trace, deliveries) = {
            let s = self.broker.shared.lock();
            (s.copies(), s.trace.clone(), s.deliveries)
        };
        let parking = self.plan.parking_queue();
        let parked = self.broker.messages(parking).unwrap_or_default();
        let mut parked_by_id: HashMap<&str, Vec<&crate::QueuedMessage>> = HashMap::new();
        for m in &parked {
            parked_by_id.entry(&m.label).or_default().push(m);
        }
        let ledger = self.ledger.lock();
        let messages = ledger
            .index
            .iter()
            .map(|(id, &i)| {
                let entry = &ledger.entries[i];
                let parked = parked_by_id.get(id.as_str()).map_or(&[][..], Vec::as_slice);
                let located = copies.get(id.as_str());
                (id.clone(), entry.report(id, parked, located, parking))
            })
            .collect();
        let consumers = self
            .consumers
            .iter()
            .map(|s| ConsumerReport {
                number: s.number,
                state: if s.crashed {
                    ConsumerState::Crashed
                } else {
                    match &*lock(&s.outcome) {
                        None => ConsumerState::Running,
                        Some(Ok(r)) => ConsumerState::Finished(*r),
                        Some(Err(e)) => ConsumerState::Failed(e.clone()),
                    }
                },
            })
            .collect();
        Report {
            stop,
            started_at: self.started_at,
            ended_at: self.broker.now(),
            messages,
            consumers,
            trace,
            deliveries,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the simulation knows about each message.
struct Ledger {
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
        Entry {
            key: MessageKey(0),
            published_at,
            script,
            runs: Vec::new(),
            terminals: Vec::new(),
            order: Vec::new(),
        }
    }

    fn report(
        &self,
        id: &str,
        parked: &[&crate::QueuedMessage],
        located: Option<&(Vec<Arc<str>>, bool)>,
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
            duplicates: ended.saturating_sub(1),
            order: self.order.clone(),
        }
    }
}

/// Why a parked copy was parked: the engine's reason, or the broker's when the broker
/// dead-lettered it.
fn parked_reason(m: &crate::QueuedMessage) -> String {
    if let Some(r) = ParkedRecord::decode(&m.headers).reason {
        return r.as_str().to_owned();
    }
    match m.headers.get("x-first-death-reason") {
        Some(HeaderValue::Str(r)) => r.clone(),
        _ => DeadLetterReason::AttemptsExhausted.as_str().to_owned(),
    }
}

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, LedgerState> {
        lock(&self.inner)
    }

    /// Starts a handler run: records it and says what it does.
    fn begin(&self, id: &str, attempt: u32, consumer: u32, solo: bool, now: Timestamp) -> Begun {
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
    fn end(&self, id: &str, run: usize, step: Step) {
        let mut l = self.lock();
        let i = l.index.get(id).copied();
        if let Some(r) = i.and_then(|i| l.entries[i].runs.get_mut(run)) {
            r.step = step;
            r.ended = true;
        }
    }

    fn terminal(&self, broker: &Broker, msg: &Message, terminal: &Terminal) {
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
struct Begun {
    key: MessageKey,
    /// The run's index among the message's runs.
    run: usize,
    step: Step,
    takes: Duration,
    drop_connection: bool,
}

fn message_id(msg: &Message) -> &str {
    msg.properties()
        .message_id
        .as_deref()
        .unwrap_or("(no message-id)")
}

fn message_ref(key: MessageKey, id: &str) -> MessageRef {
    MessageRef {
        key,
        label: Arc::from(id),
    }
}

/// The handler every simulated consumer runs: the message's script, or the user's handler.
struct SimHandler {
    ledger: Arc<Ledger>,
    broker: Broker,
    consumer: u32,
    link: LinkHandle,
    custom: Option<Arc<dyn Handler>>,
    /// The isolation queue: a message from it is a suspect running alone.
    isolation: Arc<str>,
}

impl SimHandler {
    fn record(&self, kind: impl FnOnce() -> EventKind) {
        self.broker.shared.with(|s| s.record(kind));
    }

    fn finished(&self, key: MessageKey, id: &str, run: usize, step: &Step) {
        let consumer = self.consumer;
        self.ledger.end(id, run, step.clone());
        self.record(|| EventKind::HandlerFinished {
            message: message_ref(key, id),
            consumer,
            outcome: Arc::from(step.to_string()),
        });
    }

    async fn crash(&self, key: MessageKey, id: &str, run: usize) -> Result<(), HandlerError> {
        self.finished(key, id, run, &Step::Crash);
        self.ledger.lock().crash_requests.push(self.consumer);
        // The process is dying: this run never ends, and the simulation drops it.
        std::future::pending().await
    }
}

#[async_trait]
impl Handler for SimHandler {
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        let id = message_id(msg);
        let now = self.broker.now();
        let (consumer, attempt) = (self.consumer, msg.attempt());
        let Begun {
            key,
            run,
            step,
            takes,
            drop_connection,
        } = self
            .ledger
            .begin(id, attempt, consumer, msg.queue() == &*self.isolation, now);
        self.record(|| EventKind::HandlerStarted {
            message: message_ref(key, id),
            consumer,
            attempt,
        });
        if drop_connection {
            let conn = self.link.connection() as u64;
            self.broker
                .close_connection(conn, "connection dropped mid-handler");
        }
        if let Some(custom) = &self.custom {
            if step == Step::Crash {
                return self.crash(key, id, run).await;
            }
            let result = custom.handle(msg).await;
            let step = match &result {
                Ok(()) => Step::Succeed,
                Err(e) => Step::fail(e.to_string()),
            };
            self.finished(key, id, run, &step);
            return result;
        }
        if !takes.is_zero() {
            self.broker.sleep(takes).await;
        }
        match &step {
            Step::Crash => return self.crash(key, id, run).await,
            Step::Hang => return std::future::pending().await,
            _ => self.finished(key, id, run, &step),
        }
        match step {
            Step::Fail(cause) => Err(HandlerError::transient(String::from(&*cause))),
            Step::Permanent(cause) => Err(HandlerError::permanent(String::from(&*cause))),
            Step::RetryAfter(d, cause) => Err(HandlerError::retry_after(d, String::from(&*cause))),
            // Unwinds without the panic hook: the driver catches it like any panic, and
            // scripted panics do not litter test output.
            Step::Panic(message) => std::panic::resume_unwind(Box::new(message.to_string())),
            _ => Ok(()),
        }
    }
}

/// A one-shot signal a future can wait on.
#[derive(Default)]
struct Signal {
    state: Mutex<(bool, Option<Waker>)>,
}

impl Signal {
    fn fire(&self) {
        let waker = {
            let mut s = lock(&self.state);
            s.0 = true;
            s.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn wait(self: Arc<Self>) -> impl Future<Output = ()> {
        futures::future::poll_fn(move |cx| {
            let mut s = lock(&self.state);
            if s.0 {
                Poll::Ready(())
            } else {
                s.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}
