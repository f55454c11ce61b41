//! Batched acknowledgements.
//!
//! A `basic.ack` with `multiple` settles every unacknowledged delivery up to its tag, so it
//! is only safe for a prefix of tags that are all done. The batcher tracks every delivery of
//! the current channel incarnation (epoch) and, when it flushes, acks the longest finished
//! prefix with one `multiple` ack and any other finished deliveries one by one.
//!
//! When to flush: a delivery that is done but not yet acknowledged still holds a place in
//! the broker's prefetch window. When handlers finish at once, one `multiple` ack per half
//! window is cheapest for the broker and costs nothing in throughput. On the retry path most
//! of the window waits for clones' publisher confirms (milliseconds: the broker confirms a
//! persistent message after its disk sync), and finished deliveries held back for a batch
//! leave the broker nowhere to deliver into: measured on RabbitMQ 3.10 with prefetch 100, a
//! fixed half-window batch held each finished delivery about 2 ms of a 10 ms cycle. So an ack
//! is due once the finished deliveries fill half the window or are at least as many as the
//! places still free in it: about half the window when handlers are quick, at once when the
//! window is full of deliveries in progress. Settlements decided while an ack is being
//! written start no write of their own: the writer looks again when its write completes and
//! sends everything finished meanwhile in one `multiple` ack, so a burst of confirms costs
//! the broker one or two acks, not one each.
//!
//! Settlements leave in the order they are decided: a `multiple` ack sent after a later one
//! would name a tag the broker no longer knows (and close the channel), and a `multiple` ack
//! overtaking a requeue could acknowledge the message being requeued. [`Acks`] takes and
//! sends under one lock.
//!
//! lapin recovers a dropped connection by itself and restarts delivery tags at 1. Every
//! incarnation's ackers share one poison flag that lapin sets for good when the incarnation
//! ends, so an acker never sends on a newer channel; the batcher watches that flag to start a
//! new epoch, and refuses to settle a tag from an older one.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::FutureExt as _;
use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use retry_core::TransportError;
use tracing::warn;

use crate::error::connection_error;

/// One ack to send: the delivery tag, the acker to send it through, and whether it is a
/// `multiple` ack.
pub(crate) type PendingAck = (u64, Acker, bool);

struct Entry {
    acker: Acker,
    done: bool,
}

#[derive(Default)]
struct State {
    epoch: u64,
    unsettled: BTreeMap<u64, Entry>,
    done: usize,
    /// The prefetch window: how many unacknowledged deliveries the broker lets out.
    window: usize,
}

impl State {
    /// Whether the deliveries done are worth an ack now: they fill half the window, or
    /// they are at least as many as the places the deliveries in progress leave free.
    fn due(&self) -> bool {
        let free = self.window.saturating_sub(self.unsettled.len());
        self.done > 0 && (self.done >= self.window.div_ceil(2).max(1) || self.done >= free)
    }
}

#[derive(Default)]
pub(crate) struct AckBatcher {
    state: Mutex<State>,
}

impl AckBatcher {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every change is made under one lock call, so a poisoned lock holds a whole state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prefetch window the batching is sized for.
    pub(crate) fn set_window(&self, window: usize) {
        self.lock().window = window.max(1);
    }

    /// A delivery was received; returns the epoch it belongs to. If the deliveries tracked so
    /// far belong to a channel incarnation that has ended, they are dropped (the broker has
    /// them back) and a new epoch starts.
    pub(crate) fn received(&self, tag: u64, acker: Acker) -> u64 {
        let mut s = self.lock();
        let stale = s
            .unsettled
            .values()
            .next()
            .is_some_and(|e| e.acker.poisoned());
        if stale {
            s.epoch += 1;
            s.unsettled.clear();
            s.done = 0;
        }
        s.unsettled.insert(tag, Entry { acker, done: false });
        s.epoch
    }

