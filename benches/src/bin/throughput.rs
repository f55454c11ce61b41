//! Throughput of the retry consumer on a transport named on the command line, beside that
//! transport's plain client loops, in the same run, on the same server, under the same
//! durability, at one or more prefetches.
//!
//! ```sh
//! cargo run --release -p benches --bin throughput -- amqp091            # every path, 3 rounds, prefetch 100
//! cargo run --release -p benches --bin throughput -- nats --n 5000 --rounds 5
//! cargo run --release -p benches --bin throughput -- amqp10 --paths ours-retry,fe2o3-retry-half
//! cargo run --release -p benches --bin throughput -- amqp091 --prefetch 20,100,400,1000 --plot rates.svg
//! ```
//!
//! Ours is one generic function (`benches::ours::throughput`) over the transport's concrete
//! type; the plain loops are each transport's own (see the `benches` crate's modules
//! `amqp091`, `amqp10` and `nats` for what each does). Paths: `ours-success` (a handler that
//! succeeds) and `ours-retry` (a handler that fails the first run, so every message is
//! cloned to the delay queue, confirmed, then its original settled), then the transport's
//! peers; `--paths` picks some, comma-separated.
//!
//! Every measurement waits for the server to be idle (200 ms under 5% of a core, at most
//! 5 s; `--no-wait` does not, for smoke runs), then gets queues of its own (a topology plan named
//! `bench-<transport>-<pid>-<round>-<path>-p<prefetch>` with one delay level of 1 h, so no
//! clone comes back during a run), prefilled with N persistent messages of 256 bytes
//! (`--body`), consumed, checked (the work queue is empty once its consumer is gone; on the
//! retry path the clones' queue holds exactly N) and deleted. The clock runs from just
//! before consuming starts (ours: just before `Consumer::run`, so it includes verifying the
//! plan, the first look at the isolation queue and subscribing; a plain loop: just before
//! it subscribes, on a connection already open) to the last settlement (ours: the last
//! message's `on_terminal`; a plain loop: its last ack or accept). Besides msg/s over that
//! span, each measurement reports msg/s from the first message in hand (`steady`), the CPU
//! time per message of this process and of the server (when it runs on this machine), from
//! `/proc`, in whole clock ticks of 10 ms, and, when it is the only measurement of its
//! process (`--tsv` with one path, one prefetch, one round), the growth of this process's
//! resident memory while consuming.
//!
//! Rounds are interleaved (every path at every prefetch once per round, the order rotated
//! each round). The table has one block per prefetch (and body size): each round, then min,
//! median and max, of msg/s, CPU time per message and memory growth where measured, and the
//! ratios of ours to each baseline *in the same round*; with several prefetches, the
//! ratios' medians side by side. `--plot FILE.svg` draws msg/s against prefetch.
//!
//! Other modes, for `benches/vs-node.sh`, which adds the seed article's Node.js consumer on
//! RabbitMQ and runs each measurement as a process of its own:
//!
//! * `--tsv --round R --paths P --prefetch F`: measure round R only, print one line per
//!   path and prefetch: `round path n seconds msg/s load1 client-µs/msg broker-µs/msg
//!   prefetch body rss-growth-KiB steady-msg/s`, tab-separated, `NaN` where unknown.
//! * `--report FILE [--plot FILE.svg]`: print the table (and draw the picture) from such
//!   lines; on `amqp091`, `node-ack` and `node-retry` lines are the Node.js peer's.

use std::time::Duration;

use bench_support::args::env_or;
use bench_support::proc::wait_for_idle_server;
use benches::amqp10::Amqp10;
use benches::amqp091::{Amqp091, NODE};
use benches::nats::Nats;
use benches::report::{Sample, Setting, parse_tsv, plot, sections, table};
use benches::{BoxError, Peer, Run, Subject, ours, unknown_transport};
use retry_core::{RetryPolicy, TopologyPlan};

/// The prefetch and body size without `--prefetch` and `--body`.
const PREFETCH: u16 = 100;
const BODY: usize = 256;
/// The delay level: long enough that no clone comes back during a run.
const DELAY: Duration = Duration::from_secs(3600);

/// Ours, on either path.
const OURS: [&str; 2] = ["ours-success", "ours-retry"];

