//! What the publishing connection knows about the addresses it sends to: which exist, on
//! which connection that was checked, and when.
//!
//! RabbitMQ's AMQP 1.0 plugin accepts a send to a missing queue and drops it, and has nothing
//! like AMQP 0-9-1's `mandatory` to say so. A send therefore goes only to an address that
//! was verified on the connection it goes out on, less than
//! [`Amqp10Config::with_reverify_after`](crate::Amqp10Config::with_reverify_after) ago. This
//! file keeps that record; the publisher probes.
//!
//! On the hot path a send takes two uncontended locks and compares a generation and a
//! timestamp. Only a stale address is probed, and only once however many sends wait for it:
//! the probe is single-flight per address, and the sends that waited for it take its answer.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use retry_core::TransportError;

use crate::connection::ProbeError;

/// What a probe answers: the generation of the connection it ran on and the broker's
/// answer, or the failure that kept it from asking.
pub(crate) type Probed = Result<(u64, Result<(), ProbeError>), TransportError>;

/// Every address probed, each with a slot of its own.
#[derive(Default)]
pub(crate) struct Verifications {
    slots: Mutex<HashMap<String, Arc<Slot>>>,
}

impl Verifications {
    /// The slot of `address`, made on first use.
    pub(crate) fn slot(&self, address: &str) -> Arc<Slot> {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get(address) {
            return Arc::clone(slot);
        }
        let slot = Arc::new(Slot::default());
        slots.insert(address.to_owned(), Arc::clone(&slot));
        slot
    }
}

/// One address: the last probe's answer, and the lock that makes probing single-flight.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<State>,
    probing: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct State {
    /// The last probe that found the address: the connection it ran on and when it started.
    verified: Option<(u64, Instant)>,
    /// Why the last probe found it missing, when it did.
    missing: Option<String>,
    /// Probes finished so far, whatever their answer.
    probes: u64,
}

/// Whether a send may go to an address without probing it first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Freshness {
    /// Verified on this connection less than the age ago.
    Fresh,
    /// Never verified, verified on another connection, too long ago, or found missing.
    /// `probes` is how many probes had finished: a send that then waits for the probe lock
    /// can tell whether one finished meanwhile.
    Stale { probes: u64 },
}

/// What a probe that finished while a send waited for it answered.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// The address exists, verified on this connection.
    Exists,
    /// The broker says it does not exist.
    Missing(String),
    /// No probe finished meanwhile, or it failed, or it ran on a connection that has been
    /// replaced since: probe again.
    Unknown,
}

impl Slot {
    /// Makes sure the address was verified on connection `current()` less than `max_age`
    /// ago, calling `probe` if it was not (and always with `force`). Answers the generation
    /// of the connection it was verified on.
    ///
    /// Single-flight: one call probes at a time, and a call that waited while another
    /// probed takes that probe's answer (unless the probe could not tell, or ran on a
    /// connection replaced since) instead of probing again. `probe` answers the generation
    /// it ran on with the broker's answer, or fails when it could not reach the broker.
    pub(crate) async fn verify<P, F>(
        &self,
        current: impl Fn() -> u64,
        max_age: Duration,
        force: bool,
        probe: P,
    ) -> Result<u64, ProbeError>
    where
        P: FnOnce() -> F,
        F: Future<Output = Probed>,
    {
        let generation = current();
        let seen = match self.freshness(generation, Instant::now(), max_age) {
            Freshness::Fresh if !force => return Ok(generation),
            Freshness::Fresh => self.probes(),
            Freshness::Stale { probes } => probes,
        };
        let _probing = self.probing.lock().await;
        let generation = current();
        match self.answer_since(seen, generation) {
            Answer::Exists => return Ok(generation),
            Answer::Missing(why) => return Err(ProbeError::Missing(why)),
            Answer::Unknown => {}
        }
        let started = Instant::now();
        let (generation, outcome) = probe().await.map_err(ProbeError::Failed)?;
        self.record(generation, started, &outcome);
        outcome.map(|()| generation)
    }

