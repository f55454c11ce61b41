//! `Engine`: the decision state machine in the quinn-proto style. Feed it inputs with the
//! `handle_*` methods, drain its outputs with the `poll_*` methods; it does no IO and reads no
//! clock.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use crate::decision::{
    Admission, AttemptState, CRASH_CAUSE, DeadLetterReason, Decision, Outcome, admit, decide,
    recorded_cause,
};
use crate::facts::DeliveryFacts;
use crate::headers::EngineHeaders;
use crate::policy::{CrashAction, RetryPolicy};
use crate::time::Timestamp;
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
    /// A crashed delivery's clone was confirmed on its delay route, without a handler run.
    Diverted {
        /// Crashes so far.
        crashes: u32,
        /// The clone's delay.
        delay: Duration,
    },
    /// A clone was confirmed in the parking queue.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
    },
    /// Dropped, as the policy allows.
    Dropped {
        /// Why.
        reason: DeadLetterReason,
    },
    /// The clone's publish did not succeed; the original goes back to the queue.
    Requeued {
        /// The broker's answer.
        cause: Confirm,
    },
}

/// A clone to publish: the original's body and properties, with these headers written over
/// the original's (see [`clone_headers`](crate::headers::clone_headers)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publish {
    /// Where to.
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
        /// How.
        settlement: Settlement,
        /// Why: how the delivery ended.
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
    /// The policy runs the handler on redelivered deliveries, but the plan's queues keep no
    /// delivery count, so a message that crashes its consumer would never reach the crash
    /// limit.
    #[error(
        "on_crash = run-handler needs a broker delivery count to enforce the crash limit, but {queue:?} is a classic queue: use QueueType::Quorum or CrashAction::Divert"
    )]
    CrashLimitUnenforceable {
        /// The work queue.
        queue: String,
    },
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
}

#[derive(Clone, Copy, Debug)]
enum Phase {
    Running,
    Waiting,
    Confirming { terminal: Terminal },
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    live: Option<(AttemptState, Phase)>,
}

/// The retry state machine for one work queue.
///
/// ```
/// use retry_core::{
///     Action, BrokerSignals, Confirm, DeliveryFacts, Engine, Headers, Outcome, RetryPolicy,
///     Settlement, Terminal, Timestamp, TopologyPlan,
/// };
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// let mut engine = Engine::new(policy, &plan)?;
/// let now = Timestamp::from_millis(1_000);
///
/// // A delivery arrives: the engine asks for a handler run.
/// let facts = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), 0);
/// let id = engine.handle_delivery(now, facts);
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
}