    /// The channel was replaced by one on a new connection: every delivery tracked so far is
    /// dropped (the broker has them back) and a new epoch starts, so that none of their tags
    /// is ever settled on the new channel.
    pub(crate) fn new_epoch(&self) {
        let mut s = self.lock();
        s.epoch += 1;
        s.unsettled.clear();
        s.done = 0;
    }

    /// A delivery is done and may be acked. Returns whether an ack is due now (see
    /// [`State::due`]), or `None` if the delivery is stale or already settled.
    pub(crate) fn done(&self, epoch: u64, tag: u64) -> Option<bool> {
        let mut s = self.lock();
        if s.epoch != epoch {
            return None;
        }
        match s.unsettled.get_mut(&tag) {
            Some(e) if !e.done && !e.acker.poisoned() => e.done = true,
            _ => return None,
        }
        s.done += 1;
        Some(s.due())
    }

    /// Whether an ack is due now.
    pub(crate) fn due(&self) -> bool {
        self.lock().due()
    }

    /// A delivery is settled some other way (requeue, reject): returns its acker to send
    /// that through, or `None` if it is stale or already settled.
    pub(crate) fn remove(&self, epoch: u64, tag: u64) -> Option<Acker> {
        let mut s = self.lock();
        if s.epoch != epoch {
            return None;
        }
        match s.unsettled.get(&tag) {
            Some(e) if !e.done => s.unsettled.remove(&tag).map(|e| e.acker),
            _ => None,
        }
    }

    /// Whether anything waits to be acked.
    pub(crate) fn has_done(&self) -> bool {
        self.lock().done > 0
    }

    /// Everything done, as acks to send.
    pub(crate) fn flush(&self) -> Vec<PendingAck> {
        Self::take(&mut self.lock())
    }

    fn take(s: &mut State) -> Vec<PendingAck> {
        let mut out = Vec::new();
        if s.done == 0 {
            return out;
        }
        // The finished prefix goes in one `multiple` ack through its last acker.
        let prefix_end = s
            .unsettled
            .iter()
            .take_while(|(_, e)| e.done)
            .map(|(tag, _)| *tag)
            .last();
        if let Some(end) = prefix_end {
            let rest = s.unsettled.split_off(&(end + 1));
            let prefix = std::mem::replace(&mut s.unsettled, rest);
            s.done -= prefix.len();
            if let Some((tag, e)) = prefix.into_iter().next_back() {
                out.push((tag, e.acker, true));
            }
        }
        // Finished deliveries behind an unfinished one go one by one.
        if s.done > 0 {
            let singles: Vec<u64> = s
                .unsettled
                .iter()
                .filter(|(_, e)| e.done)
                .map(|(t, _)| *t)
                .collect();
            for tag in singles {
                if let Some(e) = s.unsettled.remove(&tag) {
                    out.push((tag, e.acker, false));
                }
            }
            s.done = 0;
        }
        out
    }
}

/// The batcher plus the lock that keeps settlements in order on the wire.
///
/// Every write under that lock is bounded by the request timeout: a write that does not
/// complete (a stalled connection takes frames it never writes, and lapin never fails them)
/// would otherwise hold the lock, and with it every later settlement of the subscription,
/// on the old connection and on any new one, for good; the broker, never acknowledged,
/// would stop delivering once the prefetch window is full. Frames already handed to lapin
/// keep their order there, so giving up waiting never reorders the wire.
pub(crate) struct Acks {
    batcher: AckBatcher,
    wire: tokio::sync::Mutex<()>,
    timeout: Duration,
}

impl Default for Acks {
    fn default() -> Self {
        Acks::new(Duration::from_secs(30))
    }
}

/// How to settle a delivery other than by a (batched) ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Requeue,
    Reject,
}

impl Acks {
    /// A batcher whose writes each take at most `timeout`.
    pub(crate) fn new(timeout: Duration) -> Self {
        Acks {
            batcher: AckBatcher::default(),
            wire: tokio::sync::Mutex::new(()),
            timeout,
        }
    }

    pub(crate) fn set_window(&self, window: usize) {
        self.batcher.set_window(window);
    }

