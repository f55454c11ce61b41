//! `ReturnMatcher`: which publish a broker's `basic.return` belongs to, decided by a stamp
//! each publish carries rather than by the client library's pairing.
//!
//! AMQP 0-9-1 reports an unroutable `mandatory` publish with a `basic.return` carrying the
//! message, followed by the confirm of the same publish, and a later `basic.ack` with
//! `multiple` may confirm several publishes at once. A client library must then pair each
//! return with its publish. lapin 4.12 does not: it hands the oldest waiting return to
//! whichever confirm it completes next, and completes the confirms of a `multiple` ack in
//! hash-map order. With routable and unroutable publishes in flight together, an
//! unroutable clone can come back as a plain positive confirm, and the engine would ack
//! its original: the message would be gone.
//!
//! The matcher does the pairing itself, from two facts that hold whatever the library does
//! with the returns:
//!
//! 1. Every publish carries a stamp of its own ([`PUBLISH_ID`](crate::headers::PUBLISH_ID)),
//!    and a returned message comes back with its headers, so a return names its publish.
//! 2. A return always reaches the application attached to *some* confirm completed by the
//!    same frame as its own publish's confirm. Every publish that frame completes was
//!    registered before the frame arrived, so before the application saw any answer of it.
//!
//! So the verdict on a publish waits until every publish registered before its answer was
//! seen has been answered: by then every return that can be its own has been read. A
//! publish whose stamp came back in any return is [`Confirm::Returned`], whatever its own
//! confirm said. The wait costs at most one confirm round trip, and only while earlier
//! publishes are unanswered.
//!
//! Two rules keep the wait from misleading it:
//! * A publish whose answer never comes must not be given up on alone: its confirm could
//!   still arrive carrying another publish's return. A transport that times a confirm out
//!   closes the channel and calls [`fail_all`](ReturnMatcher::fail_all).
//! * A return that names no publish of this matcher (no stamp, or an unknown one) could be
//!   any undecided publish's: every publish registered so far and not yet decided fails,
//!   so its original is requeued (a duplicate at worst, never a loss).
//!
//! ```
//! use retry_proto::{Answer, Confirm, ReturnMatcher};
//!
//! let mut matcher = ReturnMatcher::new();
//! let routable = matcher.register();
//! let unroutable = matcher.register();
//!
//! // The broker returned `unroutable` and then acked both with one `multiple` ack; the
//! // library handed the return to `routable`'s confirm and a plain ack to the other.
//! matcher.answer(unroutable, Answer::Ack, None);
//! assert_eq!(matcher.poll_verdict(), None, "`routable` is not answered yet: wait");
//! matcher.answer(routable, Answer::Ack, Some(Some(unroutable)));
//! let mut verdicts: Vec<_> = std::iter::from_fn(|| matcher.poll_verdict()).collect();
//! verdicts.sort_by_key(|(stamp, _)| *stamp);
//! assert_eq!(verdicts, [(routable, Confirm::Ack), (unroutable, Confirm::Returned)]);
//! assert_eq!(matcher.poll_verdict(), None);
//! ```

use std::collections::{BTreeSet, VecDeque};

use crate::engine::Confirm;
use crate::headers::{self, HeaderValue, Headers};

/// A client library's answer to one publish, before the matcher's pairing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Answer {
    /// A positive confirm.
    Ack,
    /// A negative confirm.
    Nack,
    /// No confirm: the channel or connection failed.
    Failed,
}

/// An answered publish waiting for the publishes registered before its answer.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    answer: Answer,
    /// Every publish registered below this must be answered first.
    watermark: u64,
}

