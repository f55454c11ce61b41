//! `Lanes`: which intake has the turn, as a state machine with no IO, beside the engine.
//!
//! The consumer takes deliveries from two intakes: the work queue's subscription, and
//! suspects fetched one at a time from the isolation queue while nothing else in the
//! process runs. `Lanes` decides when each is read, when a delivery is admitted to the
//! engine, and when the consumer is quiet; the run loop (`run.rs`) only turns its
//! [`Io`] requests into futures and feeds their results back, like quinn's endpoint driver.
//!
//! ```text
//!          suspects waiting, or another               nothing held          acks flushed
//!          consumer of the process asking
//!  Work ─────────────────────────────────▶ Draining ──────────────▶ Flushing ─────────────▶ Quiet
//!   ▲                                                                                      │ ▲
//!   │                                                      this one asked, came first, and │ │ no suspects,
//!   │                                                        every other consumer is quiet ▼ │ or limit reached
//!   └──────────────── nobody else asking, and no suspects due ──────────────────────────── Solo
//! ```
//!
//! It owns every rule that keeps crash attribution exact:
//! * A suspect is only fetched in `Solo`, and `Solo` is only left with nothing held and no
//!   fetch under way: a suspect never runs beside work, and a fetch never lands after the
//!   phase changed. A failed fetch or watch marks suspects as waiting; it never changes the
//!   phase by itself.
//! * `Solo` needs the process's [`SoloGate`](crate::SoloGate): every other consumer of the
//!   process is quiet while it lasts. A consumer leaves `Quiet` for `Work` in the same step
//!   under the gate's lock as it checks that nobody asks for the gate, so no other consumer
//!   can take the gate between that check and the work it then starts.
//! * A suspect fetched once shutdown has begun is not run: it is declined, and the engine
//!   puts a fresh copy of it back in the isolation queue, so it does not come back
//!   redelivered and get charged a crash.
//! * While storm control holds the work lane back, a delivery that arrives from a receive
//!   started before the pause waits unstarted, as the ones still with the broker do.

use std::collections::VecDeque;
use std::error::Error;
use std::time::Duration;

use tracing::{debug, info, warn};

use super::error::ConsumerError;
use super::storm::{Storm, StormControl, StormEvent};
use crate::Delivery;
use crate::Lane;
use crate::gate::GateMember;
use crate::transport::TransportError;
use crate::{Timestamp, format_delay};

/// The first wait before trying again after a lost connection; it doubles per failure.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Waits stay short so a recovered connection is used soon.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Settings the scheduler reads.
#[derive(Clone, Debug)]
pub(super) struct LaneSettings {
    pub(super) queue: String,
    pub(super) isolation: String,
    pub(super) prefetch: u16,
    pub(super) solo_runs: u32,
    pub(super) solo_time: Duration,
    pub(super) suspect_poll: Duration,
}

/// Which intake has the turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Work-queue deliveries run, up to the work limit at once.
    Work,
    /// No new work starts until everything held is settled.
    Draining,
    /// Sending the work subscription's batched acknowledgements, so that a crash during
    /// a solo run cannot send handled work back to the queue.
    Flushing,
    /// Nothing held, nothing started: waiting for the gate, or for another consumer's solo
    /// phase to end.
    Quiet,
    /// Suspects run one at a time with nothing else in the process running.
    Solo { started: Timestamp, runs: u32 },
}

/// An IO request for the run loop. Each one started is answered with the matching
/// `handle_*` call, except `Admit` and `Decline`, which hand a delivery to the engine, and
/// `Cancel` and `StopReceiving`.
#[derive(Debug)]
pub(super) enum Io<Tag> {
    /// Subscribe to the work queue, after waiting `after`; answer with
    /// [`Lanes::handle_subscribed`].
    Subscribe { after: Option<Duration> },
    /// Receive the next work delivery, after waiting `after`; answer with
    /// [`Lanes::handle_received`].
    Receive { after: Option<Duration> },
    /// Watch the isolation queue; answer with [`Lanes::handle_watch`].
    Watch,
    /// Fetch one suspect; answer with [`Lanes::handle_fetched`].
    Fetch,
    /// Send the subscription's batched acknowledgements; answer with
    /// [`Lanes::handle_flushed`].
    Flush,
    /// Hand the delivery to the engine to run; [`Lanes::handle_released`] once settled.
    Admit {
        delivery: Delivery<Tag>,
        lane: Lane,
        /// Taken while storm control was probing.
        probe: bool,
    },
    /// Hand the suspect to the engine without running it: it goes back to the isolation
    /// queue as a fresh copy. [`Lanes::handle_released`] once settled.
    Decline { delivery: Delivery<Tag> },
    /// Cancel the subscription: no more work deliveries.
    Cancel,
    /// Drop the receive and the watch under way.
    StopReceiving,
    /// Drop the watch under way.
    StopWatch,
}

