//! The scenario set as values, and the macro that makes one test per scenario for a
//! transport.
//!
//! [`conformance_tests!`](crate::conformance_tests) is how a transport runs the suite: it
//! expands to a module with one `#[test]` per scenario, each running [`run_test`] on a
//! harness the caller builds, and one more test that checks the transport's expected
//! skips name real scenarios. [`all`] and [`NAMES`] give the same scenarios as values, for
//! callers that run them some other way.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::harness::Harness;
pub use crate::verdict::Verdict;

pub use test_brokers::print_uncaptured;

/// A scenario function, boxed so one type holds every scenario.
pub type ScenarioFn<H> = for<'a> fn(&'a H) -> BoxFuture<'a, Verdict>;

/// A named scenario, ready to run on a harness of type `H`.
pub struct Scenario<H> {
    name: &'static str,
    run: ScenarioFn<H>,
}

impl<H> Scenario<H> {
    /// A scenario called `name` that `run` runs. The scenarios of this crate are made by
    /// [`all`] and [`conformance_tests!`](crate::conformance_tests).
    pub const fn new(name: &'static str, run: ScenarioFn<H>) -> Self {
        Scenario { name, run }
    }

    /// Its name: the name of its function in [`scenarios`](crate::scenarios), and of its
    /// test.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Runs it on `h`.
    pub fn run<'a>(&self, h: &'a H) -> BoxFuture<'a, Verdict> {
        (self.run)(h)
    }
}

impl<H> Clone for Scenario<H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H> Copy for Scenario<H> {}

impl<H> fmt::Debug for Scenario<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scenario")
            .field("name", &self.name)
            .finish()
    }
}

macro_rules! names {
    (() [$($name:ident),* $(,)?]) => {
        &[$(stringify!($name)),*]
    };
}

/// Every scenario's name, in list order.
pub const NAMES: &[&str] = crate::for_each_scenario!(names =>);

// Every public function of src/scenarios.rs is in its for_each_scenario! list: checked
// while compiling, so a scenario cannot be left out of the tests.
const _: () = assert_all_listed(include_str!("scenarios.rs"), NAMES);

macro_rules! scenarios {
    (() [$($name:ident),* $(,)?]) => {
        vec![$(Scenario::new(
            stringify!($name),
            |h| Box::pin(crate::scenarios::$name(h)),
        )),*]
    };
}

/// Every scenario, in list order.
///
/// ```
/// use conformance::{MemoryHarness, Verdict, suite};
/// # let expected = retry_core::Capabilities {
/// #     publisher_confirms: true,
/// #     delivery_count: true,
/// #     native_delays: false,
/// #     dead_letter_exchange: true,
/// #     declares_topology: true,
/// # };
///
/// let scenarios = suite::all::<MemoryHarness>();
/// assert_eq!(scenarios.len(), suite::NAMES.len());
/// let permanent = scenarios.iter().find(|s| s.name() == "permanent_parked").unwrap();
/// let h = MemoryHarness::new(expected);
/// assert!(matches!(h.block_on(permanent.run(&h)), Verdict::Passed { .. }));
/// ```
pub fn all<H: Harness>() -> Vec<Scenario<H>> {
    crate::for_each_scenario!(scenarios =>)
}

/// The body of every test [`conformance_tests!`](crate::conformance_tests) makes: runs
/// `scenario` with `run`, and checks that it skipped if and only if `expected_skips` names
/// it. `test` names the test in messages.
///
/// `run` builds a harness of its own for the scenario, runs it and cleans up. It returns
/// the [`Verdict`], or `None` when the transport is not there to test (a broker test
/// without a broker, after saying so loudly; see
/// [`BrokerEnv::detect`](crate::rabbitmq::BrokerEnv::detect)): then the test passes
/// without checking anything.
///
/// A skip prints its reason past the test harness's output capture, so every run shows
/// it; a pass prints what it observed on the captured output (shown with
/// `-- --nocapture`). A failure is the scenario's own panic.
pub fn run_test<H, R>(
    test: &str,
    scenario: Scenario<H>,
    expected_skips: &[&str],
    run: impl FnOnce(Scenario<H>) -> R,
) where
    H: Harness,
    R: Into<Option<Verdict>>,
{
    let skip_expected = expected_skips.contains(&scenario.name());
    let Some(verdict) = run(scenario).into() else {
        return;
    };
    match verdict {
        Verdict::Skipped { reason } => {
            assert!(
                skip_expected,
                "{test} skipped, but its transport's expected skips do not list it: {reason}"
            );
            print_uncaptured(&format!("\n{test}: SKIPPED, as expected: {reason}\n"));
        }
        Verdict::Passed { notes } => {
            assert!(
                !skip_expected,
                "{test} passed, but its transport's expected skips list it: the transport gained what it needs, so take it off that list"
            );
            println!("{test}: passed: {}", notes.join("; "));
        }
    }
}