/// Pairs publisher confirms with `basic.return`s by the stamp each publish carries; see
/// the [module docs](self) for why and how. One matcher per publishing channel: stamps are
/// only compared within it.
///
/// Sans-IO, like the [`Engine`](crate::Engine): [`register`](Self::register) before each
/// publish, [`answer`](Self::answer) with what the library said about it, and drain
/// [`poll_verdict`](Self::poll_verdict) after every `answer` and [`fail_all`](Self::fail_all).
#[derive(Debug, Default)]
pub struct ReturnMatcher {
    /// The next stamp to hand out.
    next: u64,
    /// Registered and not answered yet.
    unanswered: BTreeSet<u64>,
    /// Answered, verdict not given yet, in the order of their answers, so by watermark:
    /// those whose wait is over are always a prefix, and deciding never looks past it
    /// (a scan of them all made every answer cost as much as the publishes in flight).
    waiting: VecDeque<(u64, Waiting)>,
    /// The stamps of `waiting`.
    waiting_stamps: BTreeSet<u64>,
    /// Undecided publishes some return named.
    returned: BTreeSet<u64>,
    /// Undecided publishes below this fail: a return named none of ours.
    fail_below: u64,
    verdicts: VecDeque<(u64, Confirm)>,
    stray: u64,
}

impl ReturnMatcher {
    /// A matcher with nothing in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a publish about to be sent and returns its stamp, to be written into its
    /// [`PUBLISH_ID`](crate::headers::PUBLISH_ID) header (see [`stamp_headers`]). Call it
    /// before the publish leaves, so that it is counted as in flight before any answer
    /// that can involve it.
    pub fn register(&mut self) -> u64 {
        let stamp = self.next;
        self.next += 1;
        self.unanswered.insert(stamp);
        stamp
    }

    /// What the library answered for the publish `stamp`: its confirm, and the return the
    /// library attached to it, if any: `Some(Some(s))` for a return stamped `s` (read with
    /// [`stamp_of`]; it may be another publish's), `Some(None)` for one whose stamp could
    /// not be read. An answer for a stamp not in flight is ignored.
    pub fn answer(&mut self, stamp: u64, answer: Answer, returned: Option<Option<u64>>) {
        if !self.unanswered.contains(&stamp) {
            return;
        }
        match returned {
            Some(Some(owner)) if self.undecided(owner) => {
                self.returned.insert(owner);
            }
            // A return we cannot place could be any undecided publish's.
            Some(_) => {
                self.stray += 1;
                self.fail_below = self.next;
            }
            None => {}
        }
        self.unanswered.remove(&stamp);
        let watermark = self.next;
        self.waiting
            .push_back((stamp, Waiting { answer, watermark }));
        self.waiting_stamps.insert(stamp);
        self.decide();
    }

    /// The channel failed: every publish in flight gets [`Confirm::Failed`], answered or
    /// not. Call it when the channel closes, and when a confirm is given up on (after
    /// closing the channel, so that no late confirm can carry a return).
    pub fn fail_all(&mut self) {
        let unanswered = std::mem::take(&mut self.unanswered);
        self.waiting.clear();
        let waiting = std::mem::take(&mut self.waiting_stamps);
        let mut failed: Vec<u64> = unanswered.into_iter().chain(waiting).collect();
        failed.sort_unstable();
        self.verdicts
            .extend(failed.into_iter().map(|s| (s, Confirm::Failed)));
        self.returned.clear();
    }

    /// The next final verdict, `(stamp, confirm)`: [`Confirm::Returned`] for a publish any
    /// return named, otherwise its own answer. Drain it after every
    /// [`answer`](Self::answer) and [`fail_all`](Self::fail_all).
    pub fn poll_verdict(&mut self) -> Option<(u64, Confirm)> {
        self.verdicts.pop_front()
    }

    /// Publishes registered and not yet given a verdict.
    pub fn in_flight(&self) -> usize {
        self.unanswered.len() + self.waiting.len()
    }

    /// Returns that named no publish in flight, so that every undecided publish failed.
    pub fn stray_returns(&self) -> u64 {
        self.stray
    }

    fn undecided(&self, stamp: u64) -> bool {
        self.unanswered.contains(&stamp) || self.waiting_stamps.contains(&stamp)
    }

