//! `Simulation`: the real consumer driver on the in-memory broker, with scripted handlers,
//! crashes and faults, run on virtual time by a deterministic single-threaded executor.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use retry_core::{
    Consumer, ConsumerError, DelayStrategy, Handler, QueueType, RetryPolicy, RunReport, SoloGate,
    StormControl, Timestamp, TopologyPlan, splitmix64,
};

use crate::broker::Broker;
use crate::broker::message::{Outgoing, Publishing, QueuedMessage};
use crate::broker::trace::{EventKind, Publisher};
use crate::simulation::error::SimulationError;
use crate::simulation::executor::{Executor, TaskId};
use crate::simulation::handler::SimHandler;
use crate::simulation::ledger::{LABEL, Ledger};
use crate::simulation::lock;
use crate::simulation::report::{ConsumerReport, ConsumerState, Report, Stop};
use crate::simulation::script::Script;
use crate::transport::connection::MemoryTransport;
use crate::transport::link::LinkHandle;

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
    /// Route the next `n` publishes through connections nowhere, as if their bindings had
    /// gone: they come back returned.
    ReturnPublishes(u32),
    /// Fail the next `n` watches of a queue with a lost connection.
    FailWatches(u32),
    /// Fail the next `n` subscribes with a lost connection.
    FailSubscribes(u32),
    /// Make the next `n` fetches that find a message give up before it arrives.
    LateFetches(u32),
    /// Lose the next `n` fetches that find a message on their way: the message goes back to
    /// the head of its queue redelivered, and the fetch fails with a lost fetch.
    LoseFetches(u32),
    /// Complete the next `n` batches of publisher confirms out of order, handing returns to
    /// the wrong publish, as lapin 4.12 does.
    MisattributeReturns(u32),
    /// Stop every consumer process gracefully, as a deploy does; each starts again after the
    /// restart delay.
    RestartConsumers,
}

/// The consumer settings every simulated consumer process is built with.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) queue: String,
    pub(crate) policy: RetryPolicy,
    pub(crate) queue_type: QueueType,
    pub(crate) delivery_limit: Option<u32>,
    pub(crate) strategy: DelayStrategy,
    pub(crate) prefetch: u16,
    pub(crate) handler_timeout: Duration,
    pub(crate) shutdown_grace: Duration,
    pub(crate) consumer_timeout: Option<Duration>,
    pub(crate) consumers: u32,
    pub(crate) restart_delay: Duration,
    pub(crate) horizon: Duration,
    pub(crate) handler: Option<Arc<dyn Handler>>,
    pub(crate) storm: Option<StormControl>,
    /// Consumers in each process, sharing its connection and its fate.
    pub(crate) per_process: u32,
    /// How long a fetch's answer takes to arrive.
    pub(crate) fetch_latency: Duration,
    /// The simulation's seed, from which each process's suspect tokens are drawn.
    pub(crate) seed: u64,
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
///
/// [`Step::Crash`]: crate::Step::Crash
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
    /// Stopped on purpose, to start again once it has returned.
    restart: Arc<AtomicBool>,
}

