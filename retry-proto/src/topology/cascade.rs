//! The binary delay cascade: any delay, to the unit, on a broker with nothing but TTL queues
//! and topic exchanges, without a message ever waiting behind a longer one.
//!
//! Level `k` is a queue whose every message waits exactly `unit × 2^k`, so it expires in
//! arrival order. A delay of `n` units is written in binary; the clone enters at the top
//! level's exchange and passes down the levels, waiting in level `k`'s queue when bit `k` of
//! `n` is set, and skipping it (an exchange-to-exchange binding) when it is not. Below level
//! 0, a delivery exchange routes it by destination to its work queue.
//!
//! | object | name (classic; quorum adds `.quorum` after the unit) | kind |
//! |---|---|---|
//! | level `k` exchange | `P.U.k`, e.g. `retry.cascade.10ms.03` | topic |
//! | level `k` queue | `P.U.k` | TTL `U × 2^k`; dead-letters to level `k-1`'s exchange (level 0: the delivery exchange), keeping the routing key |
//! | delivery exchange | `P.U.deliver` | topic |
//!
//! `P` is the [prefix](Cascade::with_prefix) (`retry.cascade`), `U` the unit. Level `k`'s
//! exchange binds `*.`×k`1.#` to its queue and `*.`×k`0.#` to the next exchange down. The
//! routing key is [`MAX_CASCADE_LEVELS`] bit words, lowest first, then the destination queue:
//! a fixed width, so a level's bindings do not depend on how many levels a plan uses, and the
//! delivery exchange's binding for a queue (32 `*` words, then its name) matches that queue
//! exactly, never a queue whose name ends the same way. Every work queue of the same prefix,
//! unit and queue type shares one cascade; a plan that needs more levels adds them on top.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use super::{
    BindingSpec, ExchangeKind, ExchangeSpec, Overflow, QueueArguments, QueueRole, QueueSpec,
    QueueType, Route, TopologyError,
};
use crate::policy::MAX_TTL;
use crate::time::{duration_millis, format_delay};

/// The most levels a cascade may have, and the number of bit words in every cascade routing
/// key. 32 levels of 1 ms hold about 49.7 days, the longest TTL a broker can hold.
pub const MAX_CASCADE_LEVELS: u32 = 32;

/// The cascade's default unit: every delay is rounded up to a multiple of it.
pub const DEFAULT_CASCADE_UNIT: Duration = Duration::from_millis(10);

/// The cascade's default name prefix.
pub const DEFAULT_CASCADE_PREFIX: &str = "retry.cascade";

/// Settings of a binary delay cascade: its unit, its number of levels and its names' prefix.
///
/// ```
/// use retry_proto::{Cascade, DelayStrategy, RetryPolicy, TopologyPlan};
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(10), Duration::from_secs(60)]).build()?;
/// let plan = TopologyPlan::builder("comments", &policy)
///     .with_strategy(DelayStrategy::Cascade(Cascade::new()))
///     .build()?;
/// let cascade = plan.cascade().unwrap();
/// assert_eq!(cascade.unit(), Duration::from_millis(10));
/// assert_eq!(cascade.levels(), 13); // 2^13 - 1 units of 10 ms hold 60 s
/// assert_eq!(cascade.entry_exchange(), "retry.cascade.10ms.12");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Cascade {
    unit: Duration,
    levels: Option<u32>,
    prefix: String,
}

impl Default for Cascade {
    fn default() -> Self {
        Cascade::new()
    }
}

impl Cascade {
    /// A 10 ms unit, as many levels as the policy's longest delay needs, prefix
    /// `retry.cascade`.
    pub fn new() -> Self {
        Cascade {
            unit: DEFAULT_CASCADE_UNIT,
            levels: None,
            prefix: DEFAULT_CASCADE_PREFIX.to_owned(),
        }
    }

