//! The skip policy: a test without its broker is skipped loudly, or fails where the broker is
//! required.

use std::io::Write;

/// The environment variable that makes RabbitMQ tests mandatory: set to anything but empty
/// or `0` (as CI sets it), a missing broker fails the test instead of skipping it.
pub const REQUIRE_BROKER: &str = "REQUIRE_BROKER";

/// The environment variable that makes NATS tests mandatory (a server with JetStream).
pub const REQUIRE_NATS: &str = "REQUIRE_NATS";

/// The environment variable that makes the RabbitMQ cluster tests mandatory (CI sets it
/// after `stress/cluster.sh up`).
pub const REQUIRE_CLUSTER: &str = "REQUIRE_CLUSTER";

/// The environment variable that makes the NATS cluster tests mandatory (CI sets it after
/// `stress/nats-cluster.sh up`).
pub const REQUIRE_NATS_CLUSTER: &str = "REQUIRE_NATS_CLUSTER";

/// The environment variable that makes the TLS tests mandatory (CI sets it after
/// `stress/tls-node.sh up`).
pub const REQUIRE_TLS: &str = "REQUIRE_TLS";

/// Whether the environment variable `var` is set to something other than empty or `0`: the
/// one reading of every `REQUIRE_*` variable.
///
/// ```
/// // An unset variable requires nothing.
/// assert!(!test_brokers::required("TEST_BROKERS_DOC_UNSET"));
/// ```
pub fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Whether [`REQUIRE_BROKER`] is set to something other than empty or `0`.
pub fn broker_required() -> bool {
    required(REQUIRE_BROKER)
}

/// Writes to the process's standard error directly: `eprint!` is captured by the test
/// harness for passing tests, a write to the handle is not.
pub fn print_uncaptured(text: &str) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_all(text.as_bytes());
    let _ = stderr.flush();
}

/// A test cannot run (`what`, because of `why`): when `required_by` is [`required`] this
/// panics; otherwise it prints a loud notice past the harness's capture, with `remedy` (how
/// to provide what is missing), and returns so that the test can return early.
///
/// ```no_run
/// use test_brokers::{REQUIRE_TLS, skip};
///
/// skip(REQUIRE_TLS, "my TLS test", "no TLS node on 127.0.0.1:5676", "Start one with `stress/tls-node.sh up`");
/// ```
pub fn skip(required_by: &str, what: &str, why: &str, remedy: &str) {
    assert!(
        !required(required_by),
        "{required_by} is set, but {what} cannot run: {why}"
    );
    let rule = "!".repeat(79);
    print_uncaptured(&format!(
        "\n{rule}\n!!! SKIPPED {what}: {why}.\n!!! {remedy}, or set {required_by}=1 to make this a failure.\n{rule}\n"
    ));
}

/// A RabbitMQ test found no broker (`why`): with [`REQUIRE_BROKER`] set this panics;
/// otherwise it prints a loud notice that `what` is skipped, past the harness's capture, and
/// returns so that the test can return early.
///
/// ```no_run
/// fn broker_answers() -> Result<(), String> {
///     Err("connection refused".into())
/// }
///
/// if let Err(why) = broker_answers() {
///     test_brokers::no_broker("my broker test", &why); // panics when REQUIRE_BROKER is set
///     return;
/// }
/// ```
pub fn no_broker(what: &str, why: &str) {
    skip(
        REQUIRE_BROKER,
        what,
        &format!("no broker ({why})"),
        "Start RabbitMQ (with rabbitmq_amqp1_0 enabled)",
    );
}

/// A NATS test found no server with JetStream (`why`): with [`REQUIRE_NATS`] set this
/// panics; otherwise it prints a loud notice that `what` is skipped and returns.
///
/// ```no_run
/// test_brokers::no_nats("my NATS test", "connection refused at nats://127.0.0.1:4222");
/// ```
pub fn no_nats(what: &str, why: &str) {
    skip(
        REQUIRE_NATS,
        what,
        &format!("no NATS server with JetStream ({why})"),
        "Start `nats-server -js`",
    );
}
