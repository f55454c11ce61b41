//! `Engine`: the decision state machine in the quinn-proto style. Feed it inputs with the
//! `handle_*` methods, drain its outputs with the `poll_*` methods; it does no IO and reads no
//! clock.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use crate::decision::{
    Admission, AttemptState, CRASH_CAUSE, DeadLetterReason, Decision, Lane, Outcome, admit, decide,
    recorded_cause,
};
use crate::facts::DeliveryFacts;
use crate::headers::EngineHeaders;
use crate::policy::RetryPolicy;
use crate::time::{Timestamp, format_delay};
use crate::topology::{QueueType, Route, TopologyPlan};

/// The engine's handle on one delivery, from [`Engine::handle_delivery`] until the delivery
/// is settled or forgotten. Handles are not reused while the delivery is live, and a stale
/// handle is refused.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryId(u64);

impl DeliveryId {
    fn new(index: u32, generation: u32) -> Self {
        DeliveryId((u64::from(generation) << 32) | u64::from(index))
    }

    fn index(self) -> usize {
        (self.0 & 0xffff_ffff) as usize
    }

    fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl fmt::Debug for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeliveryId({}#{})", self.index(), self.generation())
    }
}

impl fmt::Display for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.index(), self.generation())
    }
}

/// The broker's answer to a publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Confirm {
    /// Confirmed: the broker has the clone.
    Ack,
    /// Refused (a negative confirm, e.g. a full queue with `reject-publish`).
    Nack,
    /// Returned as unroutable (a `mandatory` publish that reached no queue).
    Returned,
    /// The publish failed: connection or channel error, or no answer in time.
    Failed,
}

/// How to settle the original delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Settlement {
    /// Acknowledge: remove it from the queue.
    Ack,
    /// Return it to the queue (it comes back marked redelivered).
    Requeue,
    /// Reject without requeue: the broker dead-letters it through the queue's
    /// dead-letter exchange. The engine never asks for this (it parks by publishing, so the
    /// parked copy carries its diagnostics); it is here for transports and tools.
    Reject,
}

/// How a delivery ended: exactly one per delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Terminal {
    /// The handler succeeded.
    Handled {
        /// Handler runs, the successful one included.
        attempt: u32,
    },
    /// A clone was confirmed on its delay route.
    Retried {
        /// Failed runs so far.
        attempts: u32,
        /// The clone's delay.
        delay: Duration,
    },
    /// A suspect (redelivered from the work queue) was cloned into the isolation queue,
    /// without a handler run and without counting a crash.
    Isolated,
    /// A suspect that crashed its consumer while running alone was cloned, with the crash
    /// counted, through the crash delay back into the isolation queue, without a handler
    /// run.
    Diverted {
        /// Crashes so far.
        crashes: u32,
        /// The crash delay (zero when it went straight back).
        delay: Duration,
    },
    /// A clone was confirmed in the parking queue.
    DeadLettered {
        /// Why it was parked.
        reason: DeadLetterReason,
    },
    /// Dropped, as the policy allows.
    Dropped {
        /// Why it was dropped.
        reason: DeadLetterReason,
    },
    /// The clone's publish did not succeed, retries included; the original goes back to the
    /// queue.
    Requeued {
        /// The broker's last answer.
        cause: Confirm,
    },
}

/// A clone to publish: the original's body and properties, with these headers written over
/// the original's (see [`clone_headers`](crate::headers::clone_headers)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publish {
    /// The exchange and routing key to publish to.
    pub route: Route,
    /// Per-message TTL, when the delay is shorter than the delay queue's.
    pub expiration: Option<Duration>,
    /// The engine's headers for the clone.
    pub headers: EngineHeaders,
}

/// Something for the driver to do, in the order the engine emits them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Run the handler on the delivery; report with [`Engine::handle_outcome`].
    RunHandler {
        /// The delivery.
        delivery: DeliveryId,
        /// The run number (1-based).
        attempt: u32,
    },
    /// Publish a clone with confirmation; report with [`Engine::handle_confirm`]. The
    /// original must not be settled until then.
    Publish {
        /// The delivery the clone is of.
        delivery: DeliveryId,
        /// The clone.
        publish: Publish,
    },
    /// Settle the original. The delivery is finished.
    Settle {
        /// The delivery.
        delivery: DeliveryId,
        /// Ack, requeue or reject.
        settlement: Settlement,
        /// How the delivery ended.
        terminal: Terminal,
    },
}

