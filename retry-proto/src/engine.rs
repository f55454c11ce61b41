//! `Engine`: the decision state machine in the quinn-proto style. Feed it inputs with the
//! `handle_*` methods, drain its outputs with the `poll_*` methods; it does no IO and reads no
//! clock.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use slotmap::{Key as _, KeyData, SlotMap};

use crate::decision::{
    Admission, AttemptState, CRASH_CAUSE, Decision, Lane, Outcome, admit, decide, recorded_cause,
};
use crate::excuses::Excuses;
use crate::facts::DeliveryFacts;
use crate::headers::DeadLetterReason;
use crate::headers::{EngineHeaders, Headers, Origin};
use crate::jitter::splitmix64;
use crate::message::Message;
use crate::policy::RetryPolicy;
use crate::time::{Timestamp, format_delay};
use crate::topology::{QueueType, Route, TopologyPlan};

/// The engine's handle on one delivery, from [`Engine::handle_delivery`] until the delivery
/// is settled or forgotten. A handle carries a generation, so a stale one (its delivery
/// finished, its slot reused) is refused rather than taken for another delivery.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryId(KeyData);

slotmap::new_key_type! {
    /// The slot map's own key type, kept private so the public handle is ours.
    struct Slot;
}

impl DeliveryId {
    fn slot(self) -> Slot {
        Slot::from(self.0)
    }

    fn index(self) -> u32 {
        // The low half is the slot index, the high half its generation.
        self.0.as_ffi() as u32
    }

    fn generation(self) -> u32 {
        (self.0.as_ffi() >> 32) as u32
    }
}

impl From<Slot> for DeliveryId {
    fn from(slot: Slot) -> Self {
        DeliveryId(slot.data())
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
    /// without a handler run and without counting a crash; or a suspect from the isolation
    /// queue was put back there as a fresh copy, as it came (it arrived after shutdown
    /// began, or its clone was refused).
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

impl Terminal {
    /// Whether the message's journey is over: handled, parked or dropped, with nothing of it
    /// left on the broker to come back. A retried, isolated, diverted or requeued message
    /// will be delivered again.
    ///
    /// ```
    /// use retry_proto::{DeadLetterReason, Terminal};
    /// use std::time::Duration;
    ///
    /// assert!(Terminal::DeadLettered { reason: DeadLetterReason::Permanent }.is_final());
    /// assert!(!Terminal::Retried { attempts: 1, delay: Duration::from_secs(30) }.is_final());
    /// ```
    pub fn is_final(&self) -> bool {
        matches!(
            self,
            Terminal::Handled { .. } | Terminal::DeadLettered { .. } | Terminal::Dropped { .. }
        )
    }
}

/// A short phrase for logs and tools.
///
/// ```
/// use retry_proto::{Confirm, DeadLetterReason, Terminal};
/// use std::time::Duration;
///
/// assert_eq!(Terminal::Handled { attempt: 2 }.to_string(), "handled on attempt 2");
/// let retried = Terminal::Retried { attempts: 1, delay: Duration::from_secs(30) };
/// assert_eq!(retried.to_string(), "retried in 30s");
/// let parked = Terminal::DeadLettered { reason: DeadLetterReason::CrashLoop };
/// assert_eq!(parked.to_string(), "parked (crash-loop)");
/// let requeued = Terminal::Requeued { cause: Confirm::Nack };
/// assert_eq!(requeued.to_string(), "requeued: the clone was refused");
/// ```
impl fmt::Display for Terminal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Terminal::Handled { attempt } => write!(f, "handled on attempt {attempt}"),
            Terminal::Retried { delay, .. } => write!(f, "retried in {}", format_delay(*delay)),
            Terminal::Isolated => f.write_str("redelivered: isolated, to run alone"),
            Terminal::Diverted { crashes, delay } => write!(
                f,
                "crashed its consumer running alone (crash {crashes}), back in {}",
                format_delay(*delay)
            ),
            Terminal::DeadLettered { reason } => write!(f, "parked ({reason})"),
            Terminal::Dropped { reason } => write!(f, "dropped ({reason})"),
            Terminal::Requeued { cause } => {
                let why = match cause {
                    Confirm::Ack => "confirmed",
                    Confirm::Nack => "refused",
                    Confirm::Returned => "returned as unroutable",
                    Confirm::Failed => "not confirmed",
                };
                write!(f, "requeued: the clone was {why}")
            }
        }
    }
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

