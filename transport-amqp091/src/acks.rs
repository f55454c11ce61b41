//! Batched acknowledgements.
//!
//! A `basic.ack` with `multiple` settles every unacknowledged delivery up to its tag, so it
//! is only safe for a prefix of tags that are all done. The batcher tracks every delivery of
//! the current channel incarnation (epoch) and, when it flushes, acks the longest finished
//! prefix with one `multiple` ack and any other finished deliveries one by one.
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

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use retry_core::TransportError;
use tracing::warn;

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
    batch: usize,
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

    /// Flush once this many deliveries are done (half the prefetch window).
    pub(crate) fn set_batch(&self, batch: usize) {
        self.lock().batch = batch.max(1);
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

    /// A delivery is done and may be acked. Returns whether the batch is full, or `None` if
    /// the delivery is stale or already settled.
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
        Some(s.done >= s.batch)
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
#[derive(Default)]
pub(crate) struct Acks {
    batcher: AckBatcher,
    wire: tokio::sync::Mutex<()>,
}

/// How to settle a delivery other than by a (batched) ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Requeue,
    Reject,
}

impl Acks {
    pub(crate) fn set_batch(&self, batch: usize) {
        self.batcher.set_batch(batch);
    }

    pub(crate) fn received(&self, tag: u64, acker: Acker) -> u64 {
        self.batcher.received(tag, acker)
    }

    pub(crate) fn has_done(&self) -> bool {
        self.batcher.has_done()
    }

    /// Marks a delivery done, sending the batch if it is full. `false` if it was stale.
    /// Marking needs no ordering; only taking and sending do, so the wire lock is taken only
    /// when there is a batch to send. A batch that could not be sent is logged: its
    /// deliveries go back to the broker with the channel.
    pub(crate) async fn done(&self, epoch: u64, tag: u64) -> bool {
        match self.batcher.done(epoch, tag) {
            Some(true) => {
                let _ = self.flush().await;
                true
            }
            Some(false) => true,
            None => false,
        }
    }

    /// Requeues or rejects a delivery at once. `Ok(false)` if it was stale.
    pub(crate) async fn refuse(
        &self,
        epoch: u64,
        tag: u64,
        how: Refusal,
    ) -> Result<bool, lapin::Error> {
        let _wire = self.wire.lock().await;
        let Some(acker) = self.batcher.remove(epoch, tag) else {
            return Ok(false);
        };
        match how {
            Refusal::Requeue => {
                acker
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await
            }
            Refusal::Reject => acker.reject(BasicRejectOptions { requeue: false }).await,
        }
    }

    /// Sends every finished delivery's ack now, and returns once they are written. An error
    /// says how many acks could not be sent: their channel is gone, and the broker
    /// redelivers those deliveries.
    pub(crate) async fn flush(&self) -> Result<(), TransportError> {
        let _wire = self.wire.lock().await;
        send(self.batcher.flush()).await
    }
}

async fn send(acks: Vec<PendingAck>) -> Result<(), TransportError> {
    let mut unsent = 0;
    let mut last_error = None;
    for (tag, acker, multiple) in acks {
        match acker.ack(BasicAckOptions { multiple }).await {
            Ok(true) => {}
            // The channel died since: the broker redelivers these.
            Ok(false) => {
                unsent += 1;
                warn!(tag, multiple, "ack not sent: its channel is gone");
            }
            Err(e) => {
                unsent += 1;
                warn!(tag, multiple, error = %e, "ack failed; the broker will redeliver");
                last_error = Some(e.to_string());
            }
        }
    }
    match unsent {
        0 => Ok(()),
        n => Err(TransportError::Connection(format!(
            "{n} acknowledgement(s) not sent, their channel is gone ({}); the broker redelivers those deliveries",
            last_error.as_deref().unwrap_or("closed")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::message::Delivery;

    fn acker(tag: u64) -> Acker {
        Delivery::mock(tag, "".into(), "q".into(), false, vec![]).acker
    }

    fn shape(acks: &[PendingAck]) -> Vec<(u64, bool)> {
        acks.iter().map(|(t, _, m)| (*t, *m)).collect()
    }

    #[test]
    fn a_finished_prefix_goes_in_one_multiple_ack() {
        let b = AckBatcher::default();
        b.set_batch(3);
        for tag in 1..=5 {
            assert_eq!(b.received(tag, acker(tag)), 0);
        }
        assert_eq!(b.done(0, 2), Some(false));
        assert_eq!(b.done(0, 1), Some(false));
        // Third done: the batch is full. 1 and 2 form the prefix; 4 waits behind 3.
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
        b.set_batch(10);
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
