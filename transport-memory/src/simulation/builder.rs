//! Building a [`Simulation`]: its settings, each with a default.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{
    DelayStrategy, Handler, QueueType, RetryPolicy, StormControl, Timestamp, TopologyPlan,
};

use crate::broker::fault::{FaultRates, Rng};
use crate::broker::{Broker, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_START};
use crate::simulation::error::SimulationError;
use crate::simulation::ledger::Ledger;
use crate::simulation::script::Script;
use crate::simulation::simulator::{Settings, Simulation};

/// How far a run goes in virtual time unless told otherwise: a year.
pub const DEFAULT_HORIZON: Duration = Duration::from_secs(365 * 24 * 3600);

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
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.settings.queue_type = queue_type;
        self
    }

    /// Quorum queues: the broker's `x-delivery-limit` on the work queue (default none).
    pub fn with_delivery_limit(mut self, limit: u32) -> Self {
        self.settings.delivery_limit = Some(limit);
        self
    }

    /// How delays are realised on the broker (default
    /// [`DelayStrategy::PerDelayQueue`]): with [`DelayStrategy::Cascade`], every delayed
    /// clone goes through the binary cascade of TTL levels, and comes back after exactly its
    /// delay rounded up to the cascade's unit.
    ///
    /// ```
    /// use retry_core::{Cascade, DelayStrategy, RetryPolicy};
    /// use transport_memory::{Script, Simulation, Step};
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(60)]).build()?;
    /// let mut sim = Simulation::builder("orders", policy)
    ///     .with_strategy(DelayStrategy::Cascade(Cascade::new()))
    ///     .build()?;
    /// sim.publish("m", Script::fail_times(1))?;
    /// let report = sim.run_until_quiet();
    /// let runs = &report.message("m").unwrap().runs;
    /// assert_eq!(runs[1].at, runs[0].at + Duration::from_secs(60));
    /// assert_eq!(sim.broker().ready("retry.cascade.10ms.12"), Some(0)); // its top level
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_strategy(mut self, strategy: DelayStrategy) -> Self {
        self.settings.strategy = strategy;
        self
    }

    /// Each consumer's prefetch, and so its concurrent handlers (default 10).
    pub fn with_prefetch(mut self, prefetch: u16) -> Self {
        self.settings.prefetch = prefetch;
        self
    }

    /// The driver's handler timeout (default 30 s).
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// The driver's shutdown grace (default 30 s).
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.settings.shutdown_grace = grace;
        self
    }

    /// The broker's consumer timeout (default 30 min, as RabbitMQ; `None` turns it off).
    pub fn with_consumer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.settings.consumer_timeout = timeout;
        self
    }

    /// How many consumer processes run at once (default 1).
    pub fn with_consumers(mut self, n: u32) -> Self {
        self.settings.consumers = n.max(1);
        self
    }

    /// How many consumers each process runs (default 1): they share the process's
    /// connection and its [`SoloGate`](retry_core::SoloGate), and a crash takes them all
    /// down together.
    pub fn with_consumers_per_process(mut self, n: u32) -> Self {
        self.settings.per_process = n.max(1);
        self
    }

    /// How long each fetch's answer takes to arrive, in virtual time (default none): a
    /// shutdown or a crash can then come while a fetch is under way.
    pub fn with_fetch_latency(mut self, latency: Duration) -> Self {
        self.settings.fetch_latency = latency;
        self
    }

    /// How long after a crash its replacement process starts (default 1 s).
    pub fn with_restart_delay(mut self, delay: Duration) -> Self {
        self.settings.restart_delay = delay;
        self
    }

    /// The virtual-time limit of [`Simulation::run_until_quiet`] (default
    /// [`DEFAULT_HORIZON`]).
    pub fn with_horizon(mut self, horizon: Duration) -> Self {
        self.settings.horizon = horizon;
        self
    }

    /// The seed of every random choice: random crashes, connection drops and broker faults
    /// (default 0). The same seed and script give the same trace.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self.settings.seed = seed;
        self
    }

    /// The probability that a handler run crashes its consumer, on top of its script.
    pub fn with_crash_rate(mut self, p: f64) -> Self {
        self.crash_rate = p;
        self
    }

    /// The probability that a handler run starts with its consumer's connection dropped
    /// (the run goes on; the transport recovers).
    pub fn with_connection_drop_rate(mut self, p: f64) -> Self {
        self.connection_drop_rate = p;
        self
    }

    /// Random broker faults at these rates, seeded from the simulation's seed.
    pub fn with_faults(mut self, rates: FaultRates) -> Self {
        self.faults = Some(rates);
        self
    }

    /// Whether to record the event trace (default on).
    pub fn with_trace(mut self, on: bool) -> Self {
        self.trace = on;
        self
    }

    /// The virtual time the simulation starts at (default [`DEFAULT_START`]).
    pub fn with_start_at(mut self, start: Timestamp) -> Self {
        self.start = start;
        self
    }

    /// The script of messages published without one (default: always succeed).
    pub fn with_default_script(mut self, script: Script) -> Self {
        self.default_script = script;
        self
    }

    /// Runs this handler instead of scripts: your own code, on simulated crashes and faults.
    /// Scripts still decide crashes ([`Step::Crash`]) and how long each run takes in virtual
    /// time ([`Script::taking`]), and random crashes still apply; every other step is
    /// replaced by a call to the handler. `transport-memory/tests/crash_loops.rs` is a
    /// complete test of a handler of your own, to copy.
    ///
    /// [`Script::taking`]: crate::Script::taking
    ///
    /// [`Step::Crash`]: crate::Step::Crash
    pub fn with_handler(mut self, handler: impl Handler) -> Self {
        self.settings.handler = Some(Arc::new(handler));
        self
    }

    /// Runs every consumer with storm control
    /// ([`ConsumerBuilder::with_storm_control`](retry_core::ConsumerBuilder::with_storm_control)).
    pub fn with_storm_control(mut self, storm: StormControl) -> Self {
        self.settings.storm = Some(storm);
        self
    }

    /// Makes the broker, declares the plan, and starts the consumer processes.
    pub fn build(self) -> Result<Simulation, SimulationError> {
        let s = &self.settings;
        let mut plan = TopologyPlan::builder(&s.queue, &s.policy)
            .with_queue_type(s.queue_type)
            .with_strategy(s.strategy.clone());
        if let Some(limit) = s.delivery_limit {
            plan = plan.with_delivery_limit(limit);
        }
        let plan = plan.build()?;
        let broker = Broker::builder()
            .with_start_at(self.start)
            .with_consumer_timeout(s.consumer_timeout)
            .with_trace(self.trace)
            .build();
        broker.provision(&plan)?;
        if let Some(rates) = self.faults {
            // Its own stream, so broker faults and handler-run faults do not disturb each
            // other when one of them changes.
            broker.random_faults(self.seed ^ 0x5eed_fa17, rates);
        }
        let ledger = Ledger::new(
            self.default_script,
            Rng::new(self.seed),
            self.crash_rate,
            self.connection_drop_rate,
        );
        Simulation::start(broker, plan, self.settings, ledger, self.start)
    }
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
                strategy: DelayStrategy::PerDelayQueue,
                prefetch: 10,
                handler_timeout: Duration::from_secs(30),
                shutdown_grace: Duration::from_secs(30),
                consumer_timeout: Some(DEFAULT_CONSUMER_TIMEOUT),
                consumers: 1,
                restart_delay: Duration::from_secs(1),
                horizon: DEFAULT_HORIZON,
                handler: None,
                storm: None,
                seed: 0,
                per_process: 1,
                fetch_latency: Duration::ZERO,
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
}
