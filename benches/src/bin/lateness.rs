//! How late a delayed retry comes back, on a transport named on the command line: through
//! the retry consumer (ours) and through the server's own delay (its floor), in the same
//! run, on the same server.
//!
//! ```sh
//! cargo run --release -p benches --bin lateness -- amqp091                  # 2000 at 500/s, 3 rounds
//! cargo run --release -p benches --bin lateness -- nats --n 500 --rate 50 --rounds 1
//! cargo run --release -p benches --bin lateness -- nats --jitter            # and jittered delays
//! ```
//!
//! Every message fails its first run and is retried once through a 1 s delay level; its
//! lateness is how late its second run starts after it was due: `second run - first
//! failure - its delay`, in ms, where the first failure is noted when the first run fails
//! and the delay is the one the message was given. Messages (`--n`, default 2,000, of 256
//! bytes, persistent) are published at a steady rate (`--rate`, default 500 msg/s, each
//! confirmed, pipelined) by the transport's paced publisher, on a connection of its own,
//! while the consumer runs, with prefetch 100.
//!
//! * the floor (`benches::Subject::floor`): the server's own delay through a plain client;
//!   on `amqp091` and `amqp10` (the same broker) a plain lapin consumer that copies each
//!   first delivery into a TTL queue dead-lettering back to the work queue, on `nats` a
//!   plain async-nats pull that naks each first delivery with its delay;
//! * ours (`benches::ours::lateness`, one generic function over the transport's concrete
//!   type): the retry consumer, its handler failing the first run and succeeding the
//!   second; the plan has one delay level, 1 s.
//! * with `--jitter` (on `nats`; RabbitMQ's TTL queue holds one TTL, so it has no jittered
//!   floor), both again with delays spread over 0.5 to 1 s: ours with the policy's
//!   `Jitter::Equal`, the floor with a delay drawn the same way from a hash of the message
//!   id (`benches::lateness::floor_delay`).
//!
//! Every measurement waits for the server to be idle (as `throughput` does; `--no-wait`
//! does not, for smoke runs), then gets a
//! plan of its own (`late-<transport>-<pid>-<round>-<floor|ours>[-jitter]`, declared
//! empty), which is deleted with whatever the floor declared beside it. In each round the
//! floor and ours run one after the other, the order alternating; the table shows p50, p99
//! and max per round (with the one-minute load average before and after) and over all
//! rounds, and ours minus the floor. A second run that starts before it was due counts as
//! negative lateness; how many were early, and by how much at most, is printed below the
//! table. On `nats`, the floor's lateness above 100 msg/s is the server's own (see
//! `benches::nats`: a nak with a delay resets the timer that hands delayed messages back).
//! `AMQP_URL`, `AMQP10_URL` and `NATS_URL` pick the servers.

use std::fmt::Write as _;
use std::time::Duration;

use bench_support::args::Args;
use bench_support::proc::{load1_shown, wait_for_idle_server};
use benches::amqp10::Amqp10;
use benches::amqp091::Amqp091;
use benches::nats::Nats;
use benches::{BoxError, Lateness, Subject, Trial, ours, unknown_transport};
use retry_core::{Jitter, RetryPolicy, TopologyPlan};

/// The delay level.
const DELAY: Duration = Duration::from_secs(1);
const PREFETCH: u16 = 100;
const BODY: [u8; 256] = [b'x'; 256];

const USAGE: &str = "usage: lateness TRANSPORT [--n N] [--rate R] [--rounds R] [--jitter] [--no-wait]; \
                     TRANSPORT is amqp091, amqp10 or nats";

struct Settings {
    transport: String,
    n: u64,
    rate: f64,
    rounds: usize,
    jitter: bool,
    /// Whether to wait for an idle server before each measurement (`--no-wait`: not, for
    /// smoke runs, whose figures mean nothing).
    wait: bool,
}

