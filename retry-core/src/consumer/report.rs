//! `RunReport`: what a consumer run did, counted.

use crate::Terminal;

/// Counts of what happened during [`Consumer::run`](super::Consumer::run).
///
/// Every received delivery ends in exactly one of `handled`, `retried`, `isolated`,
/// `diverted`, `dead_lettered`, `dropped`, `requeued` (settled on the broker),
/// `left_unsettled` (still held at shutdown) or `settle_errors` (its settlement failed; the
/// broker redelivers it).
///
/// ```
/// use retry_core::RunReport;
///
/// let report = RunReport::default();
/// assert_eq!(report.accounted(), report.received);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// Deliveries received from the transport, from both lanes.
    pub received: u64,
    /// Of those, suspects fetched from the isolation queue, each run with nothing else
    /// running.
    pub suspects: u64,
    /// Acknowledged after the handler succeeded.
    pub handled: u64,
    /// Acknowledged after a clone was confirmed on a delay route.
    pub retried: u64,
    /// Redelivered from the work queue (their consumer went away holding them), and
    /// acknowledged after a clone was confirmed in the isolation queue, without a handler
    /// run and without counting a crash.
    pub isolated: u64,
    /// Suspects that took their consumer down while running alone: acknowledged after a
    /// clone, with the crash counted, was confirmed on its way back to the isolation queue.
    pub diverted: u64,
    /// Acknowledged after a clone was confirmed in the parking queue.
    pub dead_lettered: u64,
    /// Acknowledged without a copy, as the policy allows.
    pub dropped: u64,
    /// Returned to the queue because the clone's publish did not succeed, retries included.
    pub requeued: u64,
    /// Still held when the shutdown grace ran out, left for the broker to redeliver.
    pub left_unsettled: u64,
    /// Of the `isolated`, suspects fetched once shutdown had begun (or after a fatal
    /// error): not run, but put back in the isolation queue as fresh copies, so that they
    /// do not come back redelivered and get charged a crash.
    pub declined: u64,
    /// Deliveries whose settlement failed; the broker redelivers them.
    pub settle_errors: u64,
    /// Handler runs that panicked (each counted as a transient failure).
    pub handler_panics: u64,
    /// Handler runs cancelled at the handler timeout (each counted as a transient failure).
    pub handler_timeouts: u64,
    /// Receive errors the consumer recovered from by trying again.
    pub receive_errors: u64,
    /// Times storm control paused the work lane (a failed probe pauses it again).
    pub storm_pauses: u64,
    /// Topology probes (deliveries carrying
    /// [`headers::PROBE`](crate::headers::PROBE)) acknowledged without a handler run. They
    /// are not counted in `received`.
    pub probes: u64,
}

impl RunReport {
    /// The deliveries whose fate is counted: every terminal, plus those left unsettled and
    /// those whose settlement failed. Equal to `received` once a run has returned.
    pub fn accounted(&self) -> u64 {
        self.handled
            + self.retried
            + self.isolated
            + self.diverted
            + self.dead_lettered
            + self.dropped
            + self.requeued
            + self.left_unsettled
            + self.settle_errors
    }

    pub(super) fn count(&mut self, terminal: &Terminal) {
        let counter = match terminal {
            Terminal::Handled { .. } => &mut self.handled,
            Terminal::Retried { .. } => &mut self.retried,
            Terminal::Isolated => &mut self.isolated,
            Terminal::Diverted { .. } => &mut self.diverted,
            Terminal::DeadLettered { .. } => &mut self.dead_lettered,
            Terminal::Dropped { .. } => &mut self.dropped,
            Terminal::Requeued { .. } => &mut self.requeued,
        };
        *counter += 1;
    }
}

/// Adds the counts of another run, for the total of several consumers.
///
/// ```
/// use retry_core::RunReport;
///
/// let mut total = RunReport::default();
/// let mut one = RunReport::default();
/// one.received = 2;
/// one.handled = 2;
/// total += one;
/// total += one;
/// assert_eq!((total.received, total.handled), (4, 4));
/// ```
impl std::ops::AddAssign for RunReport {
    fn add_assign(&mut self, other: RunReport) {
        let RunReport {
            received,
            suspects,
            handled,
            retried,
            isolated,
            diverted,
            dead_lettered,
            dropped,
            requeued,
            left_unsettled,
            declined,
            settle_errors,
            handler_panics,
            handler_timeouts,
            receive_errors,
            storm_pauses,
            probes,
        } = other;
        self.received += received;
        self.suspects += suspects;
        self.handled += handled;
        self.retried += retried;
        self.isolated += isolated;
        self.diverted += diverted;
        self.dead_lettered += dead_lettered;
        self.dropped += dropped;
        self.requeued += requeued;
        self.left_unsettled += left_unsettled;
        self.declined += declined;
        self.settle_errors += settle_errors;
        self.handler_panics += handler_panics;
        self.handler_timeouts += handler_timeouts;
        self.receive_errors += receive_errors;
        self.storm_pauses += storm_pauses;
        self.probes += probes;
    }
}