impl Simulation {
    /// Starts the consumer processes on `broker`, where `plan` is declared.
    pub(crate) fn start(
        broker: Broker,
        plan: TopologyPlan,
        settings: Settings,
        ledger: Ledger,
        started_at: Timestamp,
    ) -> Result<Simulation, SimulationError> {
        let mut sim = Simulation {
            broker,
            plan,
            settings,
            executor: Executor::default(),
            ledger: Arc::new(ledger),
            consumers: Vec::new(),
            schedule: BTreeMap::new(),
            next_event: 0,
            started_at,
            stopping: false,
            exits: Arc::default(),
        };
        for _ in 0..sim.settings.consumers {
            sim.attach()?;
        }
        Ok(sim)
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
                let n = self.ledger.len() + 1;
                let id = format!("m{n}");
                message.properties.message_id = Some(id.clone());
                id
            }
        };
        let now = self.broker.now();
        if self.ledger.contains(&id) {
            return Err(SimulationError::DuplicateId(id));
        }
        let (confirm, key) = self.broker.shared.with(|s| {
            let confirm = s.publish(Publisher::Producer, Publishing::from(message));
            (confirm, s.last_key())
        });
        match confirm? {
            retry_core::Confirm::Ack => {
                self.ledger.add(&id, now, script, key);
                Ok(id)
            }
            confirm => Err(SimulationError::NotConfirmed { id, confirm }),
        }
    }

    /// Publishes `message` with the script its handler runs follow, followed by `label`
    /// rather than by its `message-id`: several messages can then share an id or a body,
    /// as real ones do. The label travels in an `x-simulation-label` header.
    ///
    /// ```
    /// use retry_core::RetryPolicy;
    /// use transport_memory::{Fate, Outgoing, Script, Simulation};
    ///
    /// let mut sim = Simulation::builder("orders", RetryPolicy::default()).build()?;
    /// for label in ["first", "second"] {
    ///     let same = Outgoing::to_queue("orders", b"same body".to_vec()).with_message_id("order-1");
    ///     sim.publish_labelled(label, same, Script::succeed())?;
    /// }
    /// let report = sim.run_until_quiet();
    /// assert!(matches!(report.fate("first"), Some(Fate::Handled { .. })));
    /// assert!(matches!(report.fate("second"), Some(Fate::Handled { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn publish_labelled(
        &mut self,
        label: impl Into<String>,
        message: Outgoing,
        script: Script,
    ) -> Result<(), SimulationError> {
        let label = label.into();
        if self.ledger.contains(&label) {
            return Err(SimulationError::DuplicateId(label));
        }
        let message = message.with_header(LABEL, label.as_str());
        let now = self.broker.now();
        let (confirm, key) = self.broker.shared.with(|s| {
            let mut publishing = Publishing::from(message);
            let identity = s.new_labelled(&label);
            let key = identity.0;
            publishing.identity = Some(identity);
            (s.publish(Publisher::Producer, publishing), key)
        });
        match confirm? {
            retry_core::Confirm::Ack => {
                self.ledger.add(&label, now, script, key);
                Ok(())
            }
            confirm => Err(SimulationError::NotConfirmed { id: label, confirm }),
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

    /// Stops every live consumer process gracefully now, as a deploy does: each finishes
    /// what it holds within its shutdown grace, returns, and starts again after the restart
    /// delay.
    pub fn restart_consumers(&mut self) {
        self.broker.shared.with(|s| {
            s.record(|| EventKind::Fault {
                description: Arc::from("graceful restart of every consumer process"),
            });
        });
        for slot in &self.consumers {
            if !slot.crashed && self.executor.is_live(slot.task) {
                slot.restart.store(true, AtomicOrdering::SeqCst);
                slot.shutdown.fire();
            }
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
        let transport = self
            .broker
            .connect()
            .with_fetch_latency(self.settings.fetch_latency);
        let link = transport.link_handle();
        let connection = transport.connection_id();
        self.broker.shared.with(|s| {
            s.record(|| EventKind::ConsumerAttached {
                consumer: number,
                connection,
            });
        });
        // The consumers of one process share its connection, its gate and its fate; their
        // suspect tokens are drawn from the simulation's seed, so that runs replay exactly.
        let transport = Arc::new(transport);
        let gate = SoloGate::new();
        let mut consumers = Vec::new();
        for k in 0..self.settings.per_process.max(1) {
            let seed = splitmix64(self.settings.seed ^ u64::from(number) ^ (u64::from(k) << 32));
            consumers.push(self.consumer(number, &transport, &link, &gate, seed)?);
        }
        let shutdown = Arc::new(Signal::default());
        let outcome: Outcome = Arc::default();
        let restart = Arc::new(AtomicBool::new(false));
        let (signal, out, broker) = (shutdown.clone(), outcome.clone(), self.broker.clone());
        let (exits, again) = (self.exits.clone(), restart.clone());
        let task = self.executor.spawn(async move {
            let runs = consumers.into_iter().map(|c| c.run(signal.clone().wait()));
            let mut result: Result<RunReport, ConsumerError> = Ok(RunReport::default());
            for one in futures::future::join_all(runs).await {
                result = match (result, one) {
                    (Ok(mut total), Ok(r)) => {
                        total += r;
                        Ok(total)
                    }
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
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
            if failed || again.load(AtomicOrdering::SeqCst) {
                // A process whose consumer gave up exits, and one stopped for a deploy
                // exits: its supervisor starts another.
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
            restart,
        });
        Ok(())
    }

    /// One consumer of process `number`.
    fn consumer(
        &self,
        number: u32,
        transport: &Arc<MemoryTransport>,
        link: &LinkHandle,
        gate: &SoloGate,
        seed: u64,
    ) -> Result<Consumer<Arc<MemoryTransport>, SimHandler>, SimulationError> {
        let handler = SimHandler {
            ledger: self.ledger.clone(),
            broker: self.broker.clone(),
            consumer: number,
            link: link.clone(),
            custom: self.settings.handler.clone(),
            isolation: Arc::from(self.plan.isolation_queue()),
        };
        let s = &self.settings;
        let (queue_type, limit, strategy) = (s.queue_type, s.delivery_limit, s.strategy.clone());
        let (ledger, broker) = (self.ledger.clone(), self.broker.clone());
        let mut consumer = Consumer::builder(
            transport.clone(),
            s.queue.clone(),
            s.policy.clone(),
            handler,
        )
        .with_prefetch(s.prefetch)
        .with_handler_timeout(s.handler_timeout)
        .with_shutdown_grace(s.shutdown_grace)
        .with_consumer_timeout(s.consumer_timeout.unwrap_or(Duration::MAX))
        .with_topology(move |b| {
            let b = b.with_queue_type(queue_type).with_strategy(strategy);
            match limit {
                Some(n) => b.with_delivery_limit(n),
                None => b,
            }
        })
        .with_on_terminal(move |msg, terminal| ledger.terminal(&broker, msg, terminal))
        .with_solo_gate(gate.clone())
        .with_token_seed(seed);
        if let Some(storm) = &s.storm {
            consumer = consumer.with_storm_control(storm.clone());
        }
        Ok(consumer.build()?)
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
            let requests = self.ledger.take_crash_requests();
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
                SimEvent::ReturnPublishes(n) => self.broker.return_publishes(n),
                SimEvent::FailWatches(n) => self.broker.fail_watches(n),
                SimEvent::FailSubscribes(n) => self.broker.fail_subscribes(n),
                SimEvent::LateFetches(n) => self.broker.late_fetches(n),
                SimEvent::LoseFetches(n) => self.broker.lose_fetches(n),
                SimEvent::MisattributeReturns(n) => self.broker.misattribute_returns(n),
                SimEvent::RestartConsumers => self.restart_consumers(),
            },
        }
    }

    fn report_with(&self, stop: Stop) -> Report {
        let (copies, trace, deliveries, lost_fetches) = {
            let s = self.broker.shared.lock();
            (
                s.copies(),
                s.trace().clone(),
                s.connections().deliveries(),
                s.lost_fetches().clone(),
            )
        };
        let parking = self.plan.parking_queue();
        let parked: Vec<QueuedMessage> = self.broker.messages(parking).unwrap_or_default();
        let messages = self
            .ledger
            .reports(&parked, &copies, &lost_fetches, parking);
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