    /// Whether the address was verified on connection `generation` less than `max_age`
    /// before `now`.
    fn freshness(&self, generation: u64, now: Instant, max_age: Duration) -> Freshness {
        let state = lock(&self.state);
        match state.verified {
            Some((g, at)) if g == generation && now.saturating_duration_since(at) < max_age => {
                Freshness::Fresh
            }
            _ => Freshness::Stale {
                probes: state.probes,
            },
        }
    }

    /// How many probes have finished.
    fn probes(&self) -> u64 {
        lock(&self.state).probes
    }

    /// The answer of a probe that finished after `seen` probes, as it holds on connection
    /// `generation`. Called with the probe lock held.
    fn answer_since(&self, seen: u64, generation: u64) -> Answer {
        let state = lock(&self.state);
        if state.probes == seen {
            return Answer::Unknown;
        }
        match (&state.verified, &state.missing) {
            (_, Some(why)) => Answer::Missing(why.clone()),
            (Some((g, _)), None) if *g == generation => Answer::Exists,
            _ => Answer::Unknown,
        }
    }

    /// Records a probe that ran on connection `generation` and started at `started`.
    fn record(&self, generation: u64, started: Instant, outcome: &Result<(), ProbeError>) {
        let mut state = lock(&self.state);
        state.probes += 1;
        match outcome {
            Ok(()) => {
                state.verified = Some((generation, started));
                state.missing = None;
            }
            Err(ProbeError::Missing(why)) => {
                state.verified = None;
                state.missing = Some(why.clone());
            }
            // The broker did not answer: nothing is known either way.
            Err(ProbeError::Failed(_)) => {
                state.verified = None;
                state.missing = None;
            }
        }
    }
}

