//! `retryctl`: the retry engine's parking lot and topology on a RabbitMQ broker or NATS
//! JetStream, for operators.
//!
//! ```text
//! retryctl parked list     QUEUE [--json] [--limit N] [--reason R] [--id ID]... [--parked-before WHEN] [--parked-after WHEN]
//! retryctl parked show     QUEUE --id ID [--json]
//! retryctl parked replay   QUEUE (--id ID ... | --reason R | --parked-before/--parked-after WHEN | --all) [--rate N] [--dry-run]
//! retryctl parked purge    QUEUE (--id ID ... | --reason R | --parked-before/--parked-after WHEN | --all) --yes
//! retryctl topology plan   QUEUE --policy FILE [--quorum|--classic] [--replication-factor N] [--json]
//! retryctl topology apply  QUEUE --policy FILE [--quorum|--classic] [--replication-factor N]
//! retryctl topology verify QUEUE --policy FILE [--quorum|--classic] [--replication-factor N] [--max-probe-ttl 10s]
//! retryctl serve           QUEUE... [--listen 127.0.0.1:8080] [--token-file FILE] [--refresh 60s] [--index-memory 64MiB] [--preview-bytes 256] [--policy FILE] [--session-idle 30m] [--session-lifetime 8h] [--client-timeout 10s] [--walk-timeout 30s]
//! ```
//!
//! * `parked` walks the work queue's parking queue (`QUEUE.parking`, or `--parking NAME`)
//!   with `retry_core::ParkingLot`: `list` and `show` take nothing, `replay` copies the
//!   selected messages to the work queue with their counters reset (confirmed before the
//!   parked original is removed), `purge` removes them and refuses to run without `--yes`.
//! * `plan` prints the exchanges, queues (with their arguments) and bindings that
//!   `retry_core::TopologyPlan` computes for a work queue and a policy file (the TOML format
//!   of `retry-core`'s `serde` feature). It needs no broker.
//! * `apply` declares them idempotently and says, object by object, which it created and
//!   which already existed as planned.
//! * `verify` checks the broker from outside: every object exists, and a probe sent through
//!   each delay queue, as the engine sends a delayed copy, comes back where the plan says,
//!   dead-lettered as expired. It deletes nothing.
//! * `serve` serves a web console for the parking lots of the work queues: overview,
//!   failure groups, messages, replay and purge, and a JSON API, from an index of each
//!   parking queue kept fresh by walks (see the `serve` module and the guide's
//!   `docs/console.md`). It listens on 127.0.0.1 unless a token is given; every page needs
//!   the token.
//!
//! The broker is `--url`, or `AMQP_URL`, or `amqp://guest:guest@127.0.0.1:5672/%2f`. Its
//! password is never printed: not by `--help`, not in errors, not in reports. Several URLs
//! separated by commas name the nodes of a cluster: `retryctl` connects to the first that
//! answers, and the topology commands plan quorum queues unless `--classic` is given.
//!
//! An `amqps://` URL trusts the platform's CA certificates and checks the URL's host;
//! `--tls-ca FILE` trusts a CA of your own instead, `--tls-cert FILE --tls-key FILE`
//! presents a client certificate, and `--tls-server-name NAME` checks the certificate (and
//! sends SNI) for a name other than the URL's host. Adding `?auth_mechanism=external` to
//! the URL logs in with the client certificate (SASL `EXTERNAL`). These options apply to
//! AMQP 0-9-1 and are refused with another protocol; TLS settings with an `amqp://` URL are
//! refused too. A refused handshake names the check that failed (unknown CA, wrong host
//! name, expired certificate, a port that does not speak TLS, ...): see the guide's
//! `docs/tls.md`.
//!
//! The protocol follows the URL's scheme: `amqp://` and `amqps://` speak AMQP 0-9-1
//! (transport-amqp091), or AMQP 1.0 (transport-amqp10, RabbitMQ's AMQP 1.0 plugin) with
//! `--protocol amqp10` (or `RETRYCTL_PROTOCOL=amqp10`); `nats://` and `tls://` speak NATS
//! JetStream (transport-nats); any other scheme is refused. Over
//! AMQP 1.0 the `parked` commands work as over 0-9-1; `topology apply` is refused (RabbitMQ
//! cannot declare queues over AMQP 1.0: apply over 0-9-1), and `topology verify` checks
//! that every address of the plan exists, without the probes, which need AMQP 0-9-1.
//! RabbitMQ 3.x shows AMQP 1.0 clients none of the headers of a message parked over AMQP
//! 0-9-1: it lists as `unknown`, and a replay over AMQP 1.0 that selects it is refused.
//!
//! On NATS JetStream each queue of the plan is a stream of its own subject. The `parked`
//! commands read the parking stream by sequence (a replayed copy is acknowledged by the
//! stream before the original is deleted), `topology plan` prints the streams and
//! consumers, `apply` creates them (one replica each, or `--replication-factor N`), and
//! `verify` checks each of them, without probes. `--quorum`, `--classic` and
//! `--max-probe-ttl` do not apply there and are refused.
//!
//! Exit codes: 0 success; 1 failure, a mismatch found by `verify` or an unknown queue
//! included; 2 bad usage or bad input (an unknown option, a `purge` without `--yes`, a
//! policy file that does not parse or has an unknown key, a URL scheme no protocol speaks,
//! `topology apply` over AMQP 1.0, a replay over AMQP 1.0 of a message whose headers it
//! cannot see, on NATS an option that does not apply there).
//!
//! A crate of its own: `cargo run -p retryctl -- --help`, or `cargo install --path
//! retryctl` to put it on the `PATH`. The library holds the whole command, so that its
//! decoders (the console's packed index, its form and query parsing) can be fuzzed; its
//! only interface is [`main`].