    /// Gives the verdict of every waiting publish whose earlier publishes are all answered.
    fn decide(&mut self) {
        let lowest_unanswered = self.unanswered.first().copied().unwrap_or(self.next);
        let ready = self
            .waiting
            .iter()
            .take_while(|(_, w)| w.watermark <= lowest_unanswered)
            .count();
        let first = self.verdicts.len();
        for (stamp, waiting) in self.waiting.drain(..ready) {
            self.waiting_stamps.remove(&stamp);
            let confirm = if self.returned.remove(&stamp) {
                Confirm::Returned
            } else if stamp < self.fail_below {
                Confirm::Failed
            } else {
                match waiting.answer {
                    Answer::Ack => Confirm::Ack,
                    Answer::Nack => Confirm::Nack,
                    Answer::Failed => Confirm::Failed,
                }
            };
            self.verdicts.push_back((stamp, confirm));
        }
        // In stamp order, as they were given when every waiting publish was looked at.
        if ready > 1 {
            self.verdicts.make_contiguous()[first..].sort_unstable_by_key(|(stamp, _)| *stamp);
        }
    }
}

/// Writes `stamp` into `headers` as the [`PUBLISH_ID`](crate::headers::PUBLISH_ID) header.
pub fn stamp_headers(headers: &mut Headers, stamp: u64) {
    headers.insert(
        headers::PUBLISH_ID,
        HeaderValue::Int(i64::try_from(stamp).unwrap_or(i64::MAX)),
    );
}

