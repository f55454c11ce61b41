//! `retryctl`: the retry engine's parking lot and topology, for operators, on any transport
//! of a registry (RabbitMQ over AMQP 0-9-1 or AMQP 1.0, NATS JetStream, the in-memory
//! broker, or one of your own).
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
//!   of `retry-core`'s `serde` feature), or the objects the transport lays them out in
//!   (streams, on NATS). It needs no broker.
//! * `apply` creates them idempotently and says, object by object, which it created and
//!   which already existed as planned.
//! * `verify` checks the broker from outside: every object exists and, over AMQP 0-9-1, a
//!   probe sent through each delay queue, as the engine sends a delayed copy, comes back
//!   where the plan says, dead-lettered as expired. It deletes nothing.
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
//! the URL logs in with the client certificate (SASL `EXTERNAL`). A transport that takes
//! no TLS settings refuses them (exit 2). A refused handshake names the check that failed
//! (unknown CA, wrong host name, expired certificate, a port that does not speak TLS, ...):
//! see the guide's `docs/tls.md`.
//!
//! ## Transports
//!
//! `retryctl` has no code for any broker. The URL's scheme picks a transport from a
//! [`Registry`] (`--protocol NAME` picks another that speaks the scheme), and every command
//! goes through the transport's [`Admin`](retry_core::Admin) and
//! [`ParkingLot`](retry_core::ParkingLot), and its registration's
//! [`Layout`](retry_core::Layout) for `topology plan`. [`main`] registers this
//! workspace's transports (`retry_transports::registry()`):
//!
//! * `amqp://` and `amqps://` speak AMQP 0-9-1 (`amqp091`), or AMQP 1.0 (`amqp10`, RabbitMQ's
//!   AMQP 1.0 plugin) with `--protocol amqp10` (or `RETRYCTL_PROTOCOL=amqp10`). Over AMQP 1.0
//!   the `parked` commands work as over 0-9-1; `topology apply` is refused (RabbitMQ cannot
//!   declare queues over AMQP 1.0: apply over 0-9-1), and `topology verify` checks that
//!   every address of the plan exists, without the probes, which need AMQP 0-9-1. RabbitMQ
//!   3.x shows AMQP 1.0 clients none of the headers of a message parked over AMQP 0-9-1: it
//!   lists as `unknown`, and a replay over AMQP 1.0 that selects it is refused.
//! * `nats://` and `tls://` speak NATS JetStream (`nats`). Each queue of the plan is a stream
//!   of its own subject. The `parked` commands read the parking stream by sequence (a
//!   replayed copy is acknowledged by the stream before the original is deleted),
//!   `topology plan` prints the streams and consumers, `apply` creates them (one replica
//!   each, or `--replication-factor N`), and `verify` checks each of them, without probes.
//!   `--quorum`, `--classic` and `--max-probe-ttl` do not apply there and are refused.
//! * `memory://` is the in-memory broker, a new one per connection: for trying the
//!   commands, not for operating anything.
//!
//! A transport written elsewhere gets the whole command, console included, from a binary
//! of its own that registers it, without a change to `retryctl` ([`main_with`]).
//!
//! Exit codes: 0 success; 1 failure, a mismatch found by `verify` or an unknown queue
//! included; 2 bad usage or bad input (an unknown option, a `purge` without `--yes`, a
//! policy file that does not parse or has an unknown key, a URL scheme no transport
//! speaks, an option or command the transport does not support, such as `topology apply`
//! over AMQP 1.0, a replay over AMQP 1.0 of a message whose headers it cannot see).
//!
//! A crate of its own: `cargo run -p retryctl -- --help`, or `cargo install --path
//! retryctl` to put it on the `PATH`. The library holds the whole command, so that another
//! registry can run it and its decoders (the console's packed index, its form and query
//! parsing) can be fuzzed; its interface is [`main`] and [`main_with`].

mod broker;
mod error;
mod parked;
mod policy;
mod present;
mod render;
mod runtime;
mod serve;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub use serve::fuzzing;
mod topology;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use retry_core::{ConnectOptions, Registry};

use crate::broker::Broker;
use crate::error::CliError;