impl Publish {
    /// The clone's headers: `original`'s, minus the broker's own, with where it came from
    /// recorded on a first clone, and the engine's written over (see
    /// [`clone_headers`](crate::headers::clone_headers)). Every transport builds its clones'
    /// headers here.
    ///
    /// ```
    /// use retry_proto::headers::{self, EngineHeaders};
    /// use retry_proto::{Headers, Message, MessageParts, Publish, Route};
    ///
    /// let original = Message::new(MessageParts {
    ///     queue: "comments".into(),
    ///     routing_key: "comments".into(),
    ///     headers: [("tenant", "acme")].into_iter().collect(),
    ///     ..MessageParts::default()
    /// });
    /// let publish = Publish {
    ///     route: Route { exchange: "".into(), routing_key: "comments.suspect".into() },
    ///     expiration: None,
    ///     headers: EngineHeaders {
    ///         attempts: 0, crashes: 1, first_failure: None, last_failure: None,
    ///         last_error: None, reason: None, delay: None, suspect: None,
    ///     },
    /// };
    /// let clone = publish.clone_headers(&original);
    /// assert!(clone.get("tenant").is_some());
    /// assert_eq!(clone.get(headers::ORIGIN_QUEUE).and_then(|v| v.as_str()), Some("comments"));
    /// assert_eq!(clone.get(headers::CRASHES).and_then(|v| v.as_u64()), Some(1));
    /// ```
    pub fn clone_headers(&self, original: &Message) -> Headers {
        let origin = Origin {
            queue: original.queue(),
            exchange: original.exchange(),
            routing_key: original.routing_key(),
        };
        crate::headers::clone_headers(original.headers(), origin, &self.headers)
    }
}

/// Something for the driver to do, in the order the engine emits them. `D` is the
/// caller's data for each delivery (see [`Engine`]); a settlement hands it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action<D = ()> {
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
        /// The data handed in with the delivery: the engine is done with it.
        data: D,
    },
}

/// An input the engine cannot accept: a driver bug, such as a confirm for a delivery that
/// published nothing.
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
}

