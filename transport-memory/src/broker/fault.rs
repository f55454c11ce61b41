//! Fault injection on the broker side: refused, lost, unconfirmed and returned publishes,
//! duplicated deliveries, failed watches and subscribes, fetches that give up with their
//! message on the way (kept for the next fetch, or lost in flight and requeued), and returns
//! reported against the wrong publish, counted or at seeded random rates.

use retry_core::splitmix64;

use crate::broker::message::Stored;

/// What happens to one publish through a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PublishFault {
    /// Never reaches the broker; the publisher sees a failure.
    Lose,
    /// Refused with a negative confirm.
    Refuse,
    /// Routed, but the confirm never arrives; the publisher sees a failure.
    LoseConfirm,
    /// Routed nowhere, as if its binding were missing: a `mandatory` publish comes back
    /// returned.
    Return,
}

/// What happens to a fetch that found a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FetchFault {
    /// It gives up before the message arrives; the next fetch on the connection gets it.
    Late,
    /// The message is lost on its way: the broker's copy goes back to its place in the
    /// queue redelivered, and the fetch fails with a lost fetch.
    Lost,
}

/// Probabilities of faults, drawn from a seeded generator so a run can be replayed. Each is
/// a probability between 0 and 1: per publish through a connection, per delivery for
/// duplicates, per watch, subscribe or fetch for those, per batch of confirms for
/// misattributed returns.
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
    returned: f64,
    watch: f64,
    subscribe: f64,
    late_fetch: f64,
    lost_fetch: f64,
    misattribute: f64,
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

    /// Publishes that route nowhere, as if their binding had gone: they come back
    /// returned.
    pub fn return_publishes(mut self, p: f64) -> Self {
        self.returned = p;
        self
    }

    /// Watches of a queue ([`Transport::ready`](retry_core::Transport::ready)) that fail
    /// with a lost connection.
    pub fn fail_watches(mut self, p: f64) -> Self {
        self.watch = p;
        self
    }

    /// Subscribes ([`Transport::consume`](retry_core::Transport::consume)) that fail with a
    /// lost connection.
    pub fn fail_subscribes(mut self, p: f64) -> Self {
        self.subscribe = p;
        self
    }

    /// Fetches that give up (time out) while the broker has already sent them a message:
    /// the message arrives after the fetch failed, and the next fetch on the connection
    /// gets it.
    pub fn late_fetches(mut self, p: f64) -> Self {
        self.late_fetch = p;
        self
    }

    /// Fetches whose message is lost on its way, as a `get-ok` is lost with its channel:
    /// the broker puts the message back at its place in the queue, flagged redelivered, and
    /// the fetch fails with [`TransportError::FetchLost`](retry_core::TransportError::FetchLost).
    /// Drawn for a fetch that found a message and was not made late.
    ///
    /// ```
    /// use transport_memory::{Broker, FaultRates};
    ///
    /// let broker = Broker::new();
    /// broker.random_faults(7, FaultRates::new().late_fetches(0.1).lost_fetches(0.1));
    /// ```
    pub fn lost_fetches(mut self, p: f64) -> Self {
        self.lost_fetch = p;
        self
    }

    /// Batches of publisher confirms that the client completes in any order, handing each
    /// return to whichever confirm completes first, as lapin 4.12 does: a return can be
    /// reported against the wrong publish. Only a transport that pairs returns by their
    /// own stamp ([`retry_core::ReturnMatcher`]) stays right.
    pub fn misattribute_returns(mut self, p: f64) -> Self {
        self.misattribute = p;
        self
    }
}

/// SplitMix64: small, fast and well mixed; the fault stream depends on the seed alone.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

/// SplitMix64's increment: the golden ratio in 64 bits.
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        // `splitmix64` adds the increment before mixing, so this is the output of the
        // advanced state, as SplitMix64 gives it.
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN);
        out
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

/// The faults waiting to happen: counted ones first, then random ones.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    lose: u32,
    refuse: u32,
    lose_confirm: u32,
    duplicate: u32,
    returned: u32,
    watch: u32,
    subscribe: u32,
    late_fetch: u32,
    lost_fetch: u32,
    misattribute: u32,
    random: Option<(FaultRates, Rng)>,
}

impl Faults {
    /// The next `n` publishes through connections are lost.
    pub(crate) fn lose_publishes(&mut self, n: u32) {
        self.lose += n;
    }

    /// The next `n` publishes through connections are refused.
    pub(crate) fn refuse_publishes(&mut self, n: u32) {
        self.refuse += n;
    }

    /// The confirms of the next `n` publishes through connections are lost.
    pub(crate) fn lose_confirms(&mut self, n: u32) {
        self.lose_confirm += n;
    }

