//! Policy building, validation, schedules and configuration files.

use std::time::Duration;

use retry_proto::*;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[test]
fn the_two_source_configurations() {
    let levels = RetryPolicy::delays([secs(30), secs(600), secs(3600)])
        .build()
        .unwrap();
    assert_eq!(levels.max_attempts(), 4);
    assert_eq!(
        levels.base_delays().collect::<Vec<_>>(),
        [secs(30), secs(600), secs(3600)]
    );
    assert_eq!(levels.on_exhausted(), Exhausted::DeadLetter);

    let spring = RetryPolicy::exponential(secs(1), 3.0, secs(10))
        .with_max_attempts(5)
        .build()
        .unwrap();
    assert_eq!(
        spring.base_delays().collect::<Vec<_>>(),
        [secs(1), secs(3), secs(9), secs(10)]
    );
    let plan = TopologyPlan::new("q", &spring).unwrap();
    let delay_queues = plan
        .queues()
        .iter()
        .filter(|q| matches!(q.role, QueueRole::Delay { .. }))
        .count();
    assert_eq!(delay_queues, 4);
}

#[test]
fn documented_defaults() {
    let p = RetryPolicy::default();
    assert_eq!(p.max_attempts(), 5);
    assert_eq!(
        p.backoff(),
        &Backoff::Exponential {
            initial: secs(1),
            multiplier: 2.0,
            max: secs(300)
        }
    );
    assert_eq!(p.jitter(), Jitter::None);
    assert_eq!(p.max_elapsed(), None);
    assert_eq!(
        (p.immediate_retries(), p.immediate_wait()),
        (0, Duration::ZERO)
    );
    assert_eq!(p.crash_limit(), 3);
    assert_eq!(p.on_crash(), CrashAction::Divert);
    assert_eq!(p.crash_delay(), secs(1));
    assert_eq!(p.crash_delay_level(), Some(secs(1)));
    assert_eq!(p.on_exhausted(), Exhausted::DeadLetter);
    assert_eq!(p.publish_retries(), 3);
    assert_eq!(p.publish_retry_budget(), Duration::from_millis(700));
}

#[test]
fn publish_retry_waits_double_and_stay_bounded() {
    let p = RetryPolicy::builder()
        .with_publish_retries(40, Duration::from_secs(1))
        .build()
        .unwrap();
    assert_eq!(p.publish_retry_wait(1), secs(1));
    assert_eq!(p.publish_retry_wait(3), secs(4));
    assert_eq!(
        p.publish_retry_wait(40),
        MAX_TTL,
        "capped, never overflowing"
    );
    let none = RetryPolicy::builder()
        .with_publish_retries(0, Duration::ZERO)
        .build()
        .unwrap();
    assert_eq!(none.publish_retry_budget(), Duration::ZERO);
}

#[test]
fn invalid_policies_name_their_field() {
    let too_long = MAX_TTL + Duration::from_millis(1);
    let cases: Vec<(RetryPolicyBuilder, &str)> = vec![
        (RetryPolicy::builder().with_max_attempts(0), "max_attempts"),
        (
            RetryPolicy::exponential(secs(1), 0.5, secs(10)),
            "backoff.multiplier",
        ),
        (
            RetryPolicy::exponential(secs(1), f64::NAN, secs(10)),
            "backoff.multiplier",
        ),
        (
            RetryPolicy::exponential(secs(10), 2.0, secs(1)),
            "backoff.max",
        ),
        (
            RetryPolicy::builder().with_backoff(Backoff::Linear {
                initial: secs(10),
                step: secs(1),
                max: secs(5),
            }),
            "backoff.max",
        ),
        (RetryPolicy::delays([]), "backoff.delays"),
        (
            RetryPolicy::delays([secs(1), too_long]),
            "backoff.delays[1]",
        ),
        (RetryPolicy::fixed(too_long), "backoff.delay"),
        (
            RetryPolicy::exponential(secs(1), 2.0, too_long),
            "backoff.max",
        ),
        (
            RetryPolicy::builder().with_crash_delay(too_long),
            "crash_delay",
        ),
        (
            RetryPolicy::builder().with_immediate_retries(1, too_long),
            "immediate_wait",
        ),
        (
            RetryPolicy::builder().with_max_elapsed(Duration::ZERO),
            "max_elapsed",
        ),
        (
            RetryPolicy::builder().with_publish_retries(2, Duration::ZERO),
            "publish_retry_wait",
        ),
        (
            RetryPolicy::builder().with_publish_retries(2, too_long),
            "publish_retry_wait",
        ),
    ];
    for (builder, field) in cases {
        let err = builder.build().unwrap_err();
        assert_eq!(err.field(), field, "{err}");
        assert!(err.to_string().contains(field), "{err}");
    }
    // The limit itself is fine.
    RetryPolicy::fixed(MAX_TTL).build().unwrap();
}