/// Why [`Engine::new`] refused a policy and plan: the plan was made for another policy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanMismatch {
    /// The plan lacks a delay level the policy needs.
    #[error(
        "the topology plan for {queue:?} has no delay queue for {delay:?}, which the policy needs; make the plan from the same policy"
    )]
    MissingDelayLevel {
        /// The work queue.
        queue: String,
        /// The missing level.
        delay: Duration,
    },
    /// The policy diverts crashed suspects through a crash delay the plan has no queue for.
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
    /// The policy asks for a delay longer than the plan's cascade holds.
    #[error(
        "the topology plan for {queue:?} has a delay cascade that holds at most {max:?}, and the policy needs {delay:?}; make the plan from the same policy"
    )]
    BeyondCascade {
        /// The work queue.
        queue: String,
        /// The longest delay the policy needs.
        delay: Duration,
        /// The longest the cascade holds.
        max: Duration,
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
struct Live<D> {
    state: AttemptState,
    /// The state it arrived with, for a suspect put back as it came.
    received: AttemptState,
    phase: Phase,
    lane: Lane,
    /// The clone being published, kept for publish retries.
    publish: Option<Publish>,
    /// Publish retries spent on it.
    publish_retries: u32,
    /// What an excuse for it is keyed by: [`DeliveryFacts::excuse_key`].
    excuse_key: u64,
    /// It showed crash evidence the engine counts: a crash not recorded anywhere else.
    evidence: bool,
    /// The caller's data for the delivery.
    data: D,
}

/// SplitMix64's increment, which spaces the token seeds.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A seed no other process draws: std's per-process random hash keys, mixed with a count of
/// the engines made in this one.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static ENGINES: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(ENGINES.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// The retry state machine for one work queue.
///
/// It follows quinn-proto's contract: inputs go in through the `handle_*` methods, each
/// given the time; outputs come out of [`poll_action`](Self::poll_action), which only
/// drains; in-process waits (immediate retries, publish retries) end at the deadline
/// [`poll_timeout`](Self::poll_timeout) gives, where the driver calls
/// [`handle_timeout`](Self::handle_timeout).
///
/// `D` is the caller's data for each delivery (a broker tag, the message, a tracing
/// span): handed in with [`handle_delivery`](Self::handle_delivery), reachable with
/// [`data`](Self::data) while the delivery is in flight, and handed back by
/// [`Action::Settle`] or [`forget`](Self::forget), so a driver needs no map of its own.
///
/// ```
/// use retry_proto::{
///     Action, BrokerSignals, Confirm, DeliveryFacts, Engine, Headers, Lane, Outcome,
///     RetryPolicy, Settlement, Terminal, Timestamp, TopologyPlan,
/// };
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// // The data kept per delivery here is the broker's delivery tag.
/// let mut engine: Engine<u64> = Engine::new(policy, &plan)?;
/// let now = Timestamp::from_millis(1_000);
///
/// // A delivery arrives from the work queue: the engine asks for a handler run.
/// let facts = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), 0);
/// let id = engine.handle_delivery(now, Lane::Work, facts, 7);
/// assert!(matches!(engine.poll_action(), Some(Action::RunHandler { attempt: 1, .. })));
///
/// // It fails: publish a clone to the 30 s delay queue, and only then ack.
/// engine.handle_outcome(now, id, Outcome::Transient("db down".into()))?;
/// let Some(Action::Publish { publish, .. }) = engine.poll_action() else { panic!() };
/// assert_eq!(&*publish.route.routing_key, "comments.retry.30s");
/// assert_eq!(engine.poll_action(), None); // nothing is settled before the confirm
///
/// engine.handle_confirm(now, id, Confirm::Ack)?;
/// assert!(matches!(
///     engine.poll_action(),
///     Some(Action::Settle {
///         settlement: Settlement::Ack,
///         terminal: Terminal::Retried { .. },
///         data: 7, // the tag to ack
///         ..
///     })
/// ));
///
/// // A redelivered one is a suspect: cloned into the isolation queue, its handler not run.
/// let redelivered = BrokerSignals { redelivered: true, ..BrokerSignals::default() };
/// let facts = DeliveryFacts::decode(&Headers::new(), redelivered, 0);
/// engine.handle_delivery(now, Lane::Work, facts, 8);
/// let Some(Action::Publish { publish, .. }) = engine.poll_action() else { panic!() };
/// assert_eq!(&*publish.route.routing_key, "comments.suspect");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Engine<D = ()> {
    policy: RetryPolicy,
    plan: TopologyPlan,
    live: SlotMap<Slot, Live<D>>,
    actions: VecDeque<Action<D>>,
    timers: Vec<(Timestamp, DeliveryId)>,
    excused: Excuses,
    /// Seeds the suspect tokens; see [`with_token_seed`](Self::with_token_seed).
    token_seed: u64,
    tokens: u64,
}

impl<D> Engine<D> {
    /// An engine for `policy` over `plan`, which must have been made from the same policy:
    /// every delay level the policy can ask for, and its crash delay, need their queues.
    pub fn new(policy: RetryPolicy, plan: &TopologyPlan) -> Result<Self, PlanMismatch> {
        if let Some(cascade) = plan.cascade() {
            let longest = policy.longest_broker_delay();
            if let Some(delay) = longest.filter(|d| *d > cascade.max_delay()) {
                return Err(PlanMismatch::BeyondCascade {
                    queue: plan.work_queue().to_owned(),
                    delay,
                    max: cascade.max_delay(),
                });
            }
            return Ok(Self::unchecked(policy, plan));
        }
        for &delay in policy.delay_levels() {
            if !plan.delay_routes().iter().any(|(level, _)| *level == delay) {
                return Err(PlanMismatch::MissingDelayLevel {
                    queue: plan.work_queue().to_owned(),
                    delay,
                });
            }
        }
        if let Some(delay) = policy.crash_delay_level()
            && plan.crash_route().map(|(d, _)| d) != Some(delay)
        {
            return Err(PlanMismatch::MissingCrashDelay {
                queue: plan.work_queue().to_owned(),
                missing: format!("{}.crash.{}", plan.work_queue(), format_delay(delay)),
                delay,
            });
        }
        Ok(Self::unchecked(policy, plan))
    }

