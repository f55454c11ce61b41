//! Seeded jitter: randomised delays that are reproducible per message.

use std::time::Duration;

use crate::time::duration_millis;

/// How a base delay is randomised.
///
/// The randomness is a pure function of a seed (the message identity, see
/// [`message_identity`]) and the retry index, so a message's schedule can be replayed exactly.
/// The variants follow the AWS Architecture Blog's "Exponential Backoff And Jitter".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Jitter {
    /// The base delay, unchanged (the default).
    #[default]
    None,
    /// Uniform in `[0, base]`.
    Full,
    /// Uniform in `[base / 2, base]`.
    Equal,
    /// `min(cap, uniform(first, previous × 3))`, where `first` is the first base delay and
    /// `cap` the largest; the first delay is `first`.
    Decorrelated,
}

/// A 64-bit identity for a message, used to seed its jitter: FNV-1a of the message id when it
/// has one, else of the body. Stable across processes and releases.
///
/// ```
/// use retry_proto::message_identity;
///
/// assert_eq!(message_identity(Some("order-7"), b"ignored"), message_identity(Some("order-7"), b""));
/// assert_ne!(message_identity(None, b"a"), message_identity(None, b"b"));
/// ```
pub fn message_identity(message_id: Option<&str>, body: &[u8]) -> u64 {
    match message_id {
        Some(id) => fnv1a(id.as_bytes()),
        None => fnv1a(body),
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64's output function: `z` advanced by the golden-ratio increment, then mixed.
/// The jitter draws from it (one draw per seed and retry index), and so may anything that
/// wants the same small, well-mixed, reproducible stream: calling it on `seed`,
/// `seed + 0x9e37_79b9_7f4a_7c15`, `seed + 2 * 0x9e37_79b9_7f4a_7c15`, ... gives the
/// SplitMix64 sequence of `seed`.
///
/// ```
/// use retry_proto::splitmix64;
///
/// // The first output of SplitMix64 seeded with 0.
/// assert_eq!(splitmix64(0), 0xe220_a839_7b1d_cdaf);
/// ```
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `[lo, hi]` milliseconds (inclusive), drawn from `(seed, index)`.
fn uniform(seed: u64, index: u32, lo: u64, hi: u64) -> Duration {
    if hi <= lo {
        return Duration::from_millis(lo);
    }
    let r = splitmix64(seed ^ splitmix64(u64::from(index)));
    let span = hi - lo;
    let offset = match span.checked_add(1) {
        Some(n) => r % n,
        None => r,
    };
    Duration::from_millis(lo + offset)
}

impl Jitter {
    /// Applies the jitter to the base delay of retry `index`.
    ///
    /// `previous` is the jittered delay of the previous retry (decorrelated jitter grows from
    /// it), `first` and `cap` the smallest and largest base delays of the policy.
    pub(crate) fn apply(
        self,
        base: Duration,
        seed: u64,
        index: u32,
        previous: Option<Duration>,
        first: Duration,
        cap: Duration,
    ) -> Duration {
        let base_ms = duration_millis(base);
        match self {
            Jitter::None => base,
            Jitter::Full => uniform(seed, index, 0, base_ms),
            Jitter::Equal => uniform(seed, index, base_ms / 2, base_ms),
            Jitter::Decorrelated => {
                let first_ms = duration_millis(first);
                let cap_ms = duration_millis(cap);
                match previous {
                    None => Duration::from_millis(first_ms.min(cap_ms)),
                    Some(prev) => {
                        let hi = duration_millis(prev).saturating_mul(3).max(first_ms);
                        let d = uniform(seed, index, first_ms, hi);
                        d.min(Duration::from_millis(cap_ms))
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_stays_in_range_and_is_deterministic() {
        for i in 0..1000 {
            let d = uniform(42, i, 100, 200);
            assert!((100..=200).contains(&d.as_millis()), "{d:?}");
            assert_eq!(d, uniform(42, i, 100, 200));
        }
        assert_eq!(uniform(1, 0, 7, 7), Duration::from_millis(7));
        // The full u64 range must not overflow.
        let _ = uniform(1, 0, 0, u64::MAX);
    }

    #[test]
    fn uniform_depends_on_seed_and_index() {
        let a: Vec<_> = (0..16).map(|i| uniform(1, i, 0, 1_000_000)).collect();
        let b: Vec<_> = (0..16).map(|i| uniform(2, i, 0, 1_000_000)).collect();
        assert_ne!(a, b);
        assert!(a.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn fnv1a_matches_reference_vectors() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