#[test]
fn schedule_mixes_immediate_and_delayed_retries() {
    let p = RetryPolicy::fixed(secs(5))
        .with_max_attempts(4)
        .with_immediate_retries(1, Duration::from_millis(10))
        .build()
        .unwrap();
    assert_eq!(
        p.schedule(0).collect::<Vec<_>>(),
        [
            Retry::Immediate {
                wait: Duration::from_millis(10)
            },
            Retry::Delayed {
                delay: secs(5),
                index: 0
            },
            Retry::Delayed {
                delay: secs(5),
                index: 1
            },
        ]
    );
    // More immediate retries than attempts: everything is in-process.
    let p = RetryPolicy::builder()
        .with_max_attempts(3)
        .with_immediate_retries(10, Duration::ZERO)
        .build()
        .unwrap();
    assert_eq!(p.delayed_retries(), 0);
    assert_eq!(p.delay_bounds(), None);
    assert_eq!(p.crash_delay(), secs(1));
    assert_eq!(p.delay_levels(), [], "the crash delay is not a retry level");
    assert_eq!(p.crash_delay_level(), Some(secs(1)));
}

#[test]
fn backoff_shapes() {
    let linear = Backoff::Linear {
        initial: secs(1),
        step: secs(2),
        max: secs(6),
    };
    assert_eq!(
        (0..5).map(|i| linear.delay(i)).collect::<Vec<_>>(),
        [secs(1), secs(3), secs(5), secs(6), secs(6)]
    );
    let list = Backoff::List(vec![secs(30), secs(600)]);
    assert_eq!(list.delay(5), secs(600), "past the end reuses the last");
    let huge = Backoff::Exponential {
        initial: secs(1),
        multiplier: 10.0,
        max: secs(100),
    };
    assert_eq!(huge.delay(u32::MAX), secs(100));
    assert_eq!(
        Backoff::Fixed(Duration::from_micros(1500)).delay(0),
        Duration::from_millis(1)
    );
}

#[test]
fn a_long_list_with_fewer_attempts_only_plans_the_delays_it_uses() {
    let p = RetryPolicy::delays([secs(1), secs(2), secs(3)])
        .with_max_attempts(2)
        .build()
        .unwrap();
    assert_eq!(p.delay_levels(), [secs(1)]);
}

#[cfg(feature = "serde")]
mod config {
    use super::*;

    #[test]
    fn toml_and_json_give_the_same_policies_as_code() {
        let spring: RetryPolicy = toml::from_str(
            r#"
            max_attempts = 5
            [backoff]
            kind = "exponential"
            initial = "1s"
            multiplier = 3.0
            max = "10s"
            "#,
        )
        .unwrap();
        assert_eq!(
            spring,
            RetryPolicy::exponential(secs(1), 3.0, secs(10))
                .with_max_attempts(5)
                .build()
                .unwrap()
        );

        let levels: RetryPolicy = serde_json::from_str(
            r#"{"backoff": {"kind": "list", "delays": ["30s", "10m", "1h"]}}"#,
        )
        .unwrap();
        assert_eq!(
            levels,
            RetryPolicy::delays([secs(30), secs(600), secs(3600)])
                .build()
                .unwrap()
        );

        let full: RetryPolicy = toml::from_str(
            r#"
            max_attempts = 8
            jitter = "decorrelated"
            max_elapsed = "2h 30m"
            immediate_retries = 2
            immediate_wait = "250ms"
            crash_limit = 5
            on_crash = "run-handler"
            crash_delay = "45s"
            on_exhausted = "drop"
            publish_retries = 5
            publish_retry_wait = "50ms"
            backoff = { kind = "linear", initial = "1s", step = "1s", max = "1m" }
            "#,
        )
        .unwrap();
        assert_eq!(
            full,
            RetryPolicy::builder()
                .with_max_attempts(8)
                .with_backoff(Backoff::Linear {
                    initial: secs(1),
                    step: secs(1),
                    max: secs(60)
                })
                .with_jitter(Jitter::Decorrelated)
                .with_max_elapsed(secs(9000))
                .with_immediate_retries(2, Duration::from_millis(250))
                .with_crash_limit(5)
                .with_on_crash(CrashAction::RunHandler)
                .with_crash_delay(secs(45))
                .with_on_exhausted(Exhausted::Drop)
                .with_publish_retries(5, Duration::from_millis(50))
                .build()
                .unwrap()
        );
    }

