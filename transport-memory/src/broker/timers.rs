//! The virtual clock's timers: sleeps waiting for a virtual time.

use std::collections::BTreeMap;
use std::task::Waker;

use retry_core::Timestamp;

/// A timer's place: its deadline, then the order it was made in.
pub(crate) type TimerKey = (Timestamp, u64);

/// Pending sleeps, earliest first. Only [`Sleep`](crate::Sleep)s arm them; the clock fires
/// them.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    pending: BTreeMap<TimerKey, Waker>,
    made: u64,
}

impl Timers {
    /// A key for a new timer due at `deadline`; timers due at the same time fire in the
    /// order their keys were made.
    pub(crate) fn key(&mut self, deadline: Timestamp) -> TimerKey {
        self.made += 1;
        (deadline, self.made)
    }

    /// Arms timer `key` to wake `waker`, replacing the waker it had.
    pub(crate) fn arm(&mut self, key: TimerKey, waker: Waker) {
        self.pending.insert(key, waker);
    }

    /// Disarms timer `key`.
    pub(crate) fn disarm(&mut self, key: &TimerKey) {
        self.pending.remove(key);
    }

    /// The earliest deadline.
    pub(crate) fn next(&self) -> Option<Timestamp> {
        self.pending.keys().next().map(|(t, _)| *t)
    }

    /// Removes the timers due by `now`, adding their wakers to `wakes` in deadline order.
    pub(crate) fn fire_due(&mut self, now: Timestamp, wakes: &mut Vec<Waker>) {
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > now {
                break;
            }
            wakes.push(entry.remove());
        }
    }
}
