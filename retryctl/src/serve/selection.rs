//! What an operator saw and confirmed: the exact messages a replay or purge of the console
//! takes.
//!
//! A selection is made from the index when an action is asked for: the [`Key`] of every
//! kept message its filter matches (and, when the request names keys, whose key is among
//! them). The action then takes those messages and no others: a message that arrived since,
//! however well it matches, is left; one that is gone is not found. Keys name messages by
//! their bytes, never by position or id alone, since requeues reorder a queue and ids
//! repeat.
//!
//! Selections wait for their confirmation in a bounded store: at most [`KEPT`], each for
//! [`LIFETIME`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use retry_core::Timestamp;

use super::index::Key;

/// The most selections waiting for a confirmation; the oldest goes first.
pub const KEPT: usize = 64;

/// How long a selection waits for its confirmation.
pub const LIFETIME: Duration = Duration::from_secs(15 * 60);

/// The messages one action takes.
#[derive(Debug)]
pub struct Selection {
    /// Its name in forms and the API: random, so that it cannot be guessed.
    pub id: String,
    /// The work queue whose parking queue it is of.
    pub queue: String,
    /// The selection in words.
    pub description: String,
    /// The messages' keys, once for each message.
    pub keys: Vec<Key>,
    /// When the walk that read them started, and which walk it was.
    pub as_of: Option<Timestamp>,
    /// See `as_of`.
    pub generation: u64,
    /// Messages the walk read but the index did not keep: not in the selection.
    pub not_kept: u64,
    made: Instant,
}

impl Selection {
    /// A selection of `keys` on `queue`, made now.
    pub fn new(
        queue: &str,
        description: String,
        keys: Vec<Key>,
        (as_of, generation, not_kept): (Option<Timestamp>, u64, u64),
    ) -> std::io::Result<Selection> {
        Ok(Selection {
            id: super::auth::random_hex(16)?,
            queue: queue.to_owned(),
            description,
            keys,
            as_of,
            generation,
            not_kept,
            made: Instant::now(),
        })
    }

    /// How many messages it holds.
    pub fn count(&self) -> u64 {
        self.keys.len() as u64
    }
}

/// The selections waiting for a confirmation.
#[derive(Default)]
pub struct Selections {
    waiting: Mutex<VecDeque<Arc<Selection>>>,
}

impl Selections {
    /// Keeps `selection` for its confirmation, dropping what has expired by `now` and, past
    /// [`KEPT`], the oldest.
    pub fn keep(&self, selection: &Arc<Selection>, now: Instant) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.retain(|s| now.saturating_duration_since(s.made) < LIFETIME);
        if waiting.len() >= KEPT {
            waiting.pop_front();
        }
        waiting.push_back(Arc::clone(selection));
    }

    /// The selection named `id` on `queue`, unless it has expired by `now`. It stays, so
    /// that a confirmation sent twice finds it; the action finds its messages gone.
    pub fn get(&self, id: &str, queue: &str, now: Instant) -> Option<Arc<Selection>> {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting
            .iter()
            .find(|s| {
                super::auth::same(&s.id, id)
                    && s.queue == queue
                    && now.saturating_duration_since(s.made) < LIFETIME
            })
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection(queue: &str) -> Arc<Selection> {
        Arc::new(Selection::new(queue, "every message".into(), Vec::new(), (None, 1, 0)).unwrap())
    }

    #[test]
    fn a_selection_is_found_on_its_queue_until_it_expires() {
        let store = Selections::default();
        let t0 = Instant::now();
        let kept = selection("orders");
        store.keep(&kept, t0);
        assert!(store.get(&kept.id, "orders", t0).is_some());
        assert!(store.get(&kept.id, "payments", t0).is_none());
        assert!(store.get("0000", "orders", t0).is_none());
        let late = t0 + LIFETIME + Duration::from_secs(1);
        assert!(store.get(&kept.id, "orders", late).is_none());
    }

    #[test]
    fn past_the_limit_the_oldest_selection_goes() {
        let store = Selections::default();
        let t0 = Instant::now();
        let first = selection("q");
        store.keep(&first, t0);
        for _ in 0..KEPT {
            store.keep(&selection("q"), t0);
        }
        assert!(store.get(&first.id, "q", t0).is_none());
        assert_eq!(store.waiting.lock().unwrap().len(), KEPT);
    }
}