    #[test]
    fn bad_configuration_is_refused_with_the_culprit_named() {
        let cases = [
            (
                r#"backoff = { kind = "list", delays = [] }"#,
                "backoff.delays is empty",
            ),
            (
                r#"backoff = { kind = "fixed", delay = "soon" }"#,
                "string \"soon\", expected a duration",
            ),
            (
                r#"backoff = { kind = "exponential", initial = "1s", multiplier = 0.5, max = "1m" }"#,
                "backoff.multiplier",
            ),
            (
                r#"backoff = { kind = "fixed", delay = "60d" }"#,
                "longer than a broker TTL",
            ),
            (
                "max_atempts = 3\nbackoff = { kind = \"fixed\", delay = \"1s\" }",
                "unknown field `max_atempts`",
            ),
            (r#"jitter = "none""#, "missing field `backoff`"),
            (
                "publish_retry_wait = \"0s\"\nbackoff = { kind = \"fixed\", delay = \"1s\" }",
                "publish_retry_wait must be greater than zero",
            ),
            (
                r#"backoff = { kind = "fibonacci" }"#,
                "unknown variant `fibonacci`",
            ),
        ];
        for (text, expected) in cases {
            let err = toml::from_str::<RetryPolicy>(text).unwrap_err();
            assert!(
                err.to_string().contains(expected),
                "{text}: {err} should mention {expected}"
            );
        }
    }
}

/// Runs `f` on a thread and fails if it has not returned after `limit`: a policy that
/// enumerates every attempt hangs (or exhausts memory) instead of answering.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .expect("still computing: the policy visits every attempt")
}

#[test]
fn retrying_forever_is_expressible_and_cheap() {
    let (policy, plan, late) = within(secs(30), || {
        let policy = RetryPolicy::exponential(secs(1), 2.0, secs(60))
            .with_max_attempts(u32::MAX)
            .with_jitter(Jitter::Decorrelated)
            .build()
            .unwrap();
        let plan = TopologyPlan::new("forever", &policy).unwrap();
        // A retry far down the schedule, decorrelated jitter included.
        let late = policy.delay(u32::MAX - 2, 7);
        (policy, plan, late)
    });
    assert_eq!(policy.delayed_retries(), u32::MAX - 1);
    assert_eq!(
        policy.delay_levels(),
        [1, 2, 4, 8, 16, 32, 60].map(secs),
        "one level per distinct delay"
    );
    assert_eq!(plan.delay_routes().len(), 7);
    assert!(late >= secs(1) && late <= secs(60), "{late:?}");
    assert_eq!(policy.delay_bounds(), Some((secs(1), secs(60))));

    // A list reused past its end, and a fixed delay, also stay small.
    let list = within(secs(30), || {
        RetryPolicy::delays([secs(5), secs(1), secs(5)])
            .with_max_attempts(u32::MAX)
            .build()
            .unwrap()
    });
    assert_eq!(list.delay_levels(), [secs(1), secs(5)]);
    assert_eq!(list.delay_bounds(), Some((secs(1), secs(5))));
    let fixed = within(secs(30), || {
        RetryPolicy::fixed(secs(3))
            .with_max_attempts(u32::MAX)
            .build()
            .unwrap()
    });
    assert_eq!(fixed.delay_levels(), [secs(3)]);
}