fn args() -> Result<Settings, BoxError> {
    let mut a = Settings {
        transport: String::new(),
        n: 2_000,
        rate: 500.0,
        rounds: 3,
        jitter: false,
        wait: true,
    };
    let mut argv = Args::new(USAGE);
    while let Some(arg) = argv.next() {
        match arg.as_str() {
            "--n" => a.n = argv.value(&arg)?,
            "--rate" => a.rate = argv.value(&arg)?,
            "--rounds" => a.rounds = argv.value(&arg)?,
            "--jitter" => a.jitter = true,
            "--no-wait" => a.wait = false,
            name if !name.starts_with('-') && a.transport.is_empty() => {
                a.transport = name.to_owned();
            }
            other => return Err(argv.unknown(other)),
        }
    }
    if a.transport.is_empty() {
        return Err(format!("which transport? {USAGE}").into());
    }
    // `!(x > 0)` also refuses NaN.
    if a.n == 0 || a.rounds == 0 || !(a.rate > 0.0 && a.rate.is_finite()) {
        return Err(format!("N, the rate and the rounds must be positive; {USAGE}").into());
    }
    Ok(a)
}

/// One kind of measurement: ours or the floor, jittered or not.
#[derive(Clone, Copy)]
struct Kind {
    ours: bool,
    jitter: bool,
}

impl Kind {
    /// Its part of the plan's name.
    fn tag(self) -> String {
        let who = if self.ours { "ours" } else { "floor" };
        format!("{who}{}", if self.jitter { "-jitter" } else { "" })
    }

    /// Its row label on `S`.
    fn label<S: Subject>(self) -> String {
        let spread = format!("{}-{} s", secs(DELAY / 2), secs(DELAY));
        match (self.ours, self.jitter) {
            (false, false) => S::FLOOR.to_owned(),
            (true, false) => "retry consumer (ours)".to_owned(),
            (false, true) => format!("{}, jittered {spread}", S::FLOOR),
            (true, true) => format!("ours, equal jitter {spread}"),
        }
    }
}

/// A duration in seconds, as short as it goes (`0.5`, `1`).
fn secs(d: Duration) -> String {
    format!("{}", d.as_secs_f64())
}

/// One measurement of `kind` on a plan of its own, deleted afterwards.
async fn measure<S: Subject>(
    subject: &S,
    kind: Kind,
    round: usize,
    a: &Settings,
) -> Result<Lateness, BoxError> {
    // Setup (declaring) comes after the server is idle.
    if a.wait {
        wait_for_idle_server(S::SERVER).await;
    }
    let mut policy = RetryPolicy::delays([DELAY]);
    if kind.ours && kind.jitter {
        policy = policy.with_jitter(Jitter::Equal);
    }
    let policy = policy.build()?;
    let q = format!(
        "late-{}-{}-{round}-{}",
        S::NAME,
        std::process::id(),
        kind.tag()
    );
    let plan = TopologyPlan::new(&q, &policy)?;
    subject.declare(&plan).await?;
    let trial = Trial {
        plan: &plan,
        policy: &policy,
        n: a.n,
        rate: a.rate,
        prefetch: PREFETCH,
        body: &BODY,
        jitter: kind.jitter,
    };
    let measuring = async {
        if kind.ours {
            ours::lateness(subject, &trial).await
        } else {
            subject.floor(&trial).await
        }
    };
    let result = tokio::time::timeout(benches::BOUND, measuring)
        .await
        .map_err(|_| format!("{} did not finish within {:?}", kind.tag(), benches::BOUND))
        .and_then(|measured| measured.map_err(|e| format!("{}: {e}", kind.label::<S>())));
    subject.delete(&plan).await?;
    let lateness = result?;
    lateness.check(a.n, &kind.label::<S>())?;
    Ok(lateness)
}

/// p50, p99 and max, ms (a row of nothing timed is refused before it gets here).
fn summary(lateness: &Lateness) -> (f64, f64, f64) {
    lateness
        .percentiles()
        .unwrap_or((f64::NAN, f64::NAN, f64::NAN))
}

fn row(out: &mut String, width: usize, label: &str, (p50, p99, max): (f64, f64, f64)) {
    let _ = writeln!(out, "  {label:<width$}{p50:>9.1}{p99:>9.1}{max:>9.1}");
}

