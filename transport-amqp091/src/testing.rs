//! Support for tests that need a running broker: one reading of `REQUIRE_BROKER`, and a
//! skip notice the test harness cannot swallow. Every broker test in this workspace uses
//! it, and a user's own broker tests can too.
//!
//! Without a broker, a test is skipped loudly; with `REQUIRE_BROKER` set to anything but
//! empty or `0` (as CI sets it), it fails instead, so a broker test can never skip silently.
//!
//! ```no_run
//! use transport_amqp091::testing;
//!
//! fn broker_answers() -> Result<(), String> {
//!     Err("connection refused".into())
//! }
//!
//! if let Err(why) = broker_answers() {
//!     testing::no_broker("my broker test", &why); // panics when REQUIRE_BROKER is set
//!     return;
//! }
//! ```

use std::io::Write;

/// The environment variable that makes broker tests mandatory.
pub const REQUIRE_BROKER: &str = "REQUIRE_BROKER";

/// Whether `REQUIRE_BROKER` is set to something other than empty or `0`.
pub fn broker_required() -> bool {
    std::env::var(REQUIRE_BROKER).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Writes to the process's standard error directly: `eprint!` is captured by the test
/// harness for passing tests, a write to the handle is not.
pub fn print_uncaptured(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(text.as_bytes());
    let _ = stderr.flush();
}

/// A broker test found no broker (`why`): with `REQUIRE_BROKER` set this panics; otherwise
/// it prints a loud notice that `what` is skipped, past the harness's capture, and returns
/// so that the test can return early.
pub fn no_broker(what: &str, why: &str) {
    if broker_required() {
        panic!("{REQUIRE_BROKER} is set, but no broker answers for {what}: {why}");
    }
    print_uncaptured(&format!(
        "\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n\
         !!! SKIPPED {what}: no broker ({why}).\n\
         !!! Start RabbitMQ (with rabbitmq_amqp1_0 enabled), or set {REQUIRE_BROKER}=1 to\n\
         !!! make this a failure.\n\
         !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n"
    ));
}