    pub(crate) fn received(&self, tag: u64, acker: Acker) -> u64 {
        self.batcher.received(tag, acker)
    }

    pub(crate) fn new_epoch(&self) {
        self.batcher.new_epoch();
    }

    pub(crate) fn has_done(&self) -> bool {
        self.batcher.has_done()
    }

    /// Marks a delivery done, and sends the acks due unless a flush is already being
    /// written, which then sends them. `false` if it was stale. Marking needs no ordering;
    /// only taking and sending do, so the wire lock is taken only when an ack is due. A
    /// batch that could not be sent is logged: its deliveries go back to the broker with the
    /// channel.
    pub(crate) async fn done(&self, epoch: u64, tag: u64) -> bool {
        match self.batcher.done(epoch, tag) {
            Some(true) => {
                self.flush_due().await;
                true
            }
            Some(false) => true,
            None => false,
        }
    }

    /// Sends what is due, and goes on sending while more falls due during the writes. A
    /// caller that finds the wire busy leaves its ack to the writer: every writer looks
    /// again after it releases the wire, and a delivery marked after that look finds the
    /// wire free.
    async fn flush_due(&self) {
        while self.batcher.due() {
            let Ok(wire) = self.wire.try_lock() else {
                return;
            };
            let acks = self.batcher.flush();
            if acks.is_empty() {
                return;
            }
            let _ = send(acks, self.timeout).await;
            drop(wire);
        }
    }

    /// Requeues or rejects a delivery at once. `Ok(false)` if it was stale.
    pub(crate) async fn refuse(
        &self,
        epoch: u64,
        tag: u64,
        how: Refusal,
    ) -> Result<bool, TransportError> {
        let wire = self.wire.lock().await;
        let Some(acker) = self.batcher.remove(epoch, tag) else {
            return Ok(false);
        };
        let (operation, sending) = match how {
            Refusal::Requeue => (
                "basic.nack (requeue)",
                acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .boxed(),
            ),
            Refusal::Reject => (
                "basic.reject",
                acker.reject(BasicRejectOptions { requeue: false }).boxed(),
            ),
        };
        let sent = within(self.timeout, operation, sending).await;
        drop(wire);
        self.flush_due().await;
        sent
    }

    /// Sends every finished delivery's ack now, and returns once they are written. An error
    /// says how many acks could not be sent: their channel is gone, and the broker
    /// redelivers those deliveries.
    pub(crate) async fn flush(&self) -> Result<(), TransportError> {
        let wire = self.wire.lock().await;
        let sent = send(self.batcher.flush(), self.timeout).await;
        drop(wire);
        // Acks that fell due during the write found the wire busy and were left to us.
        self.flush_due().await;
        sent
    }
}

/// `sending`, a lapin settlement, within `timeout`: a timeout is a
/// [`TransportError::Timeout`] naming `operation`.
pub(crate) async fn within(
    timeout: Duration,
    operation: &'static str,
    sending: impl Future<Output = lapin::Result<bool>>,
) -> Result<bool, TransportError> {
    match tokio::time::timeout(timeout, sending).await {
        Ok(sent) => sent.map_err(connection_error),
        Err(_) => Err(TransportError::Timeout {
            operation,
            after: timeout,
        }),
    }
}