/// An input the engine cannot accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The delivery is finished, forgotten, or was never handed in.
    #[error("delivery {0} is not in flight")]
    UnknownDelivery(DeliveryId),
    /// An outcome arrived for a delivery whose handler is not running.
    #[error("delivery {0} got a handler outcome but no handler run was requested")]
    UnexpectedOutcome(DeliveryId),
    /// A confirm arrived for a delivery with no publish pending.
    #[error("delivery {0} got a confirm but no publish was requested")]
    UnexpectedConfirm(DeliveryId),
    /// The plan lacks a delay level the policy needs: it was made for another policy.
    #[error(
        "the topology plan for {queue:?} has no delay queue for {delay:?}, which the policy needs; make the plan from the same policy"
    )]
    MissingDelayLevel {
        /// The work queue.
        queue: String,
        /// The missing level.
        delay: Duration,
    },
    /// The policy diverts crashed suspects through a crash delay the plan has no queue for:
    /// the plan was made for another policy.
    #[error(
        "the topology plan for {queue:?} has no crash-delay queue {missing:?} for the policy's {delay:?} crash delay; make the plan from the same policy"
    )]
    MissingCrashDelay {
        /// The work queue.
        queue: String,
        /// The crash-delay queue the policy needs.
        missing: String,
        /// The crash delay.
        delay: Duration,
    },
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    /// A handler run was asked for.
    Running,
    /// Waiting for an in-process retry.
    Waiting,
    /// A publish was asked for; its confirm decides the settlement.
    Confirming { terminal: Terminal },
    /// The broker did not confirm the clone; waiting to publish it again.
    Republishing { terminal: Terminal },
}

#[derive(Debug)]
struct Live {
    state: AttemptState,
    phase: Phase,
    lane: Lane,
    /// The clone being published, kept for publish retries.
    publish: Option<Publish>,
    /// Publish retries spent on it.
    publish_retries: u32,
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    live: Option<Live>,
}

/// How many excused identities the engine remembers; older ones are forgotten first.
const EXCUSED_CAPACITY: usize = 1024;

/// The retry state machine for one work queue.
///
/// ```
/// use retry_core::{
///     Action, BrokerSignals, Confirm, DeliveryFacts, Engine, Headers, Lane, Outcome,
///     RetryPolicy, Settlement, Terminal, Timestamp, TopologyPlan,
/// };
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// let mut engine = Engine::new(policy, &plan)?;
/// let now = Timestamp::from_millis(1_000);
///
/// // A delivery arrives from the work queue: the engine asks for a handler run.
/// let facts = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), 0);
/// let id = engine.handle_delivery(now, Lane::Work, facts);
/// assert!(matches!(engine.poll_action(now), Some(Action::RunHandler { attempt: 1, .. })));
///
/// // It fails: publish a clone to the 30 s delay queue, and only then ack.
/// engine.handle_outcome(now, id, Outcome::Transient("db down".into()))?;
/// let Some(Action::Publish { publish, .. }) = engine.poll_action(now) else { panic!() };
/// assert_eq!(&*publish.route.routing_key, "comments.retry.30s");
/// assert_eq!(engine.poll_action(now), None); // nothing is settled before the confirm
///
/// engine.handle_confirm(now, id, Confirm::Ack)?;
/// assert!(matches!(
///     engine.poll_action(now),
///     Some(Action::Settle { settlement: Settlement::Ack, terminal: Terminal::Retried { .. }, .. })
/// ));
///
/// // A redelivered one is a suspect: cloned into the isolation queue, its handler not run.
/// let redelivered = BrokerSignals { redelivered: true, ..BrokerSignals::default() };
/// let facts = DeliveryFacts::decode(&Headers::new(), redelivered, 0);
/// engine.handle_delivery(now, Lane::Work, facts);
/// let Some(Action::Publish { publish, .. }) = engine.poll_action(now) else { panic!() };
/// assert_eq!(&*publish.route.routing_key, "comments.suspect");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Engine {
    policy: RetryPolicy,
    plan: TopologyPlan,
    slots: Vec<Slot>,
    free: Vec<u32>,
    actions: VecDeque<Action>,
    timers: Vec<(Timestamp, DeliveryId)>,
    in_flight: usize,
    excused: VecDeque<u64>,
}

