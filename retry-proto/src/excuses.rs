//! `Excuses`: the suspects a process knows went back to the isolation queue through no
//! crash of their own.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

/// How many excuses are remembered; the oldest are forgotten first.
const CAPACITY: usize = 1024;

/// The suspects that went back to the isolation queue redelivered through no crash of their
/// own, as seen by this process: a suspect whose connection dropped while it ran, or that
/// was requeued because its clone could not be published. Each is keyed by its
/// [`DeliveryFacts::excuse_key`](crate::DeliveryFacts::excuse_key), the token of that very
/// copy, and used once: its next redelivery from the isolation queue is not a crash.
///
/// Any consumer of the process may fetch the suspect next, so the engines of one process
/// share their excuses: each `retry_core::Consumer` uses those of its
/// `retry_core::SoloGate`, and an embedder running several engines shares one with
/// [`Engine::with_excuses`](crate::Engine::with_excuses). The last 1,024 are kept.
///
/// ```
/// use retry_proto::Excuses;
///
/// let shared = Excuses::new();
/// let other_engine = shared.clone();
/// shared.add(42);
/// assert!(other_engine.take(42));
/// assert!(!shared.take(42), "an excuse is used once");
/// ```
#[derive(Clone, Debug, Default)]
pub struct Excuses(Arc<Mutex<Kept>>);

#[derive(Debug, Default)]
struct Kept {
    keys: VecDeque<u64>,
    /// Per isolation queue, fetches lost in flight whose message has not come back yet.
    lost: Vec<(String, usize)>,
}

impl Excuses {
    /// None yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Excuses the suspect copy keyed `key`.
    pub fn add(&self, key: u64) {
        let keys = &mut self.lock().keys;
        if keys.len() == CAPACITY {
            keys.pop_front();
        }
        keys.push_back(key);
    }

    /// Uses the excuse of the copy keyed `key`, if there is one.
    pub fn take(&self, key: u64) -> bool {
        let keys = &mut self.lock().keys;
        match keys.iter().position(|k| *k == key) {
            Some(at) => {
                keys.remove(at);
                true
            }
            None => false,
        }
    }

    /// A fetch from `queue` was lost in flight
    /// (`retry_core::TransportError::FetchLost`): the message it
    /// carried, whichever it was, comes back redelivered. The next suspect fetched from
    /// `queue` that shows a crash and has no excuse of its own uses this one. At most 1,024
    /// are kept per queue.
    ///
    /// ```
    /// use retry_proto::Excuses;
    ///
    /// let excuses = Excuses::new();
    /// excuses.add_lost_fetch("comments.suspect");
    /// assert!(!excuses.take_lost_fetch("orders.suspect"));
    /// assert!(excuses.take_lost_fetch("comments.suspect"));
    /// assert!(!excuses.take_lost_fetch("comments.suspect"), "used once");
    /// ```
    pub fn add_lost_fetch(&self, queue: &str) {
        let lost = &mut self.lock().lost;
        match lost.iter_mut().find(|(q, _)| q == queue) {
            Some((_, n)) => *n = (*n + 1).min(CAPACITY),
            None => lost.push((queue.to_owned(), 1)),
        }
    }

    /// Uses an excuse of a fetch from `queue` lost in flight, if there is one.
    pub fn take_lost_fetch(&self, queue: &str) -> bool {
        let lost = &mut self.lock().lost;
        let Some(at) = lost.iter().position(|(q, _)| q == queue) else {
            return false;
        };
        lost[at].1 -= 1;
        if lost[at].1 == 0 {
            lost.swap_remove(at);
        }
        true
    }

    /// Whether no excuse is waiting to be used.
    pub fn is_empty(&self) -> bool {
        let kept = self.lock();
        kept.keys.is_empty() && kept.lost.is_empty()
    }

    fn lock(&self) -> MutexGuard<'_, Kept> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
