//! Fault injection on the broker side: refused, lost and unconfirmed publishes, and
//! duplicated deliveries, counted or at seeded random rates.

use std::sync::Arc;

use crate::broker::Broker;
use crate::queue::Stored;
use crate::trace::EventKind;

/// What happens to one publish through a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PublishFault {
    /// Never reaches the broker; the publisher sees a failure.
    Lose,
    /// Refused with a negative confirm.
    Refuse,
    /// Routed, but the confirm never arrives; the publisher sees a failure.
    LoseConfirm,
}

/// Probabilities of faults, drawn from a seeded generator so a run can be replayed. Each is
/// a probability between 0 and 1, per publish through a connection (or per delivery for
/// duplicates).
///
/// ```
/// use transport_memory::{Broker, FaultRates};
///
/// let broker = Broker::new();
/// broker.random_faults(7, FaultRates::new().lose_publishes(0.05).duplicate_deliveries(0.01));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    lose: f64,
    refuse: f64,
    lose_confirm: f64,
    duplicate: f64,
}

impl FaultRates {
    /// No faults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Publishes that vanish before reaching the broker.
    pub fn lose_publishes(mut self, p: f64) -> Self {
        self.lose = p;
        self
    }

    /// Publishes refused with a negative confirm.
    pub fn refuse_publishes(mut self, p: f64) -> Self {
        self.refuse = p;
        self
    }

    /// Publishes that are routed but whose confirm is lost.
    pub fn lose_confirms(mut self, p: f64) -> Self {
        self.lose_confirm = p;
        self
    }

    /// Deliveries followed by a second copy of the same message.
    pub fn duplicate_deliveries(mut self, p: f64) -> Self {
        self.duplicate = p;
        self
    }
}

/// SplitMix64: small, fast and well mixed; the fault stream depends on the seed alone.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `p` (clamped to [0, 1]).
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 || p.is_nan() {
            return false;
        }
        let draw = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        draw < p
    }
}

#[derive(Debug, Default)]
pub(crate) struct Faults {
    lose: u32,
    refuse: u32,
    lose_confirm: u32,
    duplicate: u32,
    random: Option<(FaultRates, Rng)>,
}

impl Faults {
    pub(crate) fn on_publish(&mut self) -> Option<PublishFault> {
        if take(&mut self.lose) {
            return Some(PublishFault::Lose);
        }
        if take(&mut self.refuse) {
            return Some(PublishFault::Refuse);
        }
        if take(&mut self.lose_confirm) {
            return Some(PublishFault::LoseConfirm);
        }
        let (rates, rng) = self.random.as_mut()?;
        if rng.chance(rates.lose) {
            Some(PublishFault::Lose)
        } else if rng.chance(rates.refuse) {
            Some(PublishFault::Refuse)
        } else if rng.chance(rates.lose_confirm) {
            Some(PublishFault::LoseConfirm)
        } else {
            None
        }
    }

    /// A fresh copy of `m` to deliver again, if a duplicate is due.
    pub(crate) fn on_deliver(&mut self, m: &Stored) -> Option<Stored> {
        let due = take(&mut self.duplicate)
            || self
                .random
                .as_mut()
                .is_some_and(|(rates, rng)| rng.chance(rates.duplicate));
        due.then(|| {
            let mut copy = m.clone();
            copy.redelivered = false;
            copy
        })
    }
}

fn take(n: &mut u32) -> bool {
    if *n == 0 {
        return false;
    }
    *n -= 1;
    true
}

impl Broker {
    fn fault(&self, description: String, f: impl FnOnce(&mut Faults)) {
        self.shared.with(|s| {
            f(&mut s.faults);
            let description = Arc::from(description);
            s.record(|| EventKind::Fault { description });
        });
    }

    /// The next `n` publishes through any connection never reach the broker: the publisher
    /// sees [`PublishResult::Failed`](retry_core::PublishResult::Failed).
    pub fn lose_publishes(&self, n: u32) {
        self.fault(format!("lose the next {n} publishes"), |f| f.lose += n);
    }

    /// The next `n` publishes through any connection are refused with a negative confirm.
    pub fn refuse_publishes(&self, n: u32) {
        self.fault(format!("refuse the next {n} publishes"), |f| f.refuse += n);
    }

    /// The next `n` publishes through any connection are routed, but their confirms are
    /// lost: the publisher sees a failure while the message is in its queue, so the engine's
    /// requeue of the original makes a duplicate.
    pub fn lose_confirms(&self, n: u32) {
        self.fault(
            format!("lose the confirms of the next {n} publishes"),
            |f| {
                f.lose_confirm += n;
            },
        );
    }

    /// The next `n` deliveries are each followed by a second copy of the same message.
    pub fn duplicate_deliveries(&self, n: u32) {
        self.fault(format!("duplicate the next {n} deliveries"), |f| {
            f.duplicate += n;
        });
    }

    /// From now on, faults at random with these rates, from a generator seeded with `seed`.
    pub fn random_faults(&self, seed: u64, rates: FaultRates) {
        self.fault(format!("random faults, seed {seed}: {rates:?}"), |f| {
            f.random = Some((rates, Rng::new(seed)));
        });
    }

    /// Stops random and pending counted faults.
    pub fn clear_faults(&self) {
        self.fault("clear faults".to_owned(), |f| *f = Faults::default());
    }
}