    fn unchecked(policy: RetryPolicy, plan: &TopologyPlan) -> Self {
        Engine {
            policy,
            plan: plan.clone(),
            live: SlotMap::with_key(),
            actions: VecDeque::new(),
            timers: Vec::new(),
            excused: Excuses::new(),
            token_seed: random_seed(),
            tokens: 0,
        }
    }

    /// Seeds the tokens the engine writes on the suspects it puts in the isolation queue
    /// ([`headers::SUSPECT`](crate::headers::SUSPECT)), for runs that must replay exactly.
    /// By default each engine draws its seed at random, so that tokens written by different
    /// processes never collide: a token tells one copy of a suspect from any other, even
    /// one with the same message id or body.
    pub fn with_token_seed(mut self, seed: u64) -> Self {
        self.token_seed = seed;
        self.tokens = 0;
        self
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
        self.live.len()
    }

    /// Whether the delivery, still in flight, came from the isolation queue showing a crash
    /// the engine counts (not excused): a crash recorded nowhere else until its clone is
    /// confirmed. A driver whose settlement of such a delivery fails does not excuse it
    /// when it was requeued, since its redelivery still carries that crash; the engine
    /// follows the same rule for the requeues it decides.
    pub fn counts_crash(&self, id: DeliveryId) -> Option<bool> {
        self.live.get(id.slot()).map(|live| live.evidence)
    }

    /// The data handed in with a delivery still in flight.
    pub fn data(&self, id: DeliveryId) -> Option<&D> {
        self.live.get(id.slot()).map(|live| &live.data)
    }

    /// The data handed in with a delivery still in flight, to change.
    pub fn data_mut(&mut self, id: DeliveryId) -> Option<&mut D> {
        self.live.get_mut(id.slot()).map(|live| &mut live.data)
    }

    /// A delivery arrived from `lane`; `data` is the caller's, kept until the delivery is
    /// settled or forgotten. The engine queues a handler run or, for a suspect or a crashed
    /// suspect, the publish that isolates, diverts or parks it (see [`admit`]). Call
    /// [`poll_action`](Self::poll_action) next.
    pub fn handle_delivery(
        &mut self,
        now: Timestamp,
        lane: Lane,
        facts: DeliveryFacts,
        data: D,
    ) -> DeliveryId {
        let facts = self.evidence(lane, facts);
        let admission = admit(&self.policy, lane, &facts);
        self.insert(now, lane, facts, admission, data)
    }

    /// The facts with the crash evidence the engine does not believe taken out.
    fn evidence(&mut self, lane: Lane, mut facts: DeliveryFacts) -> DeliveryFacts {
        if self.plan.queue_type() != QueueType::Quorum {
            // Only a quorum queue sets x-delivery-count; on any other, a publisher did.
            facts.x_delivery_count = 0;
        }
        if lane != Lane::Isolation || facts.crash_evidence() == 0 {
            return facts;
        }
        if self.take_excuse(facts.excuse_key()) {
            // It went back to the isolation queue through no crash of its own.
            facts.redelivered = false;
            facts.delivery_count = 0;
            facts.x_delivery_count = 0;
        } else if self.excused.take_lost_fetch(self.plan.isolation_queue()) {
            // One of its deliveries was a fetch lost in flight. A broker that counts
            // deliveries still shows the crashes before it; a bare flag cannot tell.
            facts.delivery_count = facts.delivery_count.saturating_sub(1);
            facts.x_delivery_count = facts.x_delivery_count.saturating_sub(1);
            facts.redelivered = facts.delivery_count.max(facts.x_delivery_count) > 0;
        }
        facts
    }