impl Engine {
    /// An engine for `policy` over `plan`, which must have been made from the same policy:
    /// every delay level the policy can ask for, and its crash delay, need their queues.
    pub fn new(policy: RetryPolicy, plan: &TopologyPlan) -> Result<Self, EngineError> {
        for &delay in policy.delay_levels() {
            if !plan.delay_routes().iter().any(|(level, _)| *level == delay) {
                return Err(EngineError::MissingDelayLevel {
                    queue: plan.work_queue().to_owned(),
                    delay,
                });
            }
        }
        if let Some(delay) = policy.crash_delay_level()
            && plan.crash_route().map(|(d, _)| d) != Some(delay)
        {
            return Err(EngineError::MissingCrashDelay {
                queue: plan.work_queue().to_owned(),
                missing: format!("{}.crash.{}", plan.work_queue(), format_delay(delay)),
                delay,
            });
        }
        Ok(Engine {
            policy,
            plan: plan.clone(),
            slots: Vec::new(),
            free: Vec::new(),
            actions: VecDeque::new(),
            timers: Vec::new(),
            in_flight: 0,
            excused: VecDeque::new(),
        })
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The plan.
    pub fn plan(&self) -> &TopologyPlan {
        &self.plan
    }

    /// Deliveries handed in and not yet settled or forgotten.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// A delivery arrived from `lane`. The engine queues a handler run or, for a suspect or
    /// a crashed suspect, the publish that isolates, diverts or parks it (see [`admit`]).
    pub fn handle_delivery(
        &mut self,
        now: Timestamp,
        lane: Lane,
        facts: DeliveryFacts,
    ) -> DeliveryId {
        let id = self.allocate();
        let mut facts = facts;
        if self.plan.queue_type() != QueueType::Quorum {
            // Only a quorum queue sets x-delivery-count; on any other, a publisher did.
            facts.x_delivery_count = 0;
        }
        if lane == Lane::Isolation && facts.crash_evidence() > 0 && self.take_excuse(facts.identity)
        {
            // It went back to the isolation queue through no crash of its own.
            facts.redelivered = false;
            facts.delivery_count = 0;
            facts.x_delivery_count = 0;
        }
        match admit(&self.policy, lane, &facts) {
            Admission::Run(state) => {
                self.set(id, Live::new(state, Phase::Running, lane));
                self.actions.push_back(Action::RunHandler {
                    delivery: id,
                    attempt: state.attempt,
                });
            }
            Admission::Decided(state, decision) => {
                let runs = state.attempt.saturating_sub(1);
                let cause = matches!(
                    decision,
                    Decision::Divert { .. } | Decision::DeadLetter { .. }
                )
                .then(|| CRASH_CAUSE.to_owned());
                self.execute(now, id, lane, state, decision, runs, cause);
            }
        }
        id
    }

    /// Remembers that the suspect with jitter seed `identity` (its
    /// [`DeliveryFacts::identity`]) went back to the isolation queue without crashing its
    /// consumer: its connection dropped while it ran, and the process saw the drop. Its next
    /// redelivery from the isolation queue is then not counted as a crash. The engine does
    /// this itself for suspects it requeues; the last 1,024 identities are kept.
    pub fn excuse(&mut self, identity: u64) {
        if self.excused.len() == EXCUSED_CAPACITY {
            self.excused.pop_front();
        }
        self.excused.push_back(identity);
    }

    fn take_excuse(&mut self, identity: u64) -> bool {
        match self.excused.iter().position(|i| *i == identity) {
            Some(at) => {
                self.excused.remove(at);
                true
            }
            None => false,
        }
    }

    /// The handler's outcome for a delivery the engine asked to run.
    pub fn handle_outcome(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        outcome: Outcome,
    ) -> Result<(), EngineError> {
        let live = self.get(id)?;
        if !matches!(live.phase, Phase::Running) {
            return Err(EngineError::UnexpectedOutcome(id));
        }
        let (mut state, lane) = (live.state, live.lane);
        let decision = decide(&self.policy, &state, &outcome, now);
        if outcome != Outcome::Success && state.first_failure.is_none() {
            state.first_failure = Some(now);
        }
        self.execute(
            now,
            id,
            lane,
            state,
            decision,
            state.attempt,
            recorded_cause(&outcome),
        );
        Ok(())
    }

    /// The broker's answer to the publish the engine asked for. Only a positive confirm lets
    /// the original be acknowledged. Anything else publishes the clone again after the
    /// policy's publish-retry wait; once those retries are spent, the original is requeued.
    pub fn handle_confirm(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        confirm: Confirm,
    ) -> Result<(), EngineError> {
        let retries = self.policy.publish_retries();
        let policy = &self.policy;
        let live = Self::live_mut(&mut self.slots, id)?;
        let Phase::Confirming { terminal } = live.phase else {
            return Err(EngineError::UnexpectedConfirm(id));
        };
        if confirm != Confirm::Ack && live.publish_retries < retries {
            live.publish_retries += 1;
            live.phase = Phase::Republishing { terminal };
            let wait = policy.publish_retry_wait(live.publish_retries);
            self.timers.push((now + wait, id));
            return Ok(());
        }
        let (lane, identity) = (live.lane, live.state.identity);
        if confirm == Confirm::Ack {
            self.settle(id, Settlement::Ack, terminal);
            return Ok(());
        }
        if lane == Lane::Isolation {
            // Requeued, it comes back redelivered from the isolation queue: not a crash.
            self.excuse(identity);
        }
        self.settle(
            id,
            Settlement::Requeue,
            Terminal::Requeued { cause: confirm },
        );
        Ok(())
    }

    /// Fires the in-process waits (immediate retries, publish retries) that are due at
    /// `now`. Safe to call at any time; nothing happens before a wait is due.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let mut i = 0;
        while i < self.timers.len() {
            let (until, id) = self.timers[i];
            if until > now {
                i += 1;
                continue;
            }
            self.timers.swap_remove(i);
            let Ok(live) = self.get_mut(id) else { continue };
            let action = match live.phase {
                Phase::Waiting => {
                    live.phase = Phase::Running;
                    Action::RunHandler {
                        delivery: id,
                        attempt: live.state.attempt,
                    }
                }
                Phase::Republishing { terminal } => {
                    live.phase = Phase::Confirming { terminal };
                    Action::Publish {
                        delivery: id,
                        publish: live.publish.clone().expect("a republished clone is kept"),
                    }
                }
                Phase::Running | Phase::Confirming { .. } => continue,
            };
            self.actions.push_back(action);
        }
    }