fn diff(a: (f64, f64, f64), b: (f64, f64, f64)) -> (f64, f64, f64) {
    (a.0 - b.0, a.1 - b.1, a.2 - b.2)
}

/// The rows of one round or of all: per pair (floor, ours), each, then ours minus floor.
fn table<S: Subject>(out: &mut String, width: usize, kinds: &[Kind], late: &[Lateness]) {
    for pair in kinds.chunks(2).zip(late.chunks(2)) {
        let ([floor, ours], [floor_late, ours_late]) = pair else {
            continue;
        };
        let (f, o) = (summary(floor_late), summary(ours_late));
        row(out, width, &floor.label::<S>(), f);
        row(out, width, &ours.label::<S>(), o);
        let minus = if floor.jitter {
            "ours - floor, jittered"
        } else {
            "ours - floor"
        };
        row(out, width, minus, diff(o, f));
    }
}

/// Measures on `S`.
async fn main_for<S: Subject>(a: Settings) -> Result<(), BoxError> {
    if a.jitter && !S::FLOOR_JITTERS {
        return Err(format!(
            "--jitter: {} has no jittered floor ({}: a TTL queue holds one TTL, and a \
             per-message TTL expires only at the queue's head); run it on nats",
            S::NAME,
            S::FLOOR
        )
        .into());
    }
    let subject = S::open().await?;
    // Pairs of (floor, ours): the order within each pair alternates by round.
    let mut kinds = vec![
        Kind {
            ours: false,
            jitter: false,
        },
        Kind {
            ours: true,
            jitter: false,
        },
    ];
    if a.jitter {
        kinds.extend([
            Kind {
                ours: false,
                jitter: true,
            },
            Kind {
                ours: true,
                jitter: true,
            },
        ]);
    }
    let width = kinds
        .iter()
        .map(|k| k.label::<S>().len())
        .chain(["ours - floor, jittered".len()])
        .max()
        .unwrap_or(0)
        + 2;
    let mut all = vec![Lateness::default(); kinds.len()];
    let mut out = format!(
        "lateness of a {} s retry on {} (second run - first failure - its delay), ms; {} \
         persistent messages at {} msg/s, prefetch {PREFETCH}\n",
        secs(DELAY),
        S::NAME,
        a.n,
        a.rate
    );
    let _ = writeln!(out, "  {:<width$}{:>9}{:>9}{:>9}", "", "p50", "p99", "max");
    for round in 1..=a.rounds {
        let load_before = load1_shown();
        let mut late = vec![Lateness::default(); kinds.len()];
        for pair in (0..kinds.len()).step_by(2) {
            // Alternate which goes first.
            let order = if round % 2 == 1 {
                [pair, pair + 1]
            } else {
                [pair + 1, pair]
            };
            for k in order {
                late[k] = measure(&subject, kinds[k], round, &a).await?;
            }
        }
        let _ = writeln!(
            out,
            "round {round} (load {load_before} -> {})",
            load1_shown()
        );
        table::<S>(&mut out, width, &kinds, &late);
        eprintln!(
            "round {round}: floor p99 {:.1} ms, ours p99 {:.1} ms",
            summary(&late[0]).1,
            summary(&late[1]).1
        );
        for (all, late) in all.iter_mut().zip(late) {
            all.extend(late);
        }
    }
    let _ = writeln!(out, "all {} round(s)", a.rounds);
    table::<S>(&mut out, width, &kinds, &all);
    for (kind, late) in kinds.iter().zip(&all) {
        let (count, most) = late.early();
        if count > 0 {
            let _ = writeln!(
                out,
                "  early: {count} of {} second runs, by {most:.1} ms at most ({})",
                late.len(),
                kind.label::<S>()
            );
        }
    }
    print!("{out}");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let a = args()?;
    match a.transport.as_str() {
        Amqp091::NAME => main_for::<Amqp091>(a).await,
        Amqp10::NAME => main_for::<Amqp10>(a).await,
        Nats::NAME => main_for::<Nats>(a).await,
        other => Err(unknown_transport(other)),
    }
}