    /// The unit: level 0 holds one unit, and every delay is rounded up to a multiple of it.
    /// A whole number of milliseconds, at least 1 ms (brokers keep TTLs in milliseconds).
    pub fn with_unit(mut self, unit: Duration) -> Self {
        self.unit = unit;
        self
    }

    /// A fixed number of levels (1 to [`MAX_CASCADE_LEVELS`]), instead of the fewest that
    /// hold the policy's longest delay. A cascade of `n` levels holds `(2^n - 1) × unit`.
    pub fn with_levels(mut self, levels: u32) -> Self {
        self.levels = Some(levels);
        self
    }

    /// The prefix of the cascade's exchange and queue names. Work queues share a cascade
    /// only when they use the same prefix, unit and queue type.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The unit.
    pub fn unit(&self) -> Duration {
        self.unit
    }

    /// The fixed number of levels, or `None` for the fewest that hold the longest delay.
    pub fn levels(&self) -> Option<u32> {
        self.levels
    }

    /// The name prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

/// An exchange-to-exchange binding to declare.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangeBindingSpec {
    /// The exchange messages come from.
    pub source: String,
    /// The exchange they go on to.
    pub destination: String,
    /// The binding key (a topic pattern).
    pub routing_key: String,
}

/// The cascade's topology as data, and the routing keys that send a clone through it.
///
/// Its objects are shared by every work queue that uses the same cascade: provision them
/// before the plan's own, and never delete them with one work queue's topology.
///
/// ```
/// use retry_proto::{Cascade, DelayStrategy, RetryPolicy, TopologyPlan};
/// use std::time::Duration;
///
/// let policy = RetryPolicy::delays([Duration::from_secs(1)]).build()?;
/// let plan = TopologyPlan::builder("orders", &policy)
///     .with_strategy(DelayStrategy::Cascade(Cascade::new()))
///     .build()?;
/// let cascade = plan.cascade().unwrap();
/// // 50 ms is 5 units, 0b101: it waits in levels 2 (40 ms) and 0 (10 ms).
/// let key = cascade.routing_key(Duration::from_millis(50), "orders");
/// assert!(key.starts_with("1.0.1.0.0."));
/// assert_eq!(cascade.hops(Duration::from_millis(50)), 2);
/// assert_eq!(cascade.destination_of(&key), Some("orders"));
/// assert_eq!(cascade.delay_of(&key), Some(Duration::from_millis(50)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CascadePlan {
    unit: Duration,
    levels: u32,
    exchanges: Vec<ExchangeSpec>,
    pub(super) queues: Vec<QueueSpec>,
    exchange_bindings: Vec<ExchangeBindingSpec>,
    bindings: Vec<BindingSpec>,
    entry: Arc<str>,
    delivery_exchange: String,
}