#[test]
fn a_backoff_that_would_declare_thousands_of_queues_is_refused() {
    // 10 ms steps from 10 ms to 1 min: 6,000 distinct delays over 9,999 delayed retries.
    let linear = within(secs(30), || {
        RetryPolicy::builder()
            .with_backoff(Backoff::Linear {
                initial: Duration::from_millis(10),
                step: Duration::from_millis(10),
                max: secs(60),
            })
            .with_max_attempts(10_000)
            .build()
    });
    let err = linear.unwrap_err();
    assert_eq!(
        err,
        PolicyError::TooManyDelayLevels {
            field: "backoff.step",
            count: 6_000,
            retries: 9_999,
            max: MAX_DELAY_LEVELS,
        }
    );
    assert_eq!(err.field(), "backoff.step");
    let text = err.to_string();
    assert!(
        text.contains("backoff.step gives 6000 distinct delays"),
        "{text}"
    );
    assert!(text.contains("64 delay queues"), "{text}");

    // Retrying forever with a 1 ms step: the count saturates instead of running on.
    let forever = within(secs(30), || {
        RetryPolicy::builder()
            .with_backoff(Backoff::Linear {
                initial: Duration::from_millis(1),
                step: Duration::from_millis(1),
                max: MAX_TTL,
            })
            .with_max_attempts(u32::MAX)
            .build()
    });
    let err = forever.unwrap_err();
    assert!(
        matches!(err, PolicyError::TooManyDelayLevels { count: 100_000, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("at least 100000"), "{err}");

    // A multiplier barely above 1 spreads the delays just as thin.
    let err = RetryPolicy::exponential(Duration::from_millis(100), 1.001, secs(3600))
        .with_max_attempts(u32::MAX)
        .build()
        .unwrap_err();
    assert_eq!(err.field(), "backoff.multiplier");

    // An explicit list of 65 distinct delays.
    let err = RetryPolicy::delays((1..=65).map(secs)).build().unwrap_err();
    assert_eq!(
        err,
        PolicyError::TooManyDelayLevels {
            field: "backoff.delays",
            count: 65,
            retries: 65,
            max: MAX_DELAY_LEVELS,
        }
    );

    // Exactly the cap is fine.
    let p = RetryPolicy::delays((1..=64).map(secs)).build().unwrap();
    assert_eq!(p.delay_levels().len(), MAX_DELAY_LEVELS);
}

#[test]
fn each_jitter_spreads_delays_across_messages() {
    let base = secs(10);
    for jitter in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated] {
        // Decorrelated jitter grows from the first delay towards the largest: give it room.
        let backoff = match jitter {
            Jitter::Decorrelated => RetryPolicy::exponential(secs(1), 2.0, secs(60)),
            _ => RetryPolicy::fixed(base),
        };
        let p = backoff
            .with_jitter(jitter)
            .with_max_attempts(4)
            .build()
            .unwrap();
        // The second delayed retry: decorrelated jitter keeps the first at the base.
        let delays: std::collections::BTreeSet<Duration> =
            (0..200u64).map(|seed| p.delay(1, seed)).collect();
        assert!(
            delays.len() >= 50,
            "{jitter:?} gave only {} distinct delays over 200 messages",
            delays.len()
        );
        let (lo, hi) = (*delays.first().unwrap(), *delays.last().unwrap());
        match jitter {
            Jitter::Full => {
                assert!(hi <= base);
                assert!(lo < base / 4 && hi > base * 3 / 4, "{lo:?}..{hi:?}");
            }
            Jitter::Equal => {
                assert!(lo >= base / 2 && hi <= base, "{lo:?}..{hi:?}");
                assert!(lo < base * 6 / 10 && hi > base * 9 / 10, "{lo:?}..{hi:?}");
            }
            // Decorrelated: uniform(first, previous × 3), after a first delay of 1 s.
            _ => {
                assert!(lo >= secs(1) && hi <= secs(3), "{lo:?}..{hi:?}");
                let spread = Duration::from_millis(1_500)..Duration::from_millis(2_500);
                assert!(lo < spread.start && hi > spread.end, "{lo:?}..{hi:?}");
            }
        }
    }
}