/// Every path on `S`, in the default order: each side's peers, then ours.
fn paths<S: Subject>() -> Vec<String> {
    let side = |s| S::peers().iter().filter(move |p: &&Peer| p.side == s);
    side(benches::Side::Success)
        .map(|p| p.path.to_owned())
        .chain([OURS[0].to_owned()])
        .chain(side(benches::Side::Retry).map(|p| p.path.to_owned()))
        .chain([OURS[1].to_owned()])
        .collect()
}

/// One measurement of a setting on fresh queues, deleted afterwards.
async fn measure<S: Subject>(
    subject: &S,
    setting: &Setting,
    round: usize,
    n: u64,
    wait: bool,
) -> Result<benches::Measured, BoxError> {
    let Setting {
        path,
        prefetch,
        body,
    } = setting;
    // Setup (declaring, prefilling) comes after the server is idle.
    if wait {
        wait_for_idle_server(S::SERVER).await;
    }
    let policy = RetryPolicy::delays([DELAY]).build()?;
    let q = format!(
        "bench-{}-{}-{round}-{path}-p{prefetch}",
        S::NAME,
        std::process::id()
    );
    let plan = TopologyPlan::new(&q, &policy)?;
    subject.declare(&plan).await?;
    let result = async {
        subject.prefill(&q, n, *body).await?;
        let run = Run {
            plan: &plan,
            policy: &policy,
            n,
            prefetch: *prefetch,
            body: *body,
        };
        let measuring = async {
            match path.as_str() {
                "ours-success" => Ok((ours::throughput(subject, &run, false).await?, None)),
                "ours-retry" => {
                    let delay_queue = run.delay_queue()?.to_owned();
                    Ok((
                        ours::throughput(subject, &run, true).await?,
                        Some(delay_queue),
                    ))
                }
                peer => {
                    let side = S::peers().iter().find(|p| p.path == peer).map(|p| p.side);
                    let (measured, clones) = subject.peer(peer, &run).await?;
                    Ok::<_, BoxError>((
                        measured,
                        (side == Some(benches::Side::Retry)).then_some(clones),
                    ))
                }
            }
        };
        let (measured, clones) = tokio::time::timeout(benches::BOUND, measuring)
            .await
            .map_err(|_| format!("{path} did not finish within {:?}", benches::BOUND))??;
        // Nothing lost, nothing left: every delivery was settled, every clone arrived.
        let left = subject.count(&q, 0).await?;
        if left != 0 {
            return Err(format!("{path}: {left} message(s) left in {q}").into());
        }
        if let Some(clones_queue) = clones {
            let clones = subject.count(&clones_queue, n).await?;
            if clones != n {
                return Err(format!("{path}: {clones} clone(s) in {clones_queue}, not {n}").into());
            }
        }
        Ok::<_, BoxError>(measured)
    }
    .await;
    subject.delete(&plan).await?;
    result
}

struct Args {
    transport: String,
    n: u64,
    rounds: usize,
    round: Option<usize>,
    paths: Option<Vec<String>>,
    prefetch: Vec<u16>,
    body: usize,
    tsv: bool,
    report: Option<String>,
    plot: Option<String>,
    /// Whether to wait for an idle server before each measurement (`--no-wait`: not, for
    /// smoke runs on a busy machine, whose figures mean nothing).
    wait: bool,
}

const USAGE: &str = "usage: throughput TRANSPORT [N] [--n N] [--rounds R] [--round R] \
                     [--paths P,P,..] [--prefetch P,P,..] [--body BYTES] [--tsv] \
                     [--report FILE] [--plot FILE.svg] [--no-wait]; TRANSPORT is amqp091, \
                     amqp10 or nats";