/// The scheduler of one consumer's intakes.
pub(super) struct Lanes<Tag> {
    settings: LaneSettings,
    phase: Phase,
    gate: GateMember,
    storm: Option<Storm>,
    /// The isolation queue may hold suspects.
    suspects: bool,
    /// Until then the work lane keeps the turn, even with suspects waiting.
    turn_until: Option<Timestamp>,
    /// A work delivery received but not started: it starts when the work lane has the
    /// turn and room.
    deferred: Option<Delivery<Tag>>,
    /// The work queue is still read: not shut down, not failed, and its stream has not
    /// ended.
    receiving: bool,
    shutting_down: bool,
    subscribed: bool,
    subscribing: bool,
    receive_in_flight: bool,
    watching: bool,
    fetching: bool,
    flushing: bool,
    /// Deliveries admitted or declined and not yet released.
    held: usize,
    receive_backoff: Backoff,
    subscribe_backoff: Backoff,
    fetch_backoff: Backoff,
    /// A fetch timed out: the transport may hold its message, on its way, for the next
    /// fetch. The solo phase lasts until a fetch answers, so that message never waits
    /// beside running work; this is when to fetch again.
    refetch_at: Option<Timestamp>,
    /// Suspects fetched while shutting down, to put back fresh the ones this process
    /// excused (see `washing`).
    washes: u32,
    /// A suspect this process excused is back in the isolation queue: fetch before any
    /// work, whatever the turn or the solo limit.
    claim_due: bool,
    fatal: Option<ConsumerError>,
    receive_errors: u64,
    io: VecDeque<Io<Tag>>,
    events: VecDeque<StormEvent>,
    /// Runs just before a work delivery is admitted: where a test lets another thread's
    /// consumer move.
    #[cfg(test)]
    before_admit: Option<Box<dyn FnMut() + Send>>,
}

/// A doubling wait, from [`MIN_BACKOFF`] up to [`MAX_BACKOFF`].
#[derive(Debug)]
struct Backoff {
    /// The wait before the next attempt, once one failed.
    pending: Option<Duration>,
    next: Duration,
}

impl Backoff {
    fn new() -> Self {
        Backoff {
            pending: None,
            next: MIN_BACKOFF,
        }
    }

    fn failed(&mut self) -> Duration {
        let wait = self.next;
        self.pending = Some(wait);
        self.next = (self.next * 2).min(MAX_BACKOFF);
        wait
    }

    fn succeeded(&mut self) {
        self.next = MIN_BACKOFF;
    }
}

fn retryable(e: &TransportError) -> bool {
    matches!(
        e,
        TransportError::Connection { .. }
            | TransportError::Timeout { .. }
            | TransportError::FetchLost { .. }
    )
}

impl<Tag> Lanes<Tag> {
    /// A consumer starts by running the suspects left by the last one, before it takes any
    /// work: a work delivery prefetched during a solo run that crashes comes back a
    /// suspect itself.
    pub(super) fn new(
        settings: LaneSettings,
        storm: Option<StormControl>,
        gate: GateMember,
    ) -> Self {
        Lanes {
            settings,
            phase: Phase::Quiet,
            gate,
            storm: storm.map(Storm::new),
            suspects: true,
            turn_until: None,
            deferred: None,
            receiving: true,
            shutting_down: false,
            subscribed: false,
            subscribing: false,
            receive_in_flight: false,
            watching: false,
            fetching: false,
            flushing: false,
            held: 0,
            receive_backoff: Backoff::new(),
            subscribe_backoff: Backoff::new(),
            fetch_backoff: Backoff::new(),
            refetch_at: None,
            washes: 0,
            claim_due: false,
            fatal: None,
            receive_errors: 0,
            io: VecDeque::new(),
            events: VecDeque::new(),
            #[cfg(test)]
            before_admit: None,
        }
    }