mod broker;
mod error;
mod nats;
mod parked;
mod policy;
mod protocol;
mod render;
mod serve;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub use serve::fuzzing;
mod topology;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::error::CliError;
use crate::protocol::Protocol;

/// The broker when neither `--url` nor `AMQP_URL` says otherwise.
const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Operate the retry engine's parking lot and topology on RabbitMQ or NATS JetStream.
#[derive(Debug, Parser)]
#[command(name = "retryctl", version)]
struct Cli {
    /// The broker's URL: amqp:// or amqps:// (RabbitMQ), nats:// or tls:// (NATS
    /// JetStream). Its password is never printed: `--help` shows the default redacted, and
    /// hides the value of `AMQP_URL`.
    #[arg(
        long,
        global = true,
        env = "AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = DEFAULT_URL,
        value_name = "URL",
        help = "The broker's URL, amqp:// or amqps:// (RabbitMQ), nats:// or tls:// (NATS \
                JetStream) [default: amqp://guest:****@127.0.0.1:5672/%2f]; its password is \
                never printed"
    )]
    url: String,

    /// The protocol of an amqp:// or amqps:// URL: amqp091 (AMQP 0-9-1, the default) or
    /// amqp10 (AMQP 1.0: no `topology apply`, and `topology verify` without probes); nats for
    /// a nats:// or tls:// URL (NATS JetStream, the scheme's only protocol).
    #[arg(
        long,
        global = true,
        env = "RETRYCTL_PROTOCOL",
        hide_env_values = true,
        value_name = "PROTOCOL"
    )]
    protocol: Option<Protocol>,

    /// A PEM file of CA certificates to trust for an amqps:// URL, in place of the
    /// platform's.
    #[arg(long, global = true, env = "RETRYCTL_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,

    /// A PEM file with the client certificate to present over amqps:// (with --tls-key).
    #[arg(
        long,
        global = true,
        env = "RETRYCTL_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    tls_cert: Option<PathBuf>,

    /// The PEM file of the client certificate's private key (with --tls-cert).
    #[arg(
        long,
        global = true,
        env = "RETRYCTL_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,

    /// The name the broker's certificate is checked against, and sent as SNI, in place of
    /// the URL's host.
    #[arg(
        long,
        global = true,
        env = "RETRYCTL_TLS_SERVER_NAME",
        value_name = "NAME"
    )]
    tls_server_name: Option<String>,

    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// The TLS settings of the `--tls-*` options, if any is given.
    fn tls(&self) -> Option<retry_core::TlsConfig> {
        let given = self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self.tls_key.is_some()
            || self.tls_server_name.is_some();
        if !given {
            return None;
        }
        let mut tls = retry_core::TlsConfig::new();
        if let Some(ca) = &self.tls_ca {
            tls = tls.with_ca_file(ca);
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            tls = tls.with_client_identity(cert, key);
        }
        if let Some(name) = &self.tls_server_name {
            tls = tls.with_server_name(name);
        }
        Some(tls)
    }
}

/// The command groups.
#[derive(Debug, Subcommand)]
enum Command {
    /// List, show, replay and purge a work queue's parked messages.
    #[command(subcommand)]
    Parked(parked::ParkedCommand),
    /// Plan, apply and verify a work queue's exchanges, queues and bindings.
    #[command(subcommand)]
    Topology(topology::TopologyCommand),
    /// Serve a web console for the parking lots of work queues: overview, failure groups,
    /// messages, replay and purge, and a JSON API.
    Serve(serve::ServeArgs),
}

/// `println!` that does not panic when standard output is closed (`retryctl ... | head`).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}
pub(crate) use outln;

/// Runs the `retryctl` command with the process's arguments: what the binary does. The
/// crate is a library only so that its decoders can be fuzzed (`fuzz/`); the command is
/// its interface.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     retryctl::main()
/// }
/// ```
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("retryctl: {}", err.chain());
            ExitCode::from(err.exit_code())
        }
    }
}

fn run(cli: Cli) -> Result<(), CliError> {
    let broker = Broker {
        url: &cli.url,
        protocol: cli.protocol,
    };
    if let Some(tls) = cli.tls() {
        if broker.protocol()? != Protocol::Amqp091 {
            return Err(CliError::usage(
                "--tls-ca, --tls-cert, --tls-key and --tls-server-name apply to AMQP 0-9-1 only",
            ));
        }
        broker::use_tls(tls);
    }
    match cli.command {
        Command::Parked(command) => parked::run(command, &broker),
        Command::Topology(command) => topology::run(command, &broker),
        Command::Serve(args) => serve::run(args, &broker),
    }
}

/// The broker a command talks to: its URL, and the protocol asked for.
pub(crate) struct Broker<'a> {
    /// `--url`.
    pub url: &'a str,
    /// `--protocol`, if given.
    pub protocol: Option<Protocol>,
}

impl Broker<'_> {
    /// The protocol to speak: see [`Protocol::for_url`].
    pub fn protocol(&self) -> Result<Protocol, CliError> {
        Protocol::for_url(self.protocol, self.url)
    }
}

/// Runs `future` to completion on a single-threaded runtime: the commands talk to one
/// broker, one request at a time.
pub(crate) fn block_on<T>(
    future: impl Future<Output = Result<T, CliError>>,
) -> Result<T, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::failure_from("cannot start the async runtime", e))?
        .block_on(future)
}