    /// The next action, after firing the waits that are due at `now`. Call it after every
    /// `handle_*` call and whenever [`poll_timeout`](Self::poll_timeout)'s wait has passed,
    /// until it returns `None`.
    pub fn poll_action(&mut self, now: Timestamp) -> Option<Action> {
        if !self.timers.is_empty() {
            self.handle_timeout(now);
        }
        self.actions.pop_front()
    }

    /// How long from `now` until the next in-process wait ends (zero if one is due), or
    /// `None` when nothing waits. The driver sleeps that long, then polls again.
    pub fn poll_timeout(&self, now: Timestamp) -> Option<Duration> {
        self.timers
            .iter()
            .map(|(until, _)| *until)
            .min()
            .map(|until| until.saturating_duration_since(now))
    }

    /// Drops a delivery without settling it, for shutdown: the broker keeps it and
    /// redelivers it. Its queued actions are discarded. Returns whether it was in flight.
    pub fn forget(&mut self, id: DeliveryId) -> bool {
        if self.get(id).is_err() {
            return false;
        }
        self.actions.retain(|a| action_delivery(a) != id);
        self.timers.retain(|(_, t)| *t != id);
        self.release(id);
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        lane: Lane,
        mut state: AttemptState,
        decision: Decision,
        runs: u32,
        last_error: Option<String>,
    ) {
        // A failure or a crash is dated now; an isolated suspect keeps its dates.
        let failed = |reason, delay| EngineHeaders {
            attempts: runs,
            crashes: state.crashes,
            first_failure: Some(state.first_failure.unwrap_or(now)),
            last_failure: Some(now),
            last_error: last_error.clone(),
            reason,
            delay,
        };
        let (route, expiration, headers, terminal) = match decision {
            Decision::Ack => {
                let terminal = Terminal::Handled {
                    attempt: state.attempt,
                };
                return self.settle(id, Settlement::Ack, terminal);
            }
            Decision::Drop { reason } => {
                return self.settle(id, Settlement::Ack, Terminal::Dropped { reason });
            }
            Decision::RetryInProcess { wait } => {
                state.attempt = state.attempt.saturating_add(1);
                if wait.is_zero() {
                    self.set(id, Live::new(state, Phase::Running, lane));
                    self.actions.push_back(Action::RunHandler {
                        delivery: id,
                        attempt: state.attempt,
                    });
                } else {
                    self.set(id, Live::new(state, Phase::Waiting, lane));
                    self.timers.push((now + wait, id));
                }
                return;
            }
            Decision::Retry { delay } => {
                let (route, expiration) = self.delay_route(delay);
                let terminal = Terminal::Retried {
                    attempts: runs,
                    delay,
                };
                (route, expiration, failed(None, Some(delay)), terminal)
            }
            Decision::Isolate => {
                let headers = EngineHeaders {
                    attempts: runs,
                    crashes: state.crashes,
                    first_failure: None,
                    last_failure: None,
                    last_error: None,
                    reason: None,
                    delay: None,
                };
                let route = self.plan.isolation_route().clone();
                (route, None, headers, Terminal::Isolated)
            }
            Decision::Divert { delay } => {
                let route = match self.plan.crash_route() {
                    Some((level, route)) if level == delay => route.clone(),
                    _ => self.plan.isolation_route().clone(),
                };
                let terminal = Terminal::Diverted {
                    crashes: state.crashes,
                    delay,
                };
                let delay = (!delay.is_zero()).then_some(delay);
                (route, None, failed(None, delay), terminal)
            }
            Decision::DeadLetter { reason } => {
                let route = self.plan.parking_route().clone();
                (
                    route,
                    None,
                    failed(Some(reason), None),
                    Terminal::DeadLettered { reason },
                )
            }
        };
        let publish = Publish {
            route,
            expiration,
            headers,
        };
        let mut live = Live::new(state, Phase::Confirming { terminal }, lane);
        if self.policy.publish_retries() > 0 {
            live.publish = Some(publish.clone());
        }
        self.set(id, live);
        self.actions.push_back(Action::Publish {
            delivery: id,
            publish,
        });
    }