    /// The next IO request. Call it after every `handle_*` call, until it returns `None`.
    pub(super) fn poll_io(&mut self, now: Timestamp) -> Option<Io<Tag>> {
        if self.io.is_empty() {
            self.advance(now);
        }
        self.io.pop_front()
    }

    /// The next change of storm control's state. Drain it after every `handle_*` call.
    pub(super) fn poll_event(&mut self) -> Option<StormEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) is due next: the end of the work
    /// lane's turn, or of a storm cool-down.
    pub(super) fn poll_timeout(&self) -> Option<Timestamp> {
        let storm = self.storm.as_ref().and_then(Storm::poll_timeout);
        [self.turn_until, storm, self.refetch_at]
            .into_iter()
            .flatten()
            .min()
    }

    /// Time has passed: ends the work lane's turn or a storm cool-down when due. Safe to
    /// call at any time.
    pub(super) fn handle_timeout(&mut self, now: Timestamp) {
        if self.turn_until.is_some_and(|t| t <= now) {
            self.turn_until = None;
        }
        if let Some(event) = self.storm.as_mut().and_then(|s| s.handle_timeout(now)) {
            self.events.push_back(event);
        }
    }

    /// The process's gate, whose changes the run loop waits on.
    pub(super) fn gate(&mut self) -> &mut GateMember {
        &mut self.gate
    }

    /// Deliveries held: admitted or declined, and not released yet.
    pub(super) fn held(&self) -> usize {
        self.held
    }

    /// Whether the consumer is done: it reads nothing more and holds nothing, and no
    /// subscribe, fetch or flush is under way or due.
    pub(super) fn finished(&self) -> bool {
        (self.shutting_down || !self.receiving)
            && self.held == 0
            && !self.fetching
            && self.refetch_at.is_none()
            && !self.claim_due
            && !self.subscribing
            && !self.flushing
            && !(self.suspects && self.washing())
    }

    /// Shutting down while the process holds excuses: suspects it knows went back to the
    /// isolation queue through no crash of their own. The next process would not know, and
    /// would charge them a crash, so they are fetched and put back fresh now (a few, within
    /// the shutdown grace): an excused one without its crash evidence, any other as it is.
    fn washing(&self) -> bool {
        self.shutting_down
            && self.fatal.is_none()
            && self.washes < self.settings.solo_runs
            && self.gate.excuses_pending()
    }

    /// Why the consumer must stop, once everything held is finished.
    pub(super) fn take_fatal(&mut self) -> Option<ConsumerError> {
        self.fatal.take()
    }

    /// Receive, subscribe, fetch and watch errors recovered from by trying again.
    pub(super) fn receive_errors(&self) -> u64 {
        self.receive_errors
    }

    /// Shutdown was requested: no more deliveries; the ones held finish. The subscription
    /// is cancelled, and what the broker had already sent it is still received and run,
    /// until its stream ends: sent back unsettled, each would come back redelivered and
    /// cost the next process a solo run. Not while storm control holds the work lane back:
    /// those stay with the broker.
    pub(super) fn handle_shutdown(&mut self) {
        self.shutting_down = true;
        if self.receiving && self.subscribed {
            self.io.push_back(Io::Cancel);
        }
        if self.receiving && self.subscribed && self.work_limit() > 0 {
            self.io.push_back(Io::StopWatch);
            self.watching = false;
            self.turn_until = None;
        } else {
            self.stop_receiving();
        }
    }

    /// The answer to [`Io::Subscribe`].
    pub(super) fn handle_subscribed(&mut self, result: Result<(), TransportError>) {
        self.subscribing = false;
        match result {
            Ok(()) => {
                self.subscribed = true;
                self.subscribe_backoff.succeeded();
                if self.receiving {
                    info!(queue = %self.settings.queue, prefetch = self.settings.prefetch, "consuming");
                } else {
                    // Shut down while it was being made.
                    self.io.push_back(Io::Cancel);
                }
            }
            Err(e) if retryable(&e) => {
                self.receive_errors += 1;
                let wait = self.subscribe_backoff.failed();
                warn!(queue = %self.settings.queue, error = &e as &dyn Error, retry_in = %format_delay(wait), "subscribing failed; trying again");
            }
            Err(source) => self.fail(ConsumerError::Consume {
                queue: self.settings.queue.clone(),
                source,
            }),
        }
    }

    /// The answer to [`Io::Receive`].
    pub(super) fn handle_received(
        &mut self,
        result: Result<Option<Delivery<Tag>>, TransportError>,
    ) {
        self.receive_in_flight = false;
        match result {
            Ok(Some(delivery)) => {
                self.receive_backoff.succeeded();
                let room = self.held < self.work_limit() && !self.gate.others_asking();
                let isolating = self.phase == Phase::Draining
                    && self.held > 0
                    && delivery.facts.crash_evidence() > 0;
                if (self.phase == Phase::Work && room) || isolating {
                    self.admit(delivery, Lane::Work);
                } else {
                    self.deferred = Some(delivery);
                }
            }
            Ok(None) => {
                info!(queue = %self.settings.queue, "the transport has no more deliveries");
                self.stop_receiving();
            }
            Err(TransportError::Closed) => {
                info!(queue = %self.settings.queue, "the transport was closed");
                self.stop_receiving();
            }
            // Shutting down, a lost subscription has sent back what it held.
            Err(_) if self.shutting_down => self.stop_receiving(),
            Err(e) if retryable(&e) => {
                self.receive_errors += 1;
                let wait = self.receive_backoff.failed();
                warn!(queue = %self.settings.queue, error = &e as &dyn Error, retry_in = %format_delay(wait), "receive failed; trying again");
            }
            Err(source) => self.fail(ConsumerError::Receive {
                queue: self.settings.queue.clone(),
                source,
            }),
        }
    }

    /// The answer to [`Io::Fetch`].
    pub(super) fn handle_fetched(
        &mut self,
        now: Timestamp,
        result: Result<Option<Delivery<Tag>>, TransportError>,
    ) {
        self.fetching = false;
        if result.is_ok() {
            self.fetch_backoff.succeeded();
            self.claim_due = false;
        }
        match result {
            Ok(Some(delivery)) => {
                if let Phase::Solo { runs, .. } = &mut self.phase {
                    *runs += 1;
                }
                if self.shutting_down || self.fatal.is_some() {
                    // Run now, it could outlast the grace and come back redelivered, to be
                    // charged a crash by the next process.
                    self.held += 1;
                    self.io.push_back(Io::Decline { delivery });
                } else {
                    self.admit(delivery, Lane::Isolation);
                }
            }
            Ok(None) => self.suspects = false,
            Err(e) if retryable(&e) => {
                // The transport may hold the message of a fetch that timed out, on its way,
                // for the next fetch: the solo phase lasts until a fetch answers, so that
                // it never waits beside running work.
                self.receive_errors += 1;
                let wait = self.fetch_backoff.failed();
                self.fetch_backoff.pending = None;
                self.refetch_at = Some(now.saturating_add(wait));
                warn!(queue = %self.settings.isolation, error = &e as &dyn Error, retry_in = %format_delay(wait), "fetching a suspect failed; fetching again before anything else runs");
            }
            Err(e) => self.isolation_error(now, e),
        }
    }

    /// The answer to [`Io::Watch`].
    pub(super) fn handle_watch(&mut self, now: Timestamp, result: Result<(), TransportError>) {
        self.watching = false;
        match result {
            Ok(()) => self.suspects = true,
            Err(e) => self.isolation_error(now, e),
        }
    }

    /// The answer to [`Io::Flush`].
    pub(super) fn handle_flushed(&mut self) {
        self.flushing = false;
    }

    /// A delivery's settlement is done (or failed); `back_in_isolation` when it left a
    /// message in the isolation queue: a suspect's clone, or a suspect put back. `excused`
    /// when that suspect went back redelivered through no crash (its settlement failed, or
    /// it was requeued) and the process holds its excuse: it is claimed again before any
    /// work runs, since a crash of that work would leave the next process to charge it.
    pub(super) fn handle_released(&mut self, back_in_isolation: bool, excused: bool) {
        self.held = self.held.saturating_sub(1);
        self.suspects |= back_in_isolation;
        self.claim_due |= excused;
    }

    /// A handler run of the work lane ended (storm control watches them): `failed` is
    /// `Some(true)` for a transient failure, `Some(false)` for a success, `None` for a
    /// permanent failure.
    pub(super) fn handle_run_ended(
        &mut self,
        now: Timestamp,
        lane: Lane,
        probe: bool,
        failed: Option<bool>,
    ) {
        if lane != Lane::Work {
            return;
        }
        if let Some(event) = self
            .storm
            .as_mut()
            .and_then(|s| s.run_ended(now, probe, failed))
        {
            self.events.push_back(event);
        }
    }

    fn fail(&mut self, fatal: ConsumerError) {
        error_once(&self.fatal, &fatal);
        self.fatal.get_or_insert(fatal);
        self.refetch_at = None;
        self.claim_due = false;
        self.stop_receiving();
    }

    /// No more work is taken: a receive or watch under way is dropped, and a delivery
    /// received but never started goes back to the broker with the connection.
    fn stop_receiving(&mut self) {
        if self.receiving {
            self.io.push_back(Io::StopReceiving);
        }
        self.receiving = false;
        self.receive_in_flight = false;
        self.watching = false;
        self.turn_until = None;
        self.deferred = None;
    }

    /// A fetch or watch of the isolation queue failed. A lost connection or a timeout
    /// leaves suspects waiting and gives the work lane a turn of the poll interval before
    /// the next look; anything else stops the consumer. Either way the phase only changes
    /// once nothing is held.
    fn isolation_error(&mut self, now: Timestamp, e: TransportError) {
        if retryable(&e) {
            self.receive_errors += 1;
            warn!(queue = %self.settings.isolation, error = &e as &dyn Error, retry_in = %format_delay(self.settings.suspect_poll), "taking suspects failed; trying again");
            self.suspects = true;
            self.turn_until = Some(now.saturating_add(self.settings.suspect_poll));
        } else {
            self.fail(ConsumerError::Isolation {
                queue: self.settings.isolation.clone(),
                source: e,
            });
        }
    }

    /// How many deliveries may be held while the work lane takes deliveries: `prefetch`,
    /// unless storm control holds it back.
    fn work_limit(&self) -> usize {
        let prefetch = self.settings.prefetch;
        self.storm
            .as_ref()
            .map_or(usize::from(prefetch), |s| s.limit(prefetch))
    }

    fn admit(&mut self, delivery: Delivery<Tag>, lane: Lane) {
        #[cfg(test)]
        if lane == Lane::Work
            && let Some(hook) = self.before_admit.as_mut()
        {
            hook();
        }
        let probe = lane == Lane::Work && self.storm.as_ref().is_some_and(Storm::probing);
        self.held += 1;
        self.io.push_back(Io::Admit {
            delivery,
            lane,
            probe,
        });
    }

    fn turn_over(&self, now: Timestamp) -> bool {
        self.turn_until.is_none_or(|t| t <= now)
    }

    /// Moves the intakes along: requests the next subscribe, receive, fetch, flush or watch
    /// that the phase calls for, and changes phase when its work is done.
    fn advance(&mut self, now: Timestamp) {
        loop {
            match self.phase {
                Phase::Work => {
                    let due = self.claim_due
                        || (self.suspects
                            && self.turn_over(now)
                            && ((self.receiving && !self.shutting_down) || self.washing()));
                    if due || self.gate.others_asking() {
                        if due {
                            self.gate.request();
                            debug!(queue = %self.settings.queue, held = self.held, "suspects waiting: draining the work lane");
                        } else {
                            debug!(queue = %self.settings.queue, held = self.held, "another consumer of the process runs suspects: draining the work lane");
                        }
                        self.phase = Phase::Draining;
                        continue;
                    }
                    if !self.receiving {
                        break;
                    }
                    if !self.subscribed {
                        if !self.subscribing && !self.shutting_down {
                            self.subscribing = true;
                            let after = self.subscribe_backoff.pending.take();
                            self.io.push_back(Io::Subscribe { after });
                        }
                        break;
                    }
                    if !self.watching && !self.suspects && !self.shutting_down {
                        self.watching = true;
                        self.io.push_back(Io::Watch);
                    }
                    if self.held >= self.work_limit() {
                        break;
                    }
                    if let Some(delivery) = self.deferred.take() {
                        self.admit(delivery, Lane::Work);
                        continue;
                    }
                    if !self.receive_in_flight {
                        self.receive_in_flight = true;
                        let after = self.receive_backoff.pending.take();
                        self.io.push_back(Io::Receive { after });
                    }
                    break;
                }
                Phase::Draining => {
                    if self.held > 0 {
                        // Redelivered deliveries still arriving are isolated meanwhile: after
                        // a crash they come first, and a handler never runs for them.
                        if self.subscribed
                            && self.receiving
                            && !self.receive_in_flight
                            && self.deferred.is_none()
                            && self.held < usize::from(self.settings.prefetch)
                        {
                            self.receive_in_flight = true;
                            let after = self.receive_backoff.pending.take();
                            self.io.push_back(Io::Receive { after });
                        }
                        break;
                    }
                    self.phase = Phase::Flushing;
                    if self.subscribed {
                        self.flushing = true;
                        self.io.push_back(Io::Flush);
                        break;
                    }
                }
                Phase::Flushing => {
                    if self.flushing {
                        break;
                    }
                    self.phase = Phase::Quiet;
                }
                Phase::Quiet => {
                    let want = self.claim_due
                        || (self.suspects
                            && self.turn_over(now)
                            && ((!self.shutting_down && self.fatal.is_none()) || self.washing()));
                    if want {
                        self.gate.request();
                        if !self.gate.try_enter() {
                            // Another consumer of the process is not quiet yet, or asked
                            // first: wait for the gate to change.
                            break;
                        }
                        info!(queue = %self.settings.queue, "running suspects alone");
                        self.phase = Phase::Solo {
                            started: now,
                            runs: 0,
                        };
                        continue;
                    }
                    self.gate.leave();
                    // Shutting down, the work lane still takes what the subscription was
                    // sent before its cancel. Leaving `Quiet` says so to the gate at once:
                    // from here on, no other consumer of the process can start a solo run.
                    if self.fatal.is_some()
                        || (self.shutting_down && !self.receiving)
                        || !self.gate.try_resume()
                    {
                        break;
                    }
                    self.phase = Phase::Work;
                }
                Phase::Solo { started, runs } => {
                    if self.held > 0 || self.fetching {
                        break;
                    }
                    if let Some(at) = self.refetch_at {
                        // Whatever the limit, and even when shutting down: a suspect the
                        // timed-out fetch took may be on its way, and is claimed now (and,
                        // shutting down, declined). A fatal error clears it.
                        if now < at {
                            break;
                        }
                        self.refetch_at = None;
                        self.fetching = true;
                        self.io.push_back(Io::Fetch);
                        break;
                    }
                    let spent = now.saturating_duration_since(started);
                    let limit_reached =
                        runs >= self.settings.solo_runs || spent >= self.settings.solo_time;
                    let washing = self.washing();
                    if self.claim_due
                        || (self.suspects
                            && self.turn_over(now)
                            && !limit_reached
                            && ((!self.shutting_down && self.fatal.is_none()) || washing))
                    {
                        self.washes += u32::from(washing);
                        self.fetching = true;
                        self.io.push_back(Io::Fetch);
                        break;
                    }
                    if self.suspects && limit_reached {
                        // The work lane gets a turn as long as the solo phase took (at
                        // least the poll interval), so a stream of suspects cannot starve it.
                        let turn = spent.max(self.settings.suspect_poll);
                        debug!(queue = %self.settings.queue, runs, spent = %format_delay(spent), "solo limit reached: the work lane takes a turn");
                        self.turn_until = Some(now.saturating_add(turn));
                    }
                    self.gate.leave();
                    self.phase = Phase::Quiet;
                }
            }
        }
        let quiet = matches!(self.phase, Phase::Quiet | Phase::Solo { .. })
            || (!self.receiving && self.held == 0);
        self.gate.set_quiet(quiet);
    }
}