/// Panics unless every name in `expected_skips` is a scenario: a misspelt or removed name
/// in a transport's expected skips would otherwise never be checked.
pub fn assert_skips_are_scenarios(expected_skips: &[&str]) {
    let unknown: Vec<&str> = expected_skips
        .iter()
        .copied()
        .filter(|name| !NAMES.contains(name))
        .collect();
    assert!(
        unknown.is_empty(),
        "expected skips that are not scenarios: {unknown:?}; the scenarios are {NAMES:?}"
    );
}

/// Runs `scenario` on `h` within `limit`, then cleans `h` up whether the scenario passed,
/// failed or ran out of time, and only then raises a failure. The time limit is tokio's:
/// call it on a tokio runtime with its timer on.
pub async fn run_and_clean_up<H: Harness>(
    h: &H,
    scenario: Scenario<H>,
    limit: Duration,
) -> Verdict {
    let ran = tokio::time::timeout(limit, AssertUnwindSafe(scenario.run(h)).catch_unwind()).await;
    h.cleanup().await;
    match ran {
        Ok(Ok(verdict)) => verdict,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{} did not finish within {limit:?}", scenario.name()),
    }
}

/// Panics, naming it, at the first public function in `source` (the text of
/// `src/scenarios.rs`) that `names` does not list. A `const` item calls it on that file,
/// so a scenario missing from [`for_each_scenario!`](crate::for_each_scenario) stops the
/// crate from compiling. A public function is a line that starts, after indentation, with
/// `pub fn ` or `pub async fn `.
pub(crate) const fn assert_all_listed(source: &str, names: &[&str]) {
    let src = source.as_bytes();
    let mut line = 0;
    while line < src.len() {
        let mut at = line;
        while at < src.len() && (src[at] == b' ' || src[at] == b'\t') {
            at += 1;
        }
        let start = if starts_with(src, at, b"pub fn ") {
            Some(at + b"pub fn ".len())
        } else if starts_with(src, at, b"pub async fn ") {
            Some(at + b"pub async fn ".len())
        } else {
            None
        };
        if let Some(start) = start {
            let mut end = start;
            while end < src.len() && (src[end].is_ascii_alphanumeric() || src[end] == b'_') {
                end += 1;
            }
            if !listed(src, start, end, names) {
                not_listed(src, start, end);
            }
        }
        while line < src.len() && src[line] != b'\n' {
            line += 1;
        }
        line += 1;
    }
}

const fn starts_with(src: &[u8], at: usize, prefix: &[u8]) -> bool {
    if at + prefix.len() > src.len() {
        return false;
    }
    let mut i = 0;
    while i < prefix.len() {
        if src[at + i] != prefix[i] {
            return false;
        }
        i += 1;
    }
    true
}

const fn listed(src: &[u8], start: usize, end: usize, names: &[&str]) -> bool {
    let mut i = 0;
    while i < names.len() {
        let name = names[i].as_bytes();
        if name.len() == end - start && starts_with(src, start, name) {
            return true;
        }
        i += 1;
    }
    false
}

const fn not_listed(src: &[u8], start: usize, end: usize) -> ! {
    const BEFORE: &[u8] = b"the public function `";
    const AFTER: &[u8] = b"` of src/scenarios.rs is not in for_each_scenario!: every public function there is a scenario, list it there";
    let mut message = [0u8; 512];
    let mut len = 0;
    let mut i = 0;
    while i < BEFORE.len() {
        message[len] = BEFORE[i];
        len += 1;
        i += 1;
    }
    i = start;
    while i < end && len < 256 {
        message[len] = src[i];
        len += 1;
        i += 1;
    }
    i = 0;
    while i < AFTER.len() {
        message[len] = AFTER[i];
        len += 1;
        i += 1;
    }
    match std::str::from_utf8(message.split_at(len).0) {
        Ok(text) => panic!("{}", text),
        Err(_) => panic!("a public function of src/scenarios.rs is not in for_each_scenario!"),
    }
}