    fn delay_route(&self, delay: Duration) -> (Route, Option<Duration>) {
        // `new` checked that the plan has every level the policy can ask for, and decisions
        // only produce delays within the policy's levels.
        let (route, expiration) = self
            .plan
            .route_for(delay)
            .expect("Engine::new verified the plan has the policy's delay levels");
        (route.clone(), expiration)
    }

    fn settle(&mut self, id: DeliveryId, settlement: Settlement, terminal: Terminal) {
        self.release(id);
        self.actions.push_back(Action::Settle {
            delivery: id,
            settlement,
            terminal,
        });
    }

    fn allocate(&mut self) -> DeliveryId {
        self.in_flight += 1;
        match self.free.pop() {
            Some(index) => {
                let slot = &mut self.slots[index as usize];
                DeliveryId::new(index, slot.generation)
            }
            None => {
                let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 in flight");
                self.slots.push(Slot {
                    generation: 0,
                    live: None,
                });
                DeliveryId::new(index, 0)
            }
        }
    }

    fn release(&mut self, id: DeliveryId) {
        let slot = &mut self.slots[id.index()];
        slot.live = None;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id.index() as u32);
        self.in_flight -= 1;
    }

    fn set(&mut self, id: DeliveryId, live: Live) {
        self.slots[id.index()].live = Some(live);
    }

    fn get(&self, id: DeliveryId) -> Result<&Live, EngineError> {
        self.slots
            .get(id.index())
            .filter(|s| s.generation == id.generation())
            .and_then(|s| s.live.as_ref())
            .ok_or(EngineError::UnknownDelivery(id))
    }

    fn get_mut(&mut self, id: DeliveryId) -> Result<&mut Live, EngineError> {
        Self::live_mut(&mut self.slots, id)
    }

    fn live_mut(slots: &mut [Slot], id: DeliveryId) -> Result<&mut Live, EngineError> {
        slots
            .get_mut(id.index())
            .filter(|s| s.generation == id.generation())
            .and_then(|s| s.live.as_mut())
            .ok_or(EngineError::UnknownDelivery(id))
    }
}

impl Live {
    fn new(state: AttemptState, phase: Phase, lane: Lane) -> Self {
        Live {
            state,
            phase,
            lane,
            publish: None,
            publish_retries: 0,
        }
    }
}

fn action_delivery(a: &Action) -> DeliveryId {
    match a {
        Action::RunHandler { delivery, .. }
        | Action::Publish { delivery, .. }
        | Action::Settle { delivery, .. } => *delivery,
    }
}
