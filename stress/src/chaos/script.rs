//! What each message of a chaos run does when its handler runs, written into its id so that
//! every consumer process, the driver and a reader of the journal agree without sharing
//! anything else.
//!
//! An id is `m<index>-<class>`: `m00042-once` fails on its first attempt and succeeds after.
//! The attempt is the engine's (from the message's headers), so the script holds across
//! processes and redeliveries.

use std::time::Duration;

use retry_core::{DeadLetterReason, RetryPolicy, splitmix64};

/// What a message's handler does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Succeeds.
    Ok,
    /// Fails (transiently) on its first attempt, then succeeds.
    Once,
    /// Fails transiently on every attempt: parked `attempts-exhausted`.
    Always,
    /// Fails permanently: parked `permanent`.
    Permanent,
    /// Aborts the process whenever it runs: parked `crash-loop`.
    Poison,
}

/// What one handler run does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Does {
    /// Returns success.
    Succeed,
    /// Returns a transient failure.
    Fail,
    /// Returns a permanent failure.
    Permanent,
    /// Aborts the process.
    Abort,
}

impl Does {
    /// Its word in the journal.
    pub fn word(self) -> &'static str {
        match self {
            Does::Succeed => "succeed",
            Does::Fail => "fail",
            Does::Permanent => "permanent",
            Does::Abort => "abort",
        }
    }
}

impl Class {
    /// Every class.
    pub const ALL: [Class; 5] = [
        Class::Ok,
        Class::Once,
        Class::Always,
        Class::Permanent,
        Class::Poison,
    ];

    /// Its word in ids.
    pub fn word(self) -> &'static str {
        match self {
            Class::Ok => "ok",
            Class::Once => "once",
            Class::Always => "always",
            Class::Permanent => "perm",
            Class::Poison => "poison",
        }
    }

    /// The class an id names.
    pub fn of(id: &str) -> Option<Class> {
        let word = id.rsplit_once('-')?.1;
        Class::ALL.into_iter().find(|c| c.word() == word)
    }

    /// What its handler does on `attempt` (1-based).
    pub fn does(self, attempt: u32) -> Does {
        match self {
            Class::Ok => Does::Succeed,
            Class::Once if attempt <= 1 => Does::Fail,
            Class::Once => Does::Succeed,
            Class::Always => Does::Fail,
            Class::Permanent => Does::Permanent,
            Class::Poison => Does::Abort,
        }
    }

    /// Whether its handler eventually succeeds: such a message must be handled, and must
    /// never be charged a crash.
    pub fn healthy(self) -> bool {
        matches!(self, Class::Ok | Class::Once)
    }

    /// Why it must end parked, if it must.
    pub fn parked_reason(self) -> Option<DeadLetterReason> {
        match self {
            Class::Ok | Class::Once => None,
            Class::Always => Some(DeadLetterReason::AttemptsExhausted),
            Class::Permanent => Some(DeadLetterReason::Permanent),
            Class::Poison => Some(DeadLetterReason::CrashLoop),
        }
    }
}

/// The id of message `index` of class `class`.
pub fn id(index: usize, class: Class) -> String {
    format!("m{index:05}-{}", class.word())
}

/// How a run's messages are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mix {
    /// Share that fail once.
    pub once: f64,
    /// Share that always fail.
    pub always: f64,
    /// Share that fail permanently.
    pub permanent: f64,
    /// How many poison messages, placed at random.
    pub poison: usize,
}

impl Mix {
    /// The issue's mix: 20 % fail once, 10 % always fail, 10 % fail permanently, and
    /// `poison` poison messages.
    pub fn issue(poison: usize) -> Self {
        Mix {
            once: 0.2,
            always: 0.1,
            permanent: 0.1,
            poison,
        }
    }

    /// The ids of `n` messages drawn from `seed`.
    pub fn ids(&self, n: usize, seed: u64) -> Vec<String> {
        let mut state = seed;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            splitmix64(state)
        };
        let mut classes: Vec<Class> = (0..n)
            .map(|_| {
                let x = (next() >> 11) as f64 / (1u64 << 53) as f64;
                if x < self.once {
                    Class::Once
                } else if x < self.once + self.always {
                    Class::Always
                } else if x < self.once + self.always + self.permanent {
                    Class::Permanent
                } else {
                    Class::Ok
                }
            })
            .collect();
        let mut placed = 0;
        while placed < self.poison.min(n) {
            let at = (next() % n as u64) as usize;
            if classes[at] != Class::Poison {
                classes[at] = Class::Poison;
                placed += 1;
            }
        }
        classes
            .into_iter()
            .enumerate()
            .map(|(i, c)| id(i, c))
            .collect()
    }
}

/// The retry policy of every chaos run: two delayed retries (so three attempts), the crash
/// delay and the crash limit given.
pub fn policy(crash_limit: u32, delay: Duration) -> RetryPolicy {
    RetryPolicy::delays([delay, delay * 2])
        .with_crash_limit(crash_limit)
        .with_crash_delay(delay)
        .build()
        .expect("a valid chaos policy")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_their_class_and_a_seed_gives_the_same_mix() {
        let mix = Mix::issue(3);
        let ids = mix.ids(2000, 7);
        assert_eq!(ids, mix.ids(2000, 7));
        let count = |c: Class| ids.iter().filter(|id| Class::of(id) == Some(c)).count();
        assert_eq!(count(Class::Poison), 3);
        assert!(
            (300..500).contains(&count(Class::Once)),
            "{}",
            count(Class::Once)
        );
        assert!((120..280).contains(&count(Class::Always)));
        assert_eq!(ids.len(), Class::ALL.into_iter().map(count).sum::<usize>());
        assert_eq!(Class::of("m00001-perm"), Some(Class::Permanent));
        assert_eq!(Class::Once.does(1), Does::Fail);
        assert_eq!(Class::Once.does(2), Does::Succeed);
    }
}