/// The broker when neither `--url` nor `AMQP_URL` says otherwise.
const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Operate the retry engine's parking lot and topology on any registered transport.
#[derive(Debug, Parser)]
#[command(name = "retryctl", version)]
struct Cli {
    /// The broker's URL: its scheme picks the transport from the registry. Its password is
    /// never printed: `--help` shows the default redacted, and hides the value of
    /// `AMQP_URL`.
    #[arg(
        long,
        global = true,
        env = "AMQP_URL",
        hide_env_values = true,
        hide_default_value = true,
        default_value = DEFAULT_URL,
        value_name = "URL",
        help = "The broker's URL, amqp:// or amqps:// (RabbitMQ), nats:// or tls:// (NATS \
                JetStream), memory:// (in memory), or the scheme of a transport registered \
                beside them [default: amqp://guest:****@127.0.0.1:5672/%2f]; its password is \
                never printed"
    )]
    url: String,

    /// The transport to speak, when the URL's scheme has several: for an amqp:// or
    /// amqps:// URL, amqp091 (AMQP 0-9-1, the default) or amqp10 (AMQP 1.0: no `topology
    /// apply`, and `topology verify` without probes).
    #[arg(
        long,
        global = true,
        env = "RETRYCTL_PROTOCOL",
        hide_env_values = true,
        value_name = "PROTOCOL"
    )]
    protocol: Option<String>,

    /// A PEM file of CA certificates to trust over TLS (an amqps:// URL), in place of the
    /// platform's.
    #[arg(long, global = true, env = "RETRYCTL_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,

    /// A PEM file with the client certificate to present over TLS (with --tls-key).
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

/// Runs the `retryctl` command with the process's arguments over this workspace's
/// transports (`retry_transports::registry()`: AMQP 0-9-1, AMQP 1.0, NATS JetStream and the
/// in-memory broker): what the `retryctl` binary does.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     retryctl::main()
/// }
/// ```
pub fn main() -> ExitCode {
    main_with(retry_transports::registry())
}

/// Runs the `retryctl` command with the process's arguments over the transports of
/// `registry`: how a transport written outside this workspace gets the command line and the
/// console. Each command asks the transport for what it needs through
/// [`Admin`](retry_core::Admin), which its [`Registration`](retry_core::Registration) hands
/// out with [`DynTransport::with_admin`](retry_core::DynTransport::with_admin).
///
/// ```no_run
/// # fn my_transport() -> retry_core::Registration { unimplemented!() }
/// fn main() -> std::process::ExitCode {
///     // This workspace's transports, and one of your own for `mq://` URLs.
///     retryctl::main_with(retry_transports::registry().with(my_transport()))
/// }
/// ```
pub fn main_with(registry: Registry) -> ExitCode {
    run_with(std::env::args_os(), registry)
}

/// Runs the `retryctl` command with `args` (the program's name first, as
/// [`std::env::args_os`] gives them) over the transports of `registry`, printing what the
/// command prints, and returns its exit code: [`main_with`] without the process's
/// arguments, for a program that builds them.
///
/// ```
/// use std::process::ExitCode;
///
/// let registry = retry_transports::registry();
/// let code = retryctl::run_with(["retryctl", "--url", "memory://", "parked", "purge", "comments", "--all"], registry);
/// // Refused without --yes: a usage error.
/// assert_eq!(code, ExitCode::from(2));
/// ```
pub fn run_with<I, T>(args: I, registry: Registry) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        // Help and version are printed to standard output and exit 0; usage errors exit 2.
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    match run(cli, registry) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("retryctl: {}", err.chain());
            ExitCode::from(err.exit_code())
        }
    }
}

fn run(cli: Cli, registry: Registry) -> Result<(), CliError> {
    let mut options = ConnectOptions::new();
    if let Some(protocol) = &cli.protocol {
        options = options.with_protocol(protocol);
    }
    if let Some(tls) = cli.tls() {
        options = options.with_tls(tls);
    }
    let broker = Broker::new(registry, &cli.url, options);
    match cli.command {
        Command::Parked(command) => parked::run(command, &broker),
        Command::Topology(command) => topology::run(command, &broker),
        Command::Serve(args) => serve::run(args, &broker),
    }
}