/// The record stays usable after a panic elsewhere: it holds no invariant a half-finished
/// update could break.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::BoxFuture;
    use std::sync::atomic::{AtomicU32, Ordering};

    const AGE: Duration = Duration::from_secs(5);

    #[test]
    fn an_address_is_fresh_only_on_its_connection_and_within_the_age() {
        let slot = Slot::default();
        let t0 = Instant::now();
        assert_eq!(slot.freshness(0, t0, AGE), Freshness::Stale { probes: 0 });
        slot.record(0, t0, &Ok(()));
        assert_eq!(slot.freshness(0, t0 + AGE / 2, AGE), Freshness::Fresh);
        assert_eq!(
            slot.freshness(0, t0 + AGE, AGE),
            Freshness::Stale { probes: 1 },
            "as old as the age is stale"
        );
        assert_eq!(
            slot.freshness(1, t0, AGE),
            Freshness::Stale { probes: 1 },
            "a new connection verifies again"
        );
        assert_eq!(
            slot.freshness(0, t0, Duration::ZERO),
            Freshness::Stale { probes: 1 }
        );
        assert_eq!(slot.freshness(0, t0, Duration::MAX), Freshness::Fresh);
    }

    #[test]
    fn a_missing_or_unanswered_probe_forgets_the_earlier_verification() {
        let slot = Slot::default();
        let t0 = Instant::now();
        slot.record(0, t0, &Ok(()));
        slot.record(0, t0, &Err(ProbeError::Missing("NOT_FOUND".into())));
        assert_eq!(slot.freshness(0, t0, AGE), Freshness::Stale { probes: 2 });
        slot.record(0, t0, &Ok(()));
        assert_eq!(slot.freshness(0, t0, AGE), Freshness::Fresh);
        slot.record(
            0,
            t0,
            &Err(ProbeError::Failed(TransportError::Timeout {
                operation: "probe",
                after: AGE,
            })),
        );
        assert_eq!(slot.freshness(0, t0, AGE), Freshness::Stale { probes: 4 });
    }

    #[test]
    fn a_send_that_waited_takes_the_answer_of_the_probe_that_finished_meanwhile() {
        let slot = Slot::default();
        let t0 = Instant::now();
        let Freshness::Stale { probes: seen } = slot.freshness(0, t0, AGE) else {
            panic!("never verified")
        };
        assert_eq!(
            slot.answer_since(seen, 0),
            Answer::Unknown,
            "nothing finished"
        );
        slot.record(0, t0, &Ok(()));
        assert_eq!(slot.answer_since(seen, 0), Answer::Exists);
        assert_eq!(
            slot.answer_since(seen, 1),
            Answer::Unknown,
            "verified on a connection replaced since"
        );
        let seen = slot.probes();
        slot.record(0, t0, &Err(ProbeError::Missing("NOT_FOUND".into())));
        assert_eq!(
            slot.answer_since(seen, 0),
            Answer::Missing("NOT_FOUND".into())
        );
        let seen = slot.probes();
        slot.record(
            0,
            t0,
            &Err(ProbeError::Failed(TransportError::connection_lost("gone"))),
        );
        assert_eq!(slot.answer_since(seen, 0), Answer::Unknown, "probe again");
    }

    #[test]
    fn each_address_has_one_slot() {
        let v = Verifications::default();
        let a = v.slot("/amq/queue/a");
        assert!(Arc::ptr_eq(&a, &v.slot("/amq/queue/a")));
        assert!(!Arc::ptr_eq(&a, &v.slot("/amq/queue/b")));
    }

    /// A probe that takes 50 ms and answers `answer` on connection 0, counting its calls.
    fn probe<'a>(
        calls: &'a AtomicU32,
        answer: fn() -> Result<(), ProbeError>,
    ) -> impl FnOnce() -> BoxFuture<'a, Probed> + 'a {
        move || {
            Box::pin(async move {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Ok((0, answer()))
            })
        }
    }

    async fn concurrently(
        slot: &Slot,
        n: usize,
        max_age: Duration,
        calls: &AtomicU32,
        answer: fn() -> Result<(), ProbeError>,
    ) -> Vec<Result<u64, ProbeError>> {
        let sends = (0..n).map(|_| slot.verify(|| 0, max_age, false, probe(calls, answer)));
        futures::future::join_all(sends).await
    }

    #[tokio::test]
    async fn concurrent_sends_to_a_stale_address_wait_for_one_probe() {
        let slot = Slot::default();
        let calls = AtomicU32::new(0);
        let verified = concurrently(&slot, 20, AGE, &calls, || Ok(())).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(verified.iter().all(|v| matches!(v, Ok(0))), "{verified:?}");
        // Fresh now: no probe at all.
        concurrently(&slot, 20, AGE, &calls, || Ok(())).await;
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // With no age every send wants a probe; those that waited share one.
        let verified = concurrently(&slot, 20, Duration::ZERO, &calls, || Ok(())).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(verified.iter().all(|v| matches!(v, Ok(0))), "{verified:?}");
        // Forced, it probes even when fresh.
        slot.verify(|| 0, AGE, true, probe(&calls, || Ok(())))
            .await
            .expect("verified");
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn concurrent_sends_to_a_deleted_address_all_fail_on_one_probe() {
        let slot = Slot::default();
        let calls = AtomicU32::new(0);
        concurrently(&slot, 3, AGE, &calls, || Ok(())).await;
        let missing = || Err(ProbeError::Missing("NOT_FOUND".into()));
        let refused = concurrently(&slot, 20, Duration::ZERO, &calls, missing).await;
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert!(
            refused
                .iter()
                .all(|r| matches!(r, Err(ProbeError::Missing(why)) if why == "NOT_FOUND")),
            "{refused:?}"
        );
        // Found missing, it is probed again by the next send, not refused from memory:
        // a recreated queue is used at once.
        let verified = concurrently(&slot, 1, AGE, &calls, || Ok(())).await;
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert!(matches!(verified[0], Ok(0)));
    }

    #[tokio::test]
    async fn a_new_connection_is_verified_again() {
        let slot = Slot::default();
        let calls = AtomicU32::new(0);
        concurrently(&slot, 1, AGE, &calls, || Ok(())).await;
        let on_next = slot.verify(
            || 1,
            AGE,
            false,
            || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok((1, Ok(())))
            },
        );
        assert!(matches!(on_next.await, Ok(1)));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}