impl CascadePlan {
    /// The cascade for `settings`, with enough levels for `longest` (unless fixed).
    pub(crate) fn new(
        settings: &Cascade,
        queue_type: QueueType,
        longest: Duration,
    ) -> Result<Self, TopologyError> {
        let unit = settings.unit;
        let unit_ms = duration_millis(unit);
        if unit.is_zero() || Duration::from_millis(unit_ms) != unit {
            return Err(TopologyError::InvalidCascadeUnit { unit });
        }
        let prefix = &settings.prefix;
        if prefix.is_empty() || prefix.starts_with("amq.") {
            return Err(TopologyError::InvalidCascadePrefix {
                prefix: prefix.clone(),
            });
        }
        let needed = units(longest, unit);
        let fewest = (1..=MAX_CASCADE_LEVELS)
            .find(|&n| capacity(n) >= needed)
            .unwrap_or(MAX_CASCADE_LEVELS + 1);
        let levels = settings.levels.unwrap_or(fewest);
        if levels == 0 || levels > MAX_CASCADE_LEVELS || levels < fewest {
            return Err(TopologyError::CascadeLevels {
                levels,
                needed: fewest,
                longest,
            });
        }
        let top = Duration::from_millis(unit_ms.saturating_mul(1 << (levels - 1)));
        if top > MAX_TTL {
            return Err(TopologyError::CascadeLevelTooLong {
                level: levels - 1,
                ttl: top,
            });
        }

        let quorum = queue_type == QueueType::Quorum;
        let base = match queue_type {
            QueueType::Classic => format!("{prefix}.{}", format_delay(unit)),
            QueueType::Quorum => format!("{prefix}.{}.quorum", format_delay(unit)),
        };
        let level_name = |k: u32| format!("{base}.{k:02}");
        let delivery_exchange = format!("{base}.deliver");
        let topic = |name: String| ExchangeSpec {
            name,
            kind: ExchangeKind::Topic,
            durable: true,
        };
        let mut exchanges = vec![topic(delivery_exchange.clone())];
        let mut queues = Vec::new();
        let mut exchange_bindings = Vec::new();
        let mut bindings = Vec::new();
        for k in 0..levels {
            let name = level_name(k);
            let below = if k == 0 {
                delivery_exchange.clone()
            } else {
                level_name(k - 1)
            };
            let ttl = Duration::from_millis(unit_ms << k);
            exchanges.push(topic(name.clone()));
            queues.push(QueueSpec {
                name: name.clone(),
                role: QueueRole::CascadeLevel { level: k, ttl },
                durable: true,
                arguments: QueueArguments {
                    queue_type,
                    message_ttl: Some(ttl),
                    // No routing key: a dead-lettered message keeps its own, bits and all.
                    dead_letter_exchange: Some(below.clone()),
                    dead_letter_routing_key: None,
                    overflow: quorum.then_some(Overflow::RejectPublish),
                    at_least_once: quorum,
                    delivery_limit: None,
                    initial_group_size: None,
                },
            });
            bindings.push(BindingSpec {
                exchange: name.clone(),
                queue: name.clone(),
                routing_key: bit_pattern(k, '1'),
            });
            exchange_bindings.push(ExchangeBindingSpec {
                source: name,
                destination: below,
                routing_key: bit_pattern(k, '0'),
            });
        }
        Ok(CascadePlan {
            unit,
            levels,
            exchanges,
            queues,
            exchange_bindings,
            bindings,
            entry: Arc::from(level_name(levels - 1)),
            delivery_exchange,
        })
    }

    /// The unit every delay is rounded up to.
    pub fn unit(&self) -> Duration {
        self.unit
    }

    /// How many levels it has.
    pub fn levels(&self) -> u32 {
        self.levels
    }

    /// The longest delay it holds: `(2^levels - 1) × unit`. Longer delays are cut to it.
    pub fn max_delay(&self) -> Duration {
        self.unit
            .saturating_mul(u32::try_from(capacity(self.levels)).unwrap_or(u32::MAX))
    }

    /// Its exchanges: the delivery exchange, then one per level, from level 0 up.
    pub fn exchanges(&self) -> &[ExchangeSpec] {
        &self.exchanges
    }

    /// Its queues, one per level, from level 0 up.
    pub fn queues(&self) -> &[QueueSpec] {
        &self.queues
    }

    /// The bindings from each level's exchange to the next exchange down, for bit 0.
    pub fn exchange_bindings(&self) -> &[ExchangeBindingSpec] {
        &self.exchange_bindings
    }

    /// The bindings from each level's exchange to its queue, for bit 1.
    pub fn bindings(&self) -> &[BindingSpec] {
        &self.bindings
    }

    /// The exchange every delayed clone is published to: the top level's.
    pub fn entry_exchange(&self) -> &str {
        &self.entry
    }

    /// The exchange below level 0, which routes by destination.
    pub fn delivery_exchange(&self) -> &str {
        &self.delivery_exchange
    }

    /// `delay` in units, rounded up, and cut to what the cascade holds.
    pub fn units(&self, delay: Duration) -> u64 {
        units(delay, self.unit).min(capacity(self.levels))
    }