    /// The next `n` deliveries are duplicated.
    pub(crate) fn duplicate_deliveries(&mut self, n: u32) {
        self.duplicate += n;
    }

    /// The next `n` publishes through connections route nowhere.
    pub(crate) fn return_publishes(&mut self, n: u32) {
        self.returned += n;
    }

    /// The next `n` watches fail.
    pub(crate) fn fail_watches(&mut self, n: u32) {
        self.watch += n;
    }

    /// The next `n` subscribes fail.
    pub(crate) fn fail_subscribes(&mut self, n: u32) {
        self.subscribe += n;
    }

    /// The next `n` fetches that find a message give up before it arrives.
    pub(crate) fn late_fetches(&mut self, n: u32) {
        self.late_fetch += n;
    }

    /// The next `n` fetches that find a message lose it on its way.
    pub(crate) fn lost_fetches(&mut self, n: u32) {
        self.lost_fetch += n;
    }

    /// The next `n` batches of confirms are completed out of order.
    pub(crate) fn misattribute_returns(&mut self, n: u32) {
        self.misattribute += n;
    }

    /// Faults at random from now on, drawn from a generator seeded with `seed`.
    pub(crate) fn random(&mut self, seed: u64, rates: FaultRates) {
        self.random = Some((rates, Rng::new(seed)));
    }

    /// No more faults, counted or random.
    pub(crate) fn clear(&mut self) {
        *self = Faults::default();
    }

    /// The fault, if any, of a publish through a connection.
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
        if take(&mut self.returned) {
            return Some(PublishFault::Return);
        }
        let (rates, rng) = self.random.as_mut()?;
        if rng.chance(rates.lose) {
            Some(PublishFault::Lose)
        } else if rng.chance(rates.refuse) {
            Some(PublishFault::Refuse)
        } else if rng.chance(rates.lose_confirm) {
            Some(PublishFault::LoseConfirm)
        } else if rng.chance(rates.returned) {
            Some(PublishFault::Return)
        } else {
            None
        }
    }

    /// Whether a watch fails.
    pub(crate) fn on_watch(&mut self) -> bool {
        self.counted_or_random(|f| &mut f.watch, |r| r.watch)
    }

    /// Whether a subscribe fails.
    pub(crate) fn on_subscribe(&mut self) -> bool {
        self.counted_or_random(|f| &mut f.subscribe, |r| r.subscribe)
    }

    /// The fault, if any, of a fetch that found a message. A late fetch is drawn first,
    /// so seeded runs without lost fetches draw exactly as before they existed.
    pub(crate) fn on_fetch(&mut self) -> Option<FetchFault> {
        if take(&mut self.late_fetch) {
            return Some(FetchFault::Late);
        }
        if take(&mut self.lost_fetch) {
            return Some(FetchFault::Lost);
        }
        let (rates, rng) = self.random.as_mut()?;
        if rng.chance(rates.late_fetch) {
            Some(FetchFault::Late)
        } else if rng.chance(rates.lost_fetch) {
            Some(FetchFault::Lost)
        } else {
            None
        }
    }

    /// For a batch of confirms completed out of order, the seed of its order.
    pub(crate) fn on_confirm_batch(&mut self) -> Option<u64> {
        if take(&mut self.misattribute) {
            return Some(self.random.as_mut().map_or(0, |(_, rng)| rng.next_u64()));
        }
        let (rates, rng) = self.random.as_mut()?;
        rng.chance(rates.misattribute).then(|| rng.next_u64())
    }

    /// Whether misattributed returns may happen at all, counted or at random: confirms are
    /// then batched.
    pub(crate) fn misattributes(&self) -> bool {
        self.misattribute > 0
            || self
                .random
                .as_ref()
                .is_some_and(|(r, _)| r.misattribute > 0.0)
    }

    fn counted_or_random(
        &mut self,
        counted: impl FnOnce(&mut Faults) -> &mut u32,
        rate: impl FnOnce(&FaultRates) -> f64,
    ) -> bool {
        if take(counted(self)) {
            return true;
        }
        self.random
            .as_mut()
            .is_some_and(|(rates, rng)| rng.chance(rate(rates)))
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

#[cfg(test)]
mod tests {
    use super::Rng;

    /// SplitMix64 written out: advance the state, then mix it. Seeded runs replay only if
    /// the fault stream stays exactly this.
    fn reference(mut state: u64, n: usize) -> Vec<u64> {
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^ (z >> 31)
            })
            .collect()
    }

    #[test]
    fn the_fault_stream_is_splitmix64_of_the_seed() {
        assert_eq!(Rng::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
        for seed in [0, 7, 0x5eed_fa17, u64::MAX] {
            let mut rng = Rng::new(seed);
            let drawn: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
            assert_eq!(drawn, reference(seed, 1000), "seed {seed}");
        }
    }
}
