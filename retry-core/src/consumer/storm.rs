//! Storm control: when a downstream dies and every handler run fails, stop taking work
//! instead of pushing the whole queue through its delays into the parking queue.

use std::collections::VecDeque;
use std::time::Duration;

use super::config_error::ConsumerConfigError;
use crate::Timestamp;

const DEFAULT_COOL_DOWN: Duration = Duration::from_secs(5);
const DEFAULT_MAX_COOL_DOWN: Duration = Duration::from_secs(60);
const DEFAULT_PROBES: u32 = 3;

/// When to pause the work lane, and how to come back: set with
/// [`ConsumerBuilder::with_storm_control`](crate::ConsumerBuilder::with_storm_control).
///
/// Storm control watches the handler runs of the work lane. A run that fails transiently
/// (a transient error, a `retry_after`, a panic or a timeout) counts as a failure, a
/// success as a success; a permanent failure is the message's fault, not the downstream's,
/// and counts as neither. When the failures trip the threshold, the consumer pauses:
///
/// 1. It takes no new deliveries from the work queue; handlers already running finish and
///    their deliveries are settled as usual. Everything else stays in the broker, so no
///    attempt counter advances. The deliveries the broker already pushed (at most
///    `prefetch`) wait unstarted and unsettled: never requeued, so they never come back
///    redelivered and are never mistaken for crash evidence.
/// 2. After the cool-down it probes: one delivery at a time, oldest first. After `probes`
///    successes in a row it resumes full concurrency.
/// 3. A probe that fails pauses it again, with the cool-down doubled, up to its cap.
///
/// The suspects of the isolation lane already run one at a time and are not held back.
///
/// ```
/// use retry_core::StormControl;
/// use std::time::Duration;
///
/// // Pause after 20 transient failures in a row; probe after 5 s, then 10 s, 20 s, up to
/// // 1 min; resume after 3 probes succeed.
/// let storm = StormControl::consecutive_failures(20)
///     .with_cool_down(Duration::from_secs(5), Duration::from_secs(60))
///     .with_probes(3);
/// assert_eq!(storm.max_cool_down(), Duration::from_secs(60));
///
/// // Or: pause when 90% of the last 50 runs failed.
/// let storm = StormControl::failure_ratio(0.9, 50);
/// # let _ = storm;
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct StormControl {
    trip: Trip,
    cool_down: Duration,
    max_cool_down: Duration,
    probes: u32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Trip {
    Consecutive(u32),
    Ratio { ratio: f64, window: u32 },
}

impl StormControl {
    /// Pauses after `failures` transient failures in a row (at least 1). The cool-down
    /// starts at 5 s and doubles up to 1 min; 3 probe successes resume.
    pub fn consecutive_failures(failures: u32) -> Self {
        StormControl {
            trip: Trip::Consecutive(failures),
            cool_down: DEFAULT_COOL_DOWN,
            max_cool_down: DEFAULT_MAX_COOL_DOWN,
            probes: DEFAULT_PROBES,
        }
    }

    /// Pauses when at least `ratio` (above 0, at most 1) of the last `window` runs (at
    /// least 1) failed transiently, once `window` runs were seen.
    pub fn failure_ratio(ratio: f64, window: u32) -> Self {
        StormControl {
            trip: Trip::Ratio { ratio, window },
            ..StormControl::consecutive_failures(1)
        }
    }

    /// The first cool-down (above zero) and its cap (at least the first). Each failed probe
    /// doubles it, up to the cap.
    pub fn with_cool_down(mut self, first: Duration, max: Duration) -> Self {
        self.cool_down = first;
        self.max_cool_down = max;
        self
    }

    /// Probe successes in a row that resume full concurrency (at least 1).
    pub fn with_probes(mut self, successes: u32) -> Self {
        self.probes = successes;
        self
    }

    /// The longest cool-down.
    pub fn max_cool_down(&self) -> Duration {
        self.max_cool_down
    }

    pub(super) fn check(&self) -> Result<(), ConsumerConfigError> {
        let invalid = |setting: &'static str, expected: &'static str, value: String| {
            Err(ConsumerConfigError::InvalidStormControl {
                setting,
                expected,
                value,
            })
        };
        match self.trip {
            Trip::Consecutive(0) => {
                return invalid("consecutive_failures", "at least 1", "0".into());
            }
            Trip::Ratio { ratio, .. } if !(ratio > 0.0 && ratio <= 1.0) => {
                return invalid("failure_ratio", "above 0 and at most 1", ratio.to_string());
            }
            Trip::Ratio { window: 0, .. } => return invalid("window", "at least 1", "0".into()),
            _ => {}
        }
        if self.cool_down.is_zero() {
            return invalid("cool_down", "above zero", "0s".into());
        }
        if self.max_cool_down < self.cool_down {
            return invalid(
                "max_cool_down",
                "at least the first cool_down",
                format!("{:?} < {:?}", self.max_cool_down, self.cool_down),
            );
        }
        if self.probes == 0 {
            return invalid("probes", "at least 1", "0".into());
        }
        Ok(())
    }
}

/// A change of storm control's state, told to
/// [`ConsumerBuilder::with_on_storm`](crate::ConsumerBuilder::with_on_storm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StormEvent {
    /// The work lane stopped taking deliveries: the failures tripped the threshold, or a
    /// probe failed.
    Paused {
        /// How long until the next probe.
        cool_down: Duration,
    },
    /// The cool-down is over: deliveries are taken one at a time.
    Probing,
    /// Enough probes succeeded: full concurrency again.
    Resumed {
        /// Time since the pause began.
        paused_for: Duration,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    Paused { until: Timestamp },
    Probing { successes: u32 },
}

/// Storm control's state machine. Pure: time comes in as arguments.
#[derive(Debug)]
pub(super) struct Storm {
    control: StormControl,
    state: State,
    /// The last runs, `true` for a failure, in ratio mode.
    window: VecDeque<bool>,
    /// Failures in `window`, or in a row in consecutive mode.
    failures: u32,
    cool_down: Duration,
    paused_at: Timestamp,
}

impl Storm {
    pub(super) fn new(control: StormControl) -> Self {
        Storm {
            cool_down: control.cool_down,
            control,
            state: State::Running,
            window: VecDeque::new(),
            failures: 0,
            paused_at: Timestamp::EPOCH,
        }
    }

    /// How many work deliveries may be held: all of `prefetch`, none while paused, one
    /// while probing.
    pub(super) fn limit(&self, prefetch: u16) -> usize {
        match self.state {
            State::Running => usize::from(prefetch),
            State::Paused { .. } => 0,
            State::Probing { .. } => 1,
        }
    }

    pub(super) fn probing(&self) -> bool {
        matches!(self.state, State::Probing { .. })
    }

    /// When the cool-down ends, while paused.
    pub(super) fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            State::Paused { until } => Some(until),
            _ => None,
        }
    }

    pub(super) fn handle_timeout(&mut self, now: Timestamp) -> Option<StormEvent> {
        match self.state {
            State::Paused { until } if until <= now => {
                self.state = State::Probing { successes: 0 };
                Some(StormEvent::Probing)
            }
            _ => None,
        }
    }

    /// A work-lane handler run ended; `probe` if it was taken while probing. Runs started
    /// before a pause, and permanent failures (`failed` is `None`), change nothing.
    pub(super) fn run_ended(
        &mut self,
        now: Timestamp,
        probe: bool,
        failed: Option<bool>,
    ) -> Option<StormEvent> {
        let failed = failed?;
        match self.state {
            State::Running => {
                if self.tripped(failed) {
                    self.cool_down = self.control.cool_down;
                    self.paused_at = now;
                    return Some(self.pause(now));
                }
                None
            }
            State::Probing { successes } if probe => {
                if failed {
                    self.cool_down = (self.cool_down * 2).min(self.control.max_cool_down);
                    return Some(self.pause(now));
                }
                if successes + 1 < self.control.probes {
                    self.state = State::Probing {
                        successes: successes + 1,
                    };
                    return None;
                }
                self.state = State::Running;
                self.window.clear();
                self.failures = 0;
                Some(StormEvent::Resumed {
                    paused_for: now.saturating_duration_since(self.paused_at),
                })
            }
            State::Paused { .. } | State::Probing { .. } => None,
        }
    }

    fn pause(&mut self, now: Timestamp) -> StormEvent {
        self.state = State::Paused {
            until: now.saturating_add(self.cool_down),
        };
        StormEvent::Paused {
            cool_down: self.cool_down,
        }
    }

    /// Records a run in the running state; whether it trips the threshold.
    fn tripped(&mut self, failed: bool) -> bool {
        match self.control.trip {
            Trip::Consecutive(n) => {
                self.failures = if failed { self.failures + 1 } else { 0 };
                self.failures >= n
            }
            Trip::Ratio { ratio, window } => {
                self.window.push_back(failed);
                self.failures += u32::from(failed);
                if self.window.len() > window as usize && self.window.pop_front() == Some(true) {
                    self.failures -= 1;
                }
                self.window.len() == window as usize
                    && f64::from(self.failures) >= ratio * f64::from(window)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    #[test]
    fn consecutive_failures_trip_and_a_success_resets_the_count() {
        let mut storm = Storm::new(StormControl::consecutive_failures(3));
        assert_eq!(storm.run_ended(at(0), false, Some(true)), None);
        assert_eq!(storm.run_ended(at(0), false, Some(true)), None);
        assert_eq!(storm.run_ended(at(0), false, Some(false)), None);
        assert_eq!(
            storm.run_ended(at(0), false, None),
            None,
            "permanent: neither"
        );
        assert_eq!(storm.run_ended(at(0), false, Some(true)), None);
        assert_eq!(storm.run_ended(at(0), false, Some(true)), None);
        assert_eq!(storm.limit(10), 10);
        let paused = storm.run_ended(at(1), false, Some(true));
        assert_eq!(
            paused,
            Some(StormEvent::Paused {
                cool_down: Duration::from_secs(5)
            })
        );
        assert_eq!(storm.limit(10), 0);
        assert_eq!(storm.poll_timeout(), Some(at(6)));
    }

    #[test]
    fn probes_resume_after_enough_successes_and_failed_probes_double_the_cool_down() {
        let control = StormControl::consecutive_failures(1)
            .with_cool_down(Duration::from_secs(10), Duration::from_secs(25))
            .with_probes(2);
        let mut storm = Storm::new(control);
        storm.run_ended(at(0), false, Some(true));
        assert_eq!(storm.handle_timeout(at(9)), None);
        assert_eq!(storm.handle_timeout(at(10)), Some(StormEvent::Probing));
        assert_eq!(storm.limit(10), 1);
        // A run started before the pause does not count as a probe.
        assert_eq!(storm.run_ended(at(10), false, Some(false)), None);
        let paused = storm.run_ended(at(11), true, Some(true));
        assert_eq!(
            paused,
            Some(StormEvent::Paused {
                cool_down: Duration::from_secs(20)
            })
        );
        storm.handle_timeout(at(31));
        let paused = storm.run_ended(at(32), true, Some(true));
        assert_eq!(
            paused,
            Some(StormEvent::Paused {
                cool_down: Duration::from_secs(25)
            }),
            "capped"
        );
        storm.handle_timeout(at(57));
        assert_eq!(storm.run_ended(at(58), true, Some(false)), None);
        assert_eq!(
            storm.run_ended(at(59), true, Some(false)),
            Some(StormEvent::Resumed {
                paused_for: Duration::from_secs(59)
            })
        );
        assert_eq!(storm.limit(10), 10);
        // The next storm starts from the first cool-down again.
        assert_eq!(
            storm.run_ended(at(60), false, Some(true)),
            Some(StormEvent::Paused {
                cool_down: Duration::from_secs(10)
            })
        );
    }

    #[test]
    fn a_failure_ratio_trips_on_a_full_sliding_window() {
        let mut storm = Storm::new(StormControl::failure_ratio(0.75, 4));
        // [f t t f]: 2 of 4 (and before it, windows not yet full).
        for failed in [false, true, true, false] {
            assert_eq!(storm.run_ended(at(0), false, Some(failed)), None);
        }
        // The window slides to [t t f t]: 3 of 4.
        assert!(matches!(
            storm.run_ended(at(0), false, Some(true)),
            Some(StormEvent::Paused { .. })
        ));
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        let err = |c: StormControl| c.check().unwrap_err().to_string();
        assert_eq!(
            err(StormControl::consecutive_failures(0)),
            "storm_control: consecutive_failures must be at least 1, got 0"
        );
        assert!(
            err(StormControl::failure_ratio(1.5, 10))
                .contains("failure_ratio must be above 0 and at most 1, got 1.5")
        );
        assert!(err(StormControl::failure_ratio(0.5, 0)).contains("window must be at least 1"));
        assert!(err(StormControl::consecutive_failures(1).with_probes(0)).contains("probes"));
        let c = StormControl::consecutive_failures(1)
            .with_cool_down(Duration::from_secs(10), Duration::from_secs(1));
        assert!(err(c).contains("max_cool_down must be at least the first cool_down"));
        assert!(StormControl::failure_ratio(1.0, 3).check().is_ok());
    }
}