    /// The delay a clone actually waits for `delay`: rounded up to the unit.
    pub fn rounded(&self, delay: Duration) -> Duration {
        Duration::from_millis(self.units(delay).saturating_mul(duration_millis(self.unit)))
    }

    /// How many level queues a clone delayed by `delay` waits in: the set bits of its units.
    pub fn hops(&self, delay: Duration) -> u32 {
        self.units(delay).count_ones()
    }

    /// The routing key that takes a clone through the cascade, waiting `delay` rounded up to
    /// the unit, to the queue `destination`.
    pub fn routing_key(&self, delay: Duration, destination: &str) -> String {
        let n = self.units(delay);
        let mut key = String::with_capacity(2 * MAX_CASCADE_LEVELS as usize + destination.len());
        for k in 0..MAX_CASCADE_LEVELS {
            key.push(if n >> k & 1 == 1 { '1' } else { '0' });
            key.push('.');
        }
        key.push_str(destination);
        key
    }

    /// The route for a clone delayed by `delay` on its way to `destination`.
    pub fn route(&self, delay: Duration, destination: &str) -> Route {
        Route {
            exchange: self.entry.clone(),
            routing_key: Arc::from(self.routing_key(delay, destination)),
        }
    }

    /// The binding key with which a destination queue binds to the delivery exchange.
    pub fn delivery_pattern(destination: &str) -> String {
        let mut key = "*.".repeat(MAX_CASCADE_LEVELS as usize);
        key.push_str(destination);
        key
    }

    /// The destination queue of a cascade routing key; `None` when it is not one.
    pub fn destination_of<'k>(&self, routing_key: &'k str) -> Option<&'k str> {
        split_key(routing_key).map(|(_, destination)| destination)
    }

    /// The delay a cascade routing key asks for; `None` when it is not one.
    pub fn delay_of(&self, routing_key: &str) -> Option<Duration> {
        let (bits, _) = split_key(routing_key)?;
        Some(Duration::from_millis(
            bits.saturating_mul(duration_millis(self.unit)),
        ))
    }
}

/// `*.` for each level below `k`, then `bit`, then `.#`.
fn bit_pattern(k: u32, bit: char) -> String {
    let mut p = "*.".repeat(k as usize);
    let _ = write!(p, "{bit}.#");
    p
}

/// The most units `levels` levels hold: `2^levels - 1`.
fn capacity(levels: u32) -> u64 {
    (1u64 << levels) - 1
}

/// `delay` in `unit`s, rounded up.
fn units(delay: Duration, unit: Duration) -> u64 {
    let n = delay.as_nanos().div_ceil(unit.as_nanos().max(1));
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The units and the destination of a cascade routing key.
fn split_key(key: &str) -> Option<(u64, &str)> {
    let mut n = 0u64;
    let mut rest = key;
    for k in 0..MAX_CASCADE_LEVELS {
        let (bit, tail) = rest.split_once('.')?;
        match bit {
            "0" => {}
            "1" => n |= 1 << k,
            _ => return None,
        }
        rest = tail;
    }
    Some((n, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_and_units() {
        assert_eq!(capacity(1), 1);
        assert_eq!(capacity(32), u64::from(u32::MAX));
        let ms = Duration::from_millis;
        assert_eq!(units(ms(0), ms(10)), 0);
        assert_eq!(units(ms(1), ms(10)), 1);
        assert_eq!(units(ms(10), ms(10)), 1);
        assert_eq!(units(Duration::from_micros(10_001), ms(10)), 2);
    }

    #[test]
    fn keys_that_are_not_cascade_keys() {
        assert_eq!(split_key("orders"), None);
        assert_eq!(split_key(&format!("{}orders", "2.".repeat(32))), None);
        assert_eq!(split_key(&"0.".repeat(31)), None);
        assert_eq!(split_key(&"0.".repeat(32)), Some((0, "")));
    }
}