/// Makes one `#[test]` per scenario for a transport: a module named `$module` holding a
/// test named after each scenario, plus `expected_skips_are_scenarios`.
///
/// ```text
/// conformance_tests! {
///     /// Docs for the module.
///     mod MODULE {
///         harness: HARNESS_TYPE,
///         run: RUNNER,
///         skips: EXPECTED_SKIPS,
///     }
/// }
/// ```
///
/// * `harness`: the [`Harness`] type the scenarios run on.
/// * `run`: an expression callable as `FnOnce(Scenario<HARNESS_TYPE>) -> R`, where `R` is
///   a [`Verdict`] or an `Option<Verdict>` (`None`: the transport is not there to test,
///   say a broker that does not answer). It builds a harness of its own for the one
///   scenario (each test runs on a thread of its own, beside the others), runs it,
///   cleans up, and lets a failure's panic through. Helpers:
///   [`MemoryHarness::run`](crate::MemoryHarness::run), [`run_and_clean_up`].
/// * `skips`: a `&[&str]` of the scenarios this transport is expected to skip. Each test
///   fails if its scenario skipped and is not listed, or is listed and did not skip.
///
/// The module imports everything of the module around it (`use super::*`), so the
/// expressions can name what the test file defines or imports.
///
/// The tests are `MODULE::SCENARIO`: `cargo test -p conformance seeded_storm` runs one
/// scenario on every transport, `--test FILE` one transport.
///
/// ```
/// mod expected {
///     use retry_core::Capabilities;
///
///     pub const MEMORY: Capabilities = Capabilities {
///         publisher_confirms: true,
///         delivery_count: true,
///         native_delays: false,
///         dead_letter_exchange: true,
///         declares_topology: true,
///     };
///     pub const MEMORY_SKIPS: &[&str] = &[];
/// }
///
/// use conformance::MemoryHarness;
///
/// conformance::conformance_tests! {
///     /// Every scenario on transport-memory.
///     mod scenario {
///         harness: MemoryHarness,
///         run: |s| MemoryHarness::run(s, expected::MEMORY),
///         skips: expected::MEMORY_SKIPS,
///     }
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! conformance_tests {
    (
        $(#[$meta:meta])*
        mod $module:ident {
            harness: $harness:ty,
            run: $run:expr,
            skips: $skips:expr $(,)?
        }
    ) => {
        $crate::for_each_scenario! {
            $crate::__conformance_tests => ($(#[$meta])* $module) ($harness) ($run) ($skips)
        }
    };
}

/// The expansion of [`conformance_tests!`](crate::conformance_tests), called back by
/// [`for_each_scenario!`](crate::for_each_scenario) with the scenarios.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    (
        (($(#[$meta:meta])* $module:ident) ($harness:ty) ($run:expr) ($skips:expr))
        [$($name:ident),* $(,)?]
    ) => {
        $(#[$meta])*
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $(
                #[test]
                fn $name() {
                    $crate::suite::run_test::<$harness, _>(
                        concat!(module_path!(), "::", stringify!($name)),
                        $crate::suite::Scenario::new(stringify!($name), |h| {
                            ::std::boxed::Box::pin($crate::scenarios::$name(h))
                        }),
                        $skips,
                        $run,
                    );
                }
            )*

            /// Every scenario the transport is expected to skip is a scenario.
            #[test]
            fn expected_skips_are_scenarios() {
                $crate::suite::assert_skips_are_scenarios($skips);
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: &str = "//! docs: pub fn in prose\n\
        pub async fn alpha<H: Harness>(h: &H) -> Verdict {}\n\
        \x20   pub fn beta() {}\n\
        fn private() {}\n\
        pub(crate) fn kit() {}\n";

    #[test]
    fn every_public_function_listed_passes() {
        assert_all_listed(SOURCE, &["alpha", "beta"]);
    }

    #[test]
    #[should_panic(expected = "the public function `beta` of src/scenarios.rs")]
    fn a_public_function_not_listed_is_named() {
        assert_all_listed(SOURCE, &["alpha", "beta_two"]);
    }

    #[test]
    fn names_and_all_agree() {
        let all = all::<crate::MemoryHarness>();
        let names: Vec<&str> = all.iter().map(Scenario::name).collect();
        assert_eq!(names, NAMES);
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "a scenario listed twice");
    }

    #[test]
    #[should_panic(expected = "expected skips that are not scenarios: [\"no_such_scenario\"]")]
    fn an_unknown_expected_skip_fails() {
        assert_skips_are_scenarios(&["seeded_storm", "no_such_scenario"]);
    }
}