fn error_once(previous: &Option<ConsumerError>, fatal: &ConsumerError) {
    if previous.is_none() {
        tracing::error!(
            error = fatal as &dyn Error,
            "finishing the deliveries held, then stopping"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BrokerSignals;
    use crate::MessageParts;
    use crate::gate::SoloGate;

    fn settings() -> LaneSettings {
        LaneSettings {
            queue: "q".into(),
            isolation: "q.suspect".into(),
            prefetch: 2,
            solo_runs: 2,
            solo_time: Duration::from_secs(5),
            suspect_poll: Duration::from_secs(5),
        }
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn delivery(tag: u32, redelivered: bool) -> Delivery<u32> {
        let parts = MessageParts {
            body: tag.to_le_bytes().to_vec(),
            ..MessageParts::default()
        };
        let signals = BrokerSignals {
            redelivered,
            delivery_count: None,
        };
        Delivery::new(tag, parts, signals)
    }

    /// Every IO request now, by kind.
    fn drain(lanes: &mut Lanes<u32>, now: Timestamp) -> Vec<String> {
        std::iter::from_fn(|| lanes.poll_io(now))
            .map(|io| match io {
                Io::Admit { delivery, lane, .. } => format!("admit {} {lane:?}", delivery.tag),
                Io::Decline { delivery } => format!("decline {}", delivery.tag),
                other => format!("{other:?}"),
            })
            .collect()
    }

    /// Lanes past their first, empty, solo phase: subscribed and receiving.
    fn working(gate: &SoloGate) -> Lanes<u32> {
        let mut lanes = Lanes::new(settings(), None, gate.join());
        assert_eq!(drain(&mut lanes, at(0)), ["Fetch"]);
        lanes.handle_fetched(at(0), Ok(None));
        assert_eq!(drain(&mut lanes, at(0)), ["Subscribe { after: None }"]);
        lanes.handle_subscribed(Ok(()));
        assert_eq!(
            drain(&mut lanes, at(0)),
            ["Watch", "Receive { after: None }"]
        );
        lanes
    }

    #[test]
    fn a_watch_error_while_a_suspect_runs_alone_leaves_the_phase_alone() {
        let gate = SoloGate::new();
        let mut lanes = working(&gate);
        // A redelivered work delivery is isolated; its clone in the isolation queue ends
        // the work lane's turn.
        lanes.handle_received(Ok(Some(delivery(1, true))));
        assert_eq!(
            drain(&mut lanes, at(0)),
            ["admit 1 Work", "Receive { after: None }"]
        );
        lanes.handle_released(true, false);
        assert_eq!(drain(&mut lanes, at(0)), ["Flush"]);
        lanes.handle_flushed();
        assert_eq!(drain(&mut lanes, at(0)), ["Fetch"]);
        lanes.handle_fetched(at(0), Ok(Some(delivery(2, false))));
        assert_eq!(drain(&mut lanes, at(0)), ["admit 2 Isolation"]);
        // The watch started while work ran fails now: nothing else may start.
        lanes.handle_watch(at(1), Err(TransportError::connection_lost("gone")));
        assert_eq!(drain(&mut lanes, at(1)), Vec::<String>::new());
        assert!(matches!(lanes.phase, Phase::Solo { .. }));
    }

    #[test]
    fn a_failed_fetch_is_tried_again_before_any_work_whatever_the_limit() {
        let gate = SoloGate::new();
        let mut lanes = Lanes::new(settings(), None, gate.join());
        assert_eq!(drain(&mut lanes, at(0)), ["Fetch"]);
        let timeout = || TransportError::Timeout {
            operation: "fetch",
            after: Duration::from_secs(1),
        };
        lanes.handle_fetched(at(10_000), Err(timeout()));
        assert_eq!(lanes.poll_timeout(), Some(at(10_100)));
        assert_eq!(drain(&mut lanes, at(10_050)), Vec::<String>::new());
        lanes.handle_timeout(at(10_100));
        assert_eq!(
            drain(&mut lanes, at(10_100)),
            ["Fetch"],
            "past the solo time"
        );
        lanes.handle_fetched(at(10_100), Err(timeout()));
        assert_eq!(lanes.poll_timeout(), Some(at(10_300)), "the wait doubles");
    }

    #[test]
    fn a_fetch_answered_after_shutdown_is_declined_and_keeps_the_run_alive() {
        let gate = SoloGate::new();
        let mut lanes = Lanes::new(settings(), None, gate.join());
        assert_eq!(drain(&mut lanes, at(0)), ["Fetch"]);
        lanes.handle_shutdown();
        assert_eq!(drain(&mut lanes, at(0)), ["StopReceiving"]);
        assert!(!lanes.finished(), "the fetch is under way");
        lanes.handle_fetched(at(1), Ok(Some(delivery(7, false))));
        assert_eq!(drain(&mut lanes, at(1)), ["decline 7"]);
        assert!(!lanes.finished());
        lanes.handle_released(true, false);
        assert_eq!(drain(&mut lanes, at(1)), Vec::<String>::new());
        assert!(lanes.finished());
    }

    #[test]
    fn a_delivery_arriving_in_a_storm_pause_waits_unstarted() {
        let gate = SoloGate::new();
        let storm = StormControl::consecutive_failures(1);
        let mut lanes = Lanes::new(settings(), Some(storm), gate.join());
        assert_eq!(drain(&mut lanes, at(0)), ["Fetch"]);
        lanes.handle_fetched(at(0), Ok(None));
        drain(&mut lanes, at(0));
        lanes.handle_subscribed(Ok(()));
        drain(&mut lanes, at(0));
        lanes.handle_received(Ok(Some(delivery(1, false))));
        assert_eq!(
            drain(&mut lanes, at(0)),
            ["admit 1 Work", "Receive { after: None }"]
        );
        // The run fails and trips the pause while a receive is under way.
        lanes.handle_run_ended(at(1), Lane::Work, false, Some(true));
        assert!(matches!(
            lanes.poll_event(),
            Some(StormEvent::Paused { .. })
        ));
        lanes.handle_released(false, false);
        lanes.handle_received(Ok(Some(delivery(2, false))));
        assert_eq!(drain(&mut lanes, at(2)), Vec::<String>::new());
        // Probing takes it first.
        lanes.handle_timeout(at(6_000));
        assert_eq!(lanes.poll_event(), Some(StormEvent::Probing));
        assert_eq!(drain(&mut lanes, at(6_000)), ["admit 2 Work"]);
    }

    #[test]
    fn another_consumer_asking_for_the_gate_drains_this_one() {
        let gate = SoloGate::new();
        let mut lanes = working(&gate);
        lanes.handle_received(Ok(Some(delivery(1, false))));
        assert_eq!(
            drain(&mut lanes, at(0)),
            ["admit 1 Work", "Receive { after: None }"]
        );
        let other = gate.join();
        other.request();
        lanes.handle_received(Ok(Some(delivery(2, false))));
        assert_eq!(drain(&mut lanes, at(0)), Vec::<String>::new(), "2 waits");
        assert!(!other.try_enter(), "1 still runs");
        lanes.handle_released(false, false);
        assert_eq!(drain(&mut lanes, at(0)), ["Flush"]);
        lanes.handle_flushed();
        drain(&mut lanes, at(0));
        assert!(other.try_enter(), "this consumer is quiet");
        other.leave();
        assert_eq!(
            drain(&mut lanes, at(0)),
            ["admit 2 Work", "Receive { after: None }"]
        );
    }

    /// Two consumers of one process, each scheduled on a thread of its own: one resumes
    /// work as the other asks for the gate. The other one's request lands just before the
    /// first admits its work delivery, the latest moment it could.
    #[test]
    fn no_consumer_on_another_thread_runs_suspects_beside_work_being_resumed() {
        use std::sync::mpsc;
        use std::sync::{Arc, Mutex};

        let gate = SoloGate::new();
        let mut a = working(&gate);
        // A third member held the gate, so `a` drained and its delivery 1 waits.
        let holder = gate.join();
        holder.request();
        a.handle_received(Ok(Some(delivery(1, false))));
        assert_eq!(drain(&mut a, at(0)), ["Flush"]);
        a.handle_flushed();
        assert_eq!(drain(&mut a, at(0)), Vec::<String>::new());
        assert!(holder.try_enter());
        holder.leave();

        // `b` starts with suspects to run: it asks for the gate and takes it if every
        // other member is quiet.
        let mut b = Lanes::<u32>::new(settings(), None, gate.join());
        let (go, went) = mpsc::channel::<()>();
        let (moved, has_moved) = mpsc::channel::<()>();
        let b_first = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&b_first);
        let other = std::thread::spawn(move || {
            went.recv().expect("a reaches its admission");
            *seen.lock().unwrap() = drain(&mut b, at(0));
            moved.send(()).expect("a waits");
            b
        });
        let mut go = Some(go);
        a.before_admit = Some(Box::new(move || {
            if let Some(go) = go.take() {
                go.send(()).expect("b waits");
                has_moved.recv().expect("b moved");
            }
        }));
        let first = std::thread::spawn(move || {
            let io = drain(&mut a, at(0));
            (a, io)
        });
        let (mut a, a_io) = first.join().unwrap();
        let mut b = other.join().unwrap();

        assert_eq!(a_io, ["admit 1 Work", "Receive { after: None }"]);
        assert_eq!(
            *b_first.lock().unwrap(),
            Vec::<String>::new(),
            "b fetched a suspect while a started work"
        );
        // Once `a`'s work is done it drains for `b`, which then runs its suspects alone.
        a.handle_released(false, false);
        assert_eq!(drain(&mut a, at(0)), ["Flush"]);
        a.handle_flushed();
        assert_eq!(drain(&mut a, at(0)), Vec::<String>::new());
        assert_eq!(drain(&mut b, at(0)), ["Fetch"]);
    }
}