impl Engine {
    /// An engine for `policy` over `plan`, which must have been made from the same policy.
    ///
    /// [`CrashAction::RunHandler`](crate::CrashAction::RunHandler) needs quorum queues: a
    /// redelivered message is the same message, so only the broker's delivery count can show
    /// how often it crashed its consumer.
    pub fn new(policy: RetryPolicy, plan: &TopologyPlan) -> Result<Self, EngineError> {
        let work = &plan.queues()[0];
        if policy.on_crash() == CrashAction::RunHandler
            && work.arguments.queue_type != QueueType::Quorum
        {
            return Err(EngineError::CrashLimitUnenforceable {
                queue: work.name.clone(),
            });
        }
        for delay in policy.delay_levels() {
            if !plan.delay_routes().iter().any(|(level, _)| *level == delay) {
                return Err(EngineError::MissingDelayLevel {
                    queue: plan.work_queue().to_owned(),
                    delay,
                });
            }
        }
        Ok(Engine {
            policy,
            plan: plan.clone(),
            slots: Vec::new(),
            free: Vec::new(),
            actions: VecDeque::new(),
            timers: Vec::new(),
            in_flight: 0,
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

    /// A delivery arrived. The engine queues either a handler run or, for a crashed delivery,
    /// the publish that diverts or parks it.
    pub fn handle_delivery(&mut self, now: Timestamp, facts: DeliveryFacts) -> DeliveryId {
        let id = self.allocate();
        match admit(&self.policy, &facts) {
            Admission::Run(state) => {
                self.set(id, state, Phase::Running);
                self.actions.push_back(Action::RunHandler {
                    delivery: id,
                    attempt: state.attempt,
                });
            }
            Admission::Decided(state, decision) => {
                let runs = state.attempt.saturating_sub(1);
                self.execute(now, id, state, decision, runs, Some(CRASH_CAUSE.to_owned()));
            }
        }
        id
    }

    /// The handler's outcome for a delivery the engine asked to run.
    pub fn handle_outcome(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        outcome: Outcome,
    ) -> Result<(), EngineError> {
        let (mut state, phase) = self.get(id)?;
        if !matches!(phase, Phase::Running) {
            return Err(EngineError::UnexpectedOutcome(id));
        }
        let decision = decide(&self.policy, &state, &outcome, now);
        if outcome != Outcome::Success && state.first_failure.is_none() {
            state.first_failure = Some(now);
        }
        self.execute(
            now,
            id,
            state,
            decision,
            state.attempt,
            recorded_cause(&outcome),
        );
        Ok(())
    }

    /// The broker's answer to the publish the engine asked for. Only a positive confirm lets
    /// the original be acknowledged; anything else requeues it.
    pub fn handle_confirm(
        &mut self,
        _now: Timestamp,
        id: DeliveryId,
        confirm: Confirm,
    ) -> Result<(), EngineError> {
        let (_, phase) = self.get(id)?;
        let Phase::Confirming { terminal } = phase else {
            return Err(EngineError::UnexpectedConfirm(id));
        };
        let (settlement, terminal) = match confirm {
            Confirm::Ack => (Settlement::Ack, terminal),
            other => (Settlement::Requeue, Terminal::Requeued { cause: other }),
        };
        self.settle(id, settlement, terminal);
        Ok(())
    }

    /// Fires the in-process waits that are due at `now`.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let mut i = 0;
        while i < self.timers.len() {
            let (until, id) = self.timers[i];
            if until > now {
                i += 1;
                continue;
            }
            self.timers.swap_remove(i);
            if let Ok((state, Phase::Waiting)) = self.get(id) {
                self.handle_waiting(id, state);
            }
        }
    }

    /// The next action, after firing the waits that are due at `now`.
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

    fn execute(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        mut state: AttemptState,
        decision: Decision,
        runs: u32,
        last_error: Option<String>,
    ) {
        let headers = |reason, delay| EngineHeaders {
            attempts: runs,
            crashes: state.crashes,
            first_failure: state.first_failure.unwrap_or(now),
            last_failure: now,
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
                let until = now + wait;
                self.set(id, state, Phase::Waiting);
                if wait.is_zero() {
                    self.handle_waiting(id, state);
                } else {
                    self.timers.push((until, id));
                }
                return;
            }
            Decision::Retry { delay } => {
                let (route, expiration) = self.delay_route(delay);
                let terminal = Terminal::Retried {
                    attempts: runs,
                    delay,
                };
                (route, expiration, headers(None, Some(delay)), terminal)
            }
            Decision::Divert { delay } => {
                let (route, expiration) = self.delay_route(delay);
                let terminal = Terminal::Diverted {
                    crashes: state.crashes,
                    delay,
                };
                (route, expiration, headers(None, Some(delay)), terminal)
            }
            Decision::DeadLetter { reason } => {
                let route = self.plan.parking_route().clone();
                (
                    route,
                    None,
                    headers(Some(reason), None),
                    Terminal::DeadLettered { reason },
                )
            }
        };
        self.set(id, state, Phase::Confirming { terminal });
        self.actions.push_back(Action::Publish {
            delivery: id,
            publish: Publish {
                route,
                expiration,
                headers,
            },
        });
    }

    fn handle_waiting(&mut self, id: DeliveryId, state: AttemptState) {
        self.set(id, state, Phase::Running);
        self.actions.push_back(Action::RunHandler {
            delivery: id,
            attempt: state.attempt,
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

    fn set(&mut self, id: DeliveryId, state: AttemptState, phase: Phase) {
        self.slots[id.index()].live = Some((state, phase));
    }

    fn get(&self, id: DeliveryId) -> Result<(AttemptState, Phase), EngineError> {
        self.slots
            .get(id.index())
            .filter(|s| s.generation == id.generation())
            .and_then(|s| s.live)
            .ok_or(EngineError::UnknownDelivery(id))
    }
}

fn action_delivery(a: &Action) -> DeliveryId {
    match a {
        Action::RunHandler { delivery, .. }
        | Action::Publish { delivery, .. }
        | Action::Settle { delivery, .. } => *delivery,
    }
}