/// The stamp a returned message carries, or `None` when it has none that reads as one.
pub fn stamp_of(headers: &Headers) -> Option<u64> {
    headers
        .get(headers::PUBLISH_ID)
        .and_then(HeaderValue::as_u64)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn drain(m: &mut ReturnMatcher) -> Vec<(u64, Confirm)> {
        let mut out: Vec<_> = std::iter::from_fn(|| m.poll_verdict()).collect();
        out.sort_by_key(|(s, _)| *s);
        out
    }

    #[test]
    fn a_lone_publish_is_decided_by_its_own_answer() {
        let mut m = ReturnMatcher::new();
        for (answer, expected) in [
            (Answer::Ack, Confirm::Ack),
            (Answer::Nack, Confirm::Nack),
            (Answer::Failed, Confirm::Failed),
        ] {
            let s = m.register();
            m.answer(s, answer, None);
            assert_eq!(drain(&mut m), [(s, expected)]);
        }
        let s = m.register();
        m.answer(s, Answer::Ack, Some(Some(s)));
        assert_eq!(drain(&mut m), [(s, Confirm::Returned)]);
        assert_eq!(m.in_flight(), 0);
    }

    #[test]
    fn a_verdict_waits_for_every_publish_registered_before_its_answer() {
        let mut m = ReturnMatcher::new();
        let a = m.register();
        let b = m.register();
        m.answer(b, Answer::Ack, None);
        assert_eq!(drain(&mut m), [], "a could still carry b's return");
        // Registered after b's answer: b does not wait for it, but a, answered after it
        // was registered, does.
        let c = m.register();
        m.answer(a, Answer::Ack, Some(Some(b)));
        assert_eq!(drain(&mut m), [(b, Confirm::Returned)]);
        assert_eq!(m.in_flight(), 2);
        m.answer(c, Answer::Ack, None);
        assert_eq!(drain(&mut m), [(a, Confirm::Ack), (c, Confirm::Ack)]);
    }

    #[test]
    fn a_return_that_names_no_publish_in_flight_fails_every_undecided_one() {
        let mut m = ReturnMatcher::new();
        let a = m.register();
        let b = m.register();
        m.answer(a, Answer::Ack, Some(None));
        m.answer(b, Answer::Ack, None);
        assert_eq!(drain(&mut m), [(a, Confirm::Failed), (b, Confirm::Failed)]);
        let c = m.register();
        m.answer(c, Answer::Ack, Some(Some(999)));
        assert_eq!(drain(&mut m), [(c, Confirm::Failed)]);
        // Publishes registered afterwards are not affected.
        let d = m.register();
        m.answer(d, Answer::Ack, None);
        assert_eq!(drain(&mut m), [(d, Confirm::Ack)]);
        assert_eq!(m.stray_returns(), 2);
    }

    #[test]
    fn fail_all_fails_every_publish_in_flight_and_late_answers_are_ignored() {
        let mut m = ReturnMatcher::new();
        let a = m.register();
        let b = m.register();
        m.answer(b, Answer::Ack, None);
        m.fail_all();
        assert_eq!(drain(&mut m), [(a, Confirm::Failed), (b, Confirm::Failed)]);
        m.answer(a, Answer::Ack, Some(Some(b)));
        assert_eq!(drain(&mut m), []);
        assert_eq!(m.in_flight(), 0);
    }

    use proptest::prelude::*;

    proptest! {
        /// lapin's pairing, modelled: the broker sends a return before the ack of each
        /// unroutable publish and acks in `multiple` batches; the library completes a
        /// batch's confirms in any order, handing the oldest waiting return to whichever
        /// completes first; the application reads the answers in any order, with new
        /// publishes registered in between. Every unroutable publish comes out returned,
        /// every routable one confirmed.
        #[test]
        fn misattributed_returns_are_put_right(
            routable in proptest::collection::vec(any::<bool>(), 1..40),
            cuts in proptest::collection::vec(1usize..6, 40),
            shuffles in proptest::collection::vec(any::<u64>(), 40),
        ) {
            let mut m = ReturnMatcher::new();
            let mut sent: Vec<u64> = Vec::new();
            let mut verdicts = BTreeMap::new();
            let mut next = 0;
            let mut batch = 0;
            while next < routable.len() {
                // The broker takes a few more publishes, then acks them all at once.
                let end = (next + cuts[batch % cuts.len()]).min(routable.len());
                while sent.len() < end {
                    sent.push(m.register());
                }
                let mut waiting_returns: VecDeque<u64> =
                    (next..end).filter(|&i| !routable[i]).map(|i| sent[i]).collect();
                let mut order: Vec<usize> = (next..end).collect();
                let seed = shuffles[batch % shuffles.len()];
                order.sort_by_key(|&i| crate::jitter::splitmix64(seed ^ i as u64));
                let answers: Vec<(u64, Option<Option<u64>>)> = order
                    .iter()
                    .map(|&i| (sent[i], waiting_returns.pop_front().map(Some)))
                    .collect();
                // The application reads them in another order, registering one more
                // publish (sent later) halfway when there is one to send.
                let mut reads = answers;
                reads.sort_by_key(|(s, _)| crate::jitter::splitmix64(seed.rotate_left(17) ^ s));
                for (k, (stamp, returned)) in reads.into_iter().enumerate() {
                    if k == 1 && sent.len() < routable.len() {
                        sent.push(m.register());
                    }
                    m.answer(stamp, Answer::Ack, returned);
                    while let Some((s, c)) = m.poll_verdict() {
                        verdicts.insert(s, c);
                    }
                }
                next = end.max(next + 1).min(sent.len().max(end));
                batch += 1;
            }
            prop_assert_eq!(verdicts.len(), routable.len());
            for (i, ok) in routable.iter().enumerate() {
                let expected = if *ok { Confirm::Ack } else { Confirm::Returned };
                prop_assert_eq!(verdicts[&sent[i]], expected, "publish {}", i);
            }
        }
    }

    #[test]
    fn stamps_round_trip_through_headers() {
        let mut h = Headers::new();
        stamp_headers(&mut h, 42);
        assert_eq!(stamp_of(&h), Some(42));
        h.insert(headers::PUBLISH_ID, "x");
        assert_eq!(stamp_of(&h), None);
    }
}
