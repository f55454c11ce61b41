//! Base delays between delayed retries.

use std::time::Duration;

use crate::time::duration_millis;

/// How the base delay grows from one delayed retry to the next.
///
/// Delays are computed in whole milliseconds, the resolution of a broker TTL. [`Backoff::delay`]
/// takes the 0-based index of the delayed retry (0 for the first delay).
///
/// ```
/// use retry_proto::Backoff;
/// use std::time::Duration;
///
/// let spring = Backoff::Exponential {
///     initial: Duration::from_secs(1),
///     multiplier: 3.0,
///     max: Duration::from_secs(10),
/// };
/// let delays: Vec<_> = (0..4).map(|i| spring.delay(i).as_secs()).collect();
/// assert_eq!(delays, [1, 3, 9, 10]);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub enum Backoff {
    /// The same delay every time.
    Fixed(Duration),
    /// `initial + step × n`, capped at `max`.
    Linear {
        /// The first delay.
        initial: Duration,
        /// Added for each further retry.
        step: Duration,
        /// The largest delay.
        max: Duration,
    },
    /// `initial × multiplier^n`, capped at `max`.
    Exponential {
        /// The first delay.
        initial: Duration,
        /// Growth factor, at least 1.
        multiplier: f64,
        /// The largest delay.
        max: Duration,
    },
    /// An explicit list, such as 30s, 10m, 1h; retries past its end reuse the last entry.
    List(Vec<Duration>),
}

impl Backoff {
    /// The base delay of the delayed retry with 0-based index `n`, before jitter.
    pub fn delay(&self, n: u32) -> Duration {
        match self {
            Backoff::Fixed(d) => whole_millis(*d),
            Backoff::Linear { initial, step, max } => {
                let ms = duration_millis(*initial)
                    .saturating_add(duration_millis(*step).saturating_mul(u64::from(n)));
                Duration::from_millis(ms.min(duration_millis(*max)))
            }
            Backoff::Exponential {
                initial,
                multiplier,
                max,
            } => {
                let max_ms = duration_millis(*max);
                let exponent = i32::try_from(n).unwrap_or(i32::MAX);
                let ms = duration_millis(*initial) as f64 * multiplier.powi(exponent);
                // `ms` may be infinite; the comparison caps it before the cast.
                if ms >= max_ms as f64 {
                    Duration::from_millis(max_ms)
                } else {
                    Duration::from_millis(ms.round() as u64)
                }
            }
            Backoff::List(list) => {
                let i = usize::try_from(n).unwrap_or(usize::MAX);
                list.get(i)
                    .or(list.last())
                    .map(|d| whole_millis(*d))
                    .unwrap_or_default()
            }
        }
    }

    /// The smallest and the largest base delay this backoff can produce over `retries`
    /// delayed retries, or `None` when `retries` is 0.
    pub fn bounds(&self, retries: u32) -> Option<(Duration, Duration)> {
        if retries == 0 {
            return None;
        }
        match self {
            // Monotone backoffs: first and last are the extremes.
            Backoff::Fixed(_) | Backoff::Linear { .. } | Backoff::Exponential { .. } => {
                Some((self.delay(0), self.delay(retries - 1)))
            }
            Backoff::List(list) => {
                // Retries past the list's end reuse its last entry: the list bounds them all.
                let used = usize::try_from(retries)
                    .unwrap_or(usize::MAX)
                    .min(list.len());
                let all = list[..used].iter().map(|d| whole_millis(*d));
                let min = all.clone().min()?;
                let max = all.max()?;
                Some((min, max))
            }
        }
    }

    /// The distinct base delays of `retries` delayed retries, ascending, without visiting
    /// each retry: a policy that retries (practically) forever costs as little as one that
    /// retries five times.
    ///
    /// More than `limit` distinct delays is `Err` with their count, counted up to
    /// [`COUNT_CEILING`] and saturating there.
    pub(crate) fn distinct_delays(&self, retries: u32, limit: usize) -> Result<Vec<Duration>, u64> {
        let mut levels = Vec::new();
        let mut count: u64 = 0;
        if let Backoff::List(list) = self {
            let used = usize::try_from(retries)
                .unwrap_or(usize::MAX)
                .min(list.len());
            levels.extend(list[..used].iter().map(|d| whole_millis(*d)));
            levels.sort_unstable();
            levels.dedup();
            return match levels.len() {
                n if n > limit => Err(n as u64),
                _ => Ok(levels),
            };
        }
        // Fixed, linear and exponential backoffs never shrink: jump from each delay to the
        // first retry with a longer one, by galloping then bisecting.
        let mut n = 0;
        while n < retries && count < COUNT_CEILING {
            let current = self.delay(n);
            count += 1;
            if levels.len() <= limit {
                levels.push(current);
            }
            let (mut same, mut step) = (n, 1u32);
            let mut longer = loop {
                let probe = same.saturating_add(step).min(retries);
                if probe == retries || self.delay(probe) > current {
                    break probe;
                }
                same = probe;
                step = step.saturating_mul(2);
            };
            while longer - same > 1 {
                let mid = same + (longer - same) / 2;
                if self.delay(mid) > current {
                    longer = mid;
                } else {
                    same = mid;
                }
            }
            n = longer;
        }
        if levels.len() > limit {
            return Err(count);
        }
        Ok(levels)
    }
}

/// Where [`Backoff::distinct_delays`] stops counting.
pub(crate) const COUNT_CEILING: u64 = 100_000;

fn whole_millis(d: Duration) -> Duration {
    Duration::from_millis(duration_millis(d))
}