    /// A suspect from the isolation queue that the caller will not run (it arrived after
    /// shutdown began, so its run could outlast the shutdown grace and come back
    /// redelivered, to be charged a crash in the next process). The engine puts a fresh copy
    /// of it back in the isolation queue, with its counters as they are, and then settles
    /// the original: it ends [`Terminal::Isolated`]. A suspect that shows a crash is
    /// diverted or parked as [`handle_delivery`](Self::handle_delivery) would. Call
    /// [`poll_action`](Self::poll_action) next.
    ///
    /// ```
    /// use retry_proto::*;
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("comments", &policy)?;
    /// let mut engine: Engine<u64> = Engine::new(policy, &plan)?;
    /// let now = Timestamp::from_millis(0);
    /// let facts = DeliveryFacts::decode(&Headers::new(), BrokerSignals::default(), 0);
    /// engine.handle_declined(now, facts, 3);
    /// let Some(Action::Publish { publish, .. }) = engine.poll_action() else { panic!() };
    /// assert_eq!(&*publish.route.routing_key, "comments.suspect");
    /// assert!(publish.headers.suspect.is_some(), "a fresh token");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn handle_declined(&mut self, now: Timestamp, facts: DeliveryFacts, data: D) -> DeliveryId {
        let facts = self.evidence(Lane::Isolation, facts);
        let admission = match admit(&self.policy, Lane::Isolation, &facts) {
            Admission::Run(state) => Admission::Decided(state, Decision::Isolate),
            decided => decided,
        };
        self.insert(now, Lane::Isolation, facts, admission, data)
    }

    fn insert(
        &mut self,
        now: Timestamp,
        lane: Lane,
        facts: DeliveryFacts,
        admission: Admission,
        data: D,
    ) -> DeliveryId {
        let state = match admission {
            Admission::Run(state) | Admission::Decided(state, _) => state,
        };
        let id = DeliveryId::from(self.live.insert(Live {
            state,
            received: state,
            phase: Phase::Running,
            lane,
            publish: None,
            publish_retries: 0,
            excuse_key: facts.excuse_key(),
            evidence: lane == Lane::Isolation && facts.crash_evidence() > 0,
            data,
        }));
        match admission {
            Admission::Run(state) => {
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
                self.execute(now, id, state, decision, runs, cause);
            }
        }
        id
    }

    /// Remembers that the suspect whose [`DeliveryFacts::excuse_key`] is `key` went back to
    /// the isolation queue without crashing its consumer: its connection dropped while it
    /// ran, and the process saw the drop. Its next redelivery from the isolation queue is
    /// then not counted as a crash. The key is the suspect token the engine wrote on that
    /// copy, so another copy with the same message id or body cannot use the excuse up. The
    /// engine does this itself for suspects it requeues. See [`Excuses`].
    pub fn excuse(&mut self, key: u64) {
        self.excused.add(key);
    }

    /// Remembers that a fetch from the isolation queue was lost in flight
    /// (`retry_core::TransportError::FetchLost`): whichever message
    /// it carried comes back redelivered through no crash of its own, so the next suspect
    /// from the isolation queue that shows a crash, and has no excuse of its own, is
    /// charged one delivery fewer: with a bare redelivered flag (a classic queue), no
    /// crash; where the broker counts deliveries (a quorum queue, AMQP 1.0, NATS), the
    /// crashes before the lost fetch still count. The `retry_core::Consumer` does
    /// this itself. A message the broker hands to another process first is charged there
    /// (see the guide's known limitations); so a lost fetch can cost a poison message one
    /// more run where deliveries are not counted, never a healthy one a crash in this
    /// process.
    ///
    /// ```
    /// use retry_proto::*;
    /// use std::time::Duration;
    ///
    /// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
    /// let plan = TopologyPlan::new("comments", &policy)?;
    /// let mut engine: Engine<u64> = Engine::new(policy, &plan)?;
    /// let now = Timestamp::from_millis(0);
    /// let redelivered = BrokerSignals { redelivered: true, delivery_count: None };
    /// let suspect = || DeliveryFacts::decode(&Headers::new(), redelivered, 7);
    ///
    /// engine.excuse_lost_fetch();
    /// engine.handle_delivery(now, Lane::Isolation, suspect(), 1);
    /// assert!(matches!(engine.poll_action(), Some(Action::RunHandler { .. })), "not charged");
    ///
    /// // The excuse is used once: the next one is charged a crash, and not run.
    /// engine.handle_delivery(now, Lane::Isolation, suspect(), 2);
    /// assert!(matches!(engine.poll_action(), Some(Action::Publish { .. })));
    ///
    /// // Delivered twice, on a broker that counts: the delivery before the lost fetch was
    /// // a crash, and still counts as one.
    /// engine.excuse_lost_fetch();
    /// let counted = BrokerSignals { redelivered: true, delivery_count: Some(2) };
    /// let facts = DeliveryFacts::decode(&Headers::new(), counted, 8);
    /// engine.handle_delivery(now, Lane::Isolation, facts, 3);
    /// assert!(matches!(engine.poll_action(), Some(Action::Publish { .. })));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn excuse_lost_fetch(&mut self) {
        self.excused.add_lost_fetch(self.plan.isolation_queue());
    }

    /// Shares `excuses` with the other engines of the process (see [`Excuses`]): a suspect
    /// one of them put back can be fetched by another. By default an engine keeps its own.
    pub fn with_excuses(mut self, excuses: Excuses) -> Self {
        self.excused = excuses;
        self
    }

    fn take_excuse(&mut self, key: u64) -> bool {
        self.excused.take(key)
    }

    /// The handler's outcome for a delivery the engine asked to run. Call
    /// [`poll_action`](Self::poll_action) next.
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
        let mut state = live.state;
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
            recorded_cause(outcome),
        );
        Ok(())
    }

    /// The broker's answer to the publish the engine asked for. Only a positive confirm lets
    /// the original be acknowledged. Anything else publishes the clone again after the
    /// policy's publish-retry wait, counted from `now`; once those retries are spent, the
    /// original is requeued. Except a suspect from the isolation queue that showed no
    /// crash: requeued, it would come back redelivered, which only this process could
    /// excuse and any other would count as a crash. A fresh copy of it, as it came, is
    /// published to the isolation queue first (ending [`Terminal::Isolated`] once
    /// confirmed, like [`handle_declined`](Self::handle_declined)); only if that copy is
    /// refused too is the original requeued, and excused here. Call
    /// [`poll_action`](Self::poll_action) next.
    pub fn handle_confirm(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        confirm: Confirm,
    ) -> Result<(), EngineError> {
        let retries = self.policy.publish_retries();
        let policy = &self.policy;
        let live = self
            .live
            .get_mut(id.slot())
            .ok_or(EngineError::UnknownDelivery(id))?;
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
        let (lane, key, evidence) = (live.lane, live.excuse_key, live.evidence);
        if confirm == Confirm::Ack {
            self.settle(id, Settlement::Ack, terminal);
            return Ok(());
        }
        // A suspect that showed a crash keeps that evidence when requeued: its crash was
        // never recorded.
        if lane == Lane::Isolation && !evidence {
            if terminal != Terminal::Isolated {
                // Put back as it came: the run whose clone was refused is not counted, as a
                // requeue would not count it.
                let received = live.received;
                let runs = received.attempt.saturating_sub(1);
                self.execute(now, id, received, Decision::Isolate, runs, None);
                return Ok(());
            }
            // Its fresh copy (put back here or at shutdown) was refused. Requeued, it comes
            // back redelivered from the isolation queue: not a crash, in this process.
            self.excuse(key);
        }
        self.settle(
            id,
            Settlement::Requeue,
            Terminal::Requeued { cause: confirm },
        );
        Ok(())
    }

    /// Fires the in-process waits (immediate retries, publish retries) due at `now`. Call it
    /// once [`poll_timeout`](Self::poll_timeout)'s deadline has passed, then
    /// [`poll_action`](Self::poll_action). It is safe to call at any time: nothing happens
    /// before a wait is due.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        let mut i = 0;
        while i < self.timers.len() {
            let (until, id) = self.timers[i];
            if until > now {
                i += 1;
                continue;
            }
            self.timers.swap_remove(i);
            let Some(live) = self.live.get_mut(id.slot()) else {
                continue;
            };
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

    /// The next action, in the order the engine decided them; `None` when there is nothing
    /// to do. Call it after every `handle_*` call, until it returns `None`. It only drains:
    /// waits that have ended are fired by [`handle_timeout`](Self::handle_timeout).
    #[must_use = "an action the driver does not carry out leaves its delivery stuck"]
    pub fn poll_action(&mut self) -> Option<Action<D>> {
        self.actions.pop_front()
    }

    /// When the next in-process wait ends, or `None` when nothing waits. Call it after
    /// draining [`poll_action`](Self::poll_action); sleep until the deadline (it may be in
    /// the past), then call [`handle_timeout`](Self::handle_timeout).
    #[must_use = "a wait nobody sleeps on never ends"]
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.timers.iter().map(|(until, _)| *until).min()
    }

    /// Drops a delivery without settling it, for shutdown: the broker keeps it and
    /// redelivers it. Its queued actions are discarded. Returns its data, or `None` if it
    /// was not in flight.
    pub fn forget(&mut self, id: DeliveryId) -> Option<D> {
        let live = self.live.remove(id.slot())?;
        self.actions.retain(|a| action_delivery(a) != id);
        self.timers.retain(|(_, t)| *t != id);
        Some(live.data)
    }

    /// Forgets every delivery in flight (see [`forget`](Self::forget)), handing back each
    /// one's data.
    pub fn forget_all(&mut self) -> Vec<(DeliveryId, D)> {
        self.actions
            .retain(|a| !matches!(a, Action::RunHandler { .. } | Action::Publish { .. }));
        self.timers.clear();
        self.live
            .drain()
            .map(|(slot, live)| (DeliveryId::from(slot), live.data))
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn execute(
        &mut self,
        now: Timestamp,
        id: DeliveryId,
        mut state: AttemptState,
        decision: Decision,
        runs: u32,
        last_error: Option<String>,
    ) {
        // A failure or a crash is dated now; an isolated suspect keeps its dates. At most one
        // decision is made, so the cause moves into its headers rather than being copied.
        let failed = move |reason, delay| EngineHeaders {
            attempts: runs,
            crashes: state.crashes,
            first_failure: Some(state.first_failure.unwrap_or(now)),
            last_failure: Some(now),
            last_error,
            reason,
            delay,
            suspect: None,
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
                    self.update(id, state, Phase::Running);
                    self.actions.push_back(Action::RunHandler {
                        delivery: id,
                        attempt: state.attempt,
                    });
                } else {
                    self.update(id, state, Phase::Waiting);
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
                    suspect: Some(self.next_token()),
                };
                let route = self.plan.isolation_route().clone();
                (route, None, headers, Terminal::Isolated)
            }
            Decision::Divert { delay } => {
                let route = self.plan.divert_route(delay);
                let terminal = Terminal::Diverted {
                    crashes: state.crashes,
                    delay,
                };
                let delay = (!delay.is_zero()).then_some(delay);
                let mut headers = failed(None, delay);
                headers.suspect = Some(self.next_token());
                (route, None, headers, terminal)
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
        let keep = (self.policy.publish_retries() > 0).then(|| publish.clone());
        let live = self.update(id, state, Phase::Confirming { terminal });
        live.publish = keep;
        self.actions.push_back(Action::Publish {
            delivery: id,
            publish,
        });
    }

    /// A token for a suspect's copy: unique to this engine's seed, and at most `i64::MAX`
    /// so that it is written as a signed integer, which every broker keeps.
    fn next_token(&mut self) -> u64 {
        self.tokens += 1;
        splitmix64(
            self.token_seed
                .wrapping_add(self.tokens.wrapping_mul(GOLDEN)),
        ) & (i64::MAX as u64)
    }

    fn delay_route(&self, delay: Duration) -> (Route, Option<Duration>) {
        // `new` checked that the plan has every level the policy can ask for, and decisions
        // only produce delays within the policy's levels.
        self.plan
            .route_for(delay)
            .expect("Engine::new verified the plan has the policy's delay levels")
    }

    fn settle(&mut self, id: DeliveryId, settlement: Settlement, terminal: Terminal) {
        let live = self
            .live
            .remove(id.slot())
            .expect("only a delivery in flight is settled");
        self.actions.push_back(Action::Settle {
            delivery: id,
            settlement,
            terminal,
            data: live.data,
        });
    }

    /// Moves a delivery in flight to its next phase.
    fn update(&mut self, id: DeliveryId, state: AttemptState, phase: Phase) -> &mut Live<D> {
        let live = self
            .live
            .get_mut(id.slot())
            .expect("only a delivery in flight moves on");
        live.state = state;
        live.phase = phase;
        live.publish = None;
        live.publish_retries = 0;
        live
    }

    fn get(&self, id: DeliveryId) -> Result<&Live<D>, EngineError> {
        self.live
            .get(id.slot())
            .ok_or(EngineError::UnknownDelivery(id))
    }
}

fn action_delivery<D>(a: &Action<D>) -> DeliveryId {
    match a {
        Action::RunHandler { delivery, .. }
        | Action::Publish { delivery, .. }
        | Action::Settle { delivery, .. } => *delivery,
    }
}