fn args() -> Result<Args, BoxError> {
    let mut a = Args {
        transport: String::new(),
        n: 20_000,
        rounds: env_or("ROUNDS", 3)?,
        round: None,
        paths: None,
        prefetch: vec![PREFETCH],
        body: BODY,
        tsv: false,
        report: None,
        plot: None,
        wait: true,
    };
    let list = |v: String| v.split(',').map(str::to_owned).collect::<Vec<_>>();
    let mut argv = bench_support::args::Args::new(USAGE);
    while let Some(arg) = argv.next() {
        match arg.as_str() {
            "--n" => a.n = argv.value(&arg)?,
            "--rounds" => a.rounds = argv.value(&arg)?,
            "--round" => a.round = Some(argv.value(&arg)?),
            "--paths" => a.paths = Some(list(argv.value(&arg)?)),
            "--prefetch" => {
                a.prefetch = list(argv.value(&arg)?)
                    .iter()
                    .map(|p| p.parse())
                    .collect::<Result<_, _>>()?;
            }
            "--body" => a.body = argv.value(&arg)?,
            "--tsv" => a.tsv = true,
            "--report" => a.report = Some(argv.value(&arg)?),
            "--plot" => a.plot = Some(argv.value(&arg)?),
            "--no-wait" => a.wait = false,
            n if n.parse::<u64>().is_ok() => a.n = n.parse()?,
            name if !name.starts_with('-') && a.transport.is_empty() => {
                a.transport = name.to_owned();
            }
            other => return Err(argv.unknown(other)),
        }
    }
    if a.transport.is_empty() {
        return Err(format!("which transport? {USAGE}").into());
    }
    if a.rounds == 0 || a.n == 0 || a.round == Some(0) {
        return Err(format!("N, the rounds and the round number start at 1; {USAGE}").into());
    }
    if a.prefetch.contains(&0) {
        return Err(format!("a prefetch of 0 is unlimited, not a window; {USAGE}").into());
    }
    if a.tsv && a.plot.is_some() {
        return Err(format!("--plot draws a table's results, not --tsv lines; {USAGE}").into());
    }
    Ok(a)
}

/// The peers shown in `S`'s table: its own, and on RabbitMQ the Node.js peer's lines.
fn shown<S: Subject>() -> Vec<Peer> {
    let extra: &[Peer] = if S::NAME == Amqp091::NAME { &NODE } else { &[] };
    S::peers().iter().chain(extra).copied().collect()
}

/// Measures (or reports) on `S`.
async fn main_for<S: Subject>(args: Args) -> Result<(), BoxError> {
    let (sections, legend) = sections(&shown::<S>());
    if let Some(file) = &args.report {
        let samples = parse_tsv(&std::fs::read_to_string(file)?)?;
        print!("{}", table(&samples, &sections, &legend));
        if let Some(svg) = &args.plot {
            plot(&samples, &sections, svg)?;
        }
        return Ok(());
    }
    let known = paths::<S>();
    let chosen = args.paths.clone().unwrap_or_else(|| known.clone());
    if let Some(unknown) = chosen.iter().find(|p| !known.contains(p)) {
        return Err(format!(
            "unknown path {unknown:?} on {}; known: {}",
            S::NAME,
            known.join(",")
        )
        .into());
    }
    let subject = S::open().await?;
    let rounds: Vec<usize> = match args.round {
        Some(r) => vec![r],
        None => (1..=args.rounds).collect(),
    };
    let settings: Vec<Setting> = args
        .prefetch
        .iter()
        .flat_map(|&prefetch| {
            chosen.iter().map(move |path| Setting {
                path: path.clone(),
                prefetch,
                body: args.body,
            })
        })
        .collect();
    // Memory growth means something only in a process of one measurement.
    let memory = settings.len() == 1 && rounds.len() == 1;
    let mut samples = Vec::new();
    for &round in &rounds {
        // Rotate the order each round, so no path always runs first.
        let k = settings.len();
        for i in 0..k {
            let setting = &settings[(i + round - 1) % k];
            let measured = measure(&subject, setting, round, args.n, args.wait).await?;
            let sample = Sample::new(round, setting, args.n, measured, memory);
            if args.tsv {
                println!("{}", sample.tsv());
            } else {
                eprintln!(
                    "round {round}: {:<22} prefetch {:<5} {:>8.0} msg/s (steady {:>8.0}; load {:.2})",
                    setting.path, setting.prefetch, sample.rate, sample.steady, sample.load
                );
            }
            samples.push(sample);
        }
    }
    if !args.tsv {
        println!("{}: ours against plain {}", S::NAME, S::PLAIN);
        print!("\n{}", table(&samples, &sections, &legend));
        if let Some(svg) = &args.plot {
            plot(&samples, &sections, svg)?;
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args = args()?;
    match args.transport.as_str() {
        Amqp091::NAME => main_for::<Amqp091>(args).await,
        Amqp10::NAME => main_for::<Amqp10>(args).await,
        Nats::NAME => main_for::<Nats>(args).await,
        other => Err(unknown_transport(other)),
    }
}