async fn send(acks: Vec<PendingAck>, timeout: Duration) -> Result<(), TransportError> {
    let mut unsent = 0;
    let mut last_error = None;
    for (tag, acker, multiple) in acks {
        match within(
            timeout,
            "basic.ack",
            acker.ack(BasicAckOptions { multiple }),
        )
        .await
        {
            Ok(true) => {}
            // The channel died since: the broker redelivers these.
            Ok(false) => {
                unsent += 1;
                warn!(tag, multiple, "ack not sent: its channel is gone");
            }
            Err(e) => {
                unsent += 1;
                warn!(
                    tag,
                    multiple,
                    error = &e as &dyn std::error::Error,
                    "ack failed; the broker will redeliver"
                );
                last_error = Some(e);
            }
        }
    }
    match unsent {
        0 => Ok(()),
        n => {
            let context = format!(
                "{n} acknowledgement(s) not sent: their channel is gone, or its connection takes no writes; the broker redelivers those deliveries"
            );
            Err(match last_error {
                Some(e) => TransportError::connection_failed(context, e),
                None => TransportError::connection_lost(context),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::Delivery;
    use std::time::Duration;

    fn acker(tag: u64) -> Acker {
        Delivery::mock(tag, "".into(), "q".into(), false, vec![]).acker
    }

    #[test]
    fn an_ack_is_due_at_once_when_the_window_is_full_of_work_in_progress() {
        let b = AckBatcher::default();
        b.set_window(4);
        for tag in 1..=4 {
            b.received(tag, acker(tag));
        }
        // Every place is taken: holding a finished delivery back stalls the broker.
        assert_eq!(b.done(0, 2), Some(true));
        assert_eq!(shape(&b.flush()), [(2, false)]);
    }

    #[test]
    fn quick_handlers_are_acked_about_half_a_window_at_a_time() {
        let b = AckBatcher::default();
        b.set_window(10);
        // Deliveries finish as they arrive: nothing is in progress, most of the window free.
        for tag in 1..=4 {
            b.received(tag, acker(tag));
            assert_eq!(b.done(0, tag), Some(false), "tag {tag}");
        }
        b.received(5, acker(5));
        assert_eq!(b.done(0, 5), Some(true), "half the window is done");
        assert_eq!(shape(&b.flush()), [(5, true)]);
    }

    #[tokio::test]
    async fn a_settlement_that_finds_an_ack_being_written_leaves_its_own_to_the_writer() {
        let acks = Acks::default();
        acks.set_window(3);
        for tag in 1..=3 {
            acks.received(tag, acker(tag));
        }
        let writing = acks.wire.try_lock().unwrap();
        for tag in [1, 2] {
            let done = tokio::time::timeout(Duration::from_secs(5), acks.done(0, tag));
            assert!(done.await.expect("a settlement waited for the wire"));
        }
        assert!(acks.has_done(), "neither wrote");
        drop(writing);
        // The writer looks again once its write is done, and takes both in one ack.
        assert!(acks.batcher.due());
        assert_eq!(shape(&acks.batcher.flush()), [(2, true)]);
    }

    fn shape(acks: &[PendingAck]) -> Vec<(u64, bool)> {
        acks.iter().map(|(t, _, m)| (*t, *m)).collect()
    }

    #[test]
    fn a_finished_prefix_goes_in_one_multiple_ack() {
        let b = AckBatcher::default();
        b.set_window(8);
        for tag in 1..=5 {
            assert_eq!(b.received(tag, acker(tag)), 0);
        }
        assert_eq!(b.done(0, 2), Some(false));
        assert_eq!(b.done(0, 1), Some(false));
        // Third done: as many done as places free. 1 and 2 form the prefix; 4 waits behind 3.
        assert_eq!(b.done(0, 4), Some(true));
        assert_eq!(shape(&b.flush()), [(2, true), (4, false)]);
        assert!(!b.has_done());
        assert_eq!(shape(&b.flush()), []);
        b.done(0, 3).unwrap();
        b.done(0, 5).unwrap();
        assert_eq!(shape(&b.flush()), [(5, true)]);
    }

    #[test]
    fn requeued_deliveries_leave_the_prefix_and_settled_ones_are_refused() {
        let b = AckBatcher::default();
        b.set_window(20);
        for tag in 1..=3 {
            b.received(tag, acker(tag));
        }
        b.done(0, 1).unwrap();
        assert!(b.remove(0, 2).is_some());
        assert!(b.remove(0, 2).is_none(), "settled twice");
        b.done(0, 3).unwrap();
        assert_eq!(shape(&b.flush()), [(3, true)]);
        assert!(b.done(0, 3).is_none(), "acked twice");
        assert!(b.done(1, 1).is_none(), "an epoch that does not exist");
    }
}
