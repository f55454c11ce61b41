//! The soak, by hand and in CI: see `stress::chaos::soak`.
//!
//! ```text
//! cargo build -p stress --bin soak --bin chaos_consumer
//! target/debug/soak --duration 5m --warm-up 1m --out target/soak      # what CI runs
//! target/debug/soak --duration 60m --warm-up 5m --out /tmp/soak-60m
//! stress/cluster.sh up && AMQP_CLUSTER_URLS="$(stress/cluster.sh urls)" \
//!     target/debug/soak --cluster --duration 15m --warm-up 3m --out /tmp/soak-cluster
//! ```
//!
//! It starts a private RabbitMQ node (`stress/chaos-node.sh`, port 5694 unless `--port`),
//! which goes down when the soak ends; with `--cluster` it runs on the three-node cluster of
//! `stress/cluster.sh` instead (its node list in `AMQP_CLUSTER_URLS`), stopping and killing
//! its nodes, and starts every node again at the end. Into `--out` go `report.txt` (also
//! printed), `samples.csv` and `soak.svg`. The exit status is 1 if the soak failed, 2 for
//! bad arguments.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use conformance::rabbitmq::runtime;
use stress::chaos::consumer;
use stress::chaos::driver::Broker;
use stress::chaos::node::PrivateNode;
use stress::chaos::soak::{self, SoakConfig};
use test_brokers::rabbitmq::try_cluster_sh;

const USAGE: &str = "usage: soak [--duration 5m] [--warm-up 1m] [--rate 100] [--seed 1] [--port 5694 | --cluster] [--out DIR]";

/// Ports that belong to other nodes of this repository or to the machine's broker.
const NOT_OURS: [u16; 6] = [5672, 5675, 5676, 5681, 5682, 5683];

struct Options {
    duration: Duration,
    warm_up: Duration,
    rate: u32,
    seed: u64,
    port: u16,
    cluster: bool,
    out: PathBuf,
}

/// `90s`, `5m`, `1h` or plain seconds.
fn duration(flag: &str, v: &str) -> Result<Duration, String> {
    let (number, unit) = match v.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => v.split_at(at),
        None => (v, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{flag}: not a duration: {v:?} (90s, 5m, 1h)"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{flag}: unknown unit in {v:?} (s, m or h)")),
    };
    Ok(Duration::from_secs(secs))
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        duration: Duration::from_secs(300),
        warm_up: Duration::from_secs(60),
        rate: 100,
        seed: 1,
        port: 5694,
        cluster: false,
        out: PathBuf::from("target/soak"),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--cluster" {
            o.cluster = true;
            continue;
        }
        let value = args
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = |v: &str| format!("{flag}: not a number: {v:?}");
        match flag.as_str() {
            "--duration" => o.duration = duration(&flag, &value)?,
            "--warm-up" => o.warm_up = duration(&flag, &value)?,
            "--rate" => o.rate = value.parse().map_err(|_| num(&value))?,
            "--seed" => o.seed = value.parse().map_err(|_| num(&value))?,
            "--port" => o.port = value.parse().map_err(|_| num(&value))?,
            "--out" => o.out = PathBuf::from(value),
            _ => return Err(format!("unknown argument {flag}\n{USAGE}")),
        }
    }
    if o.warm_up + Duration::from_secs(60) > o.duration {
        return Err(format!(
            "--warm-up {:?} leaves less than a minute of --duration {:?} to judge",
            o.warm_up, o.duration
        ));
    }
    if o.rate < 2 {
        return Err("--rate: at least 2 messages a second (one for each run)".to_owned());
    }
    if NOT_OURS.contains(&o.port) {
        return Err(format!(
            "--port {}: that port belongs to the machine's broker, the TLS node or the cluster",
            o.port
        ));
    }
    Ok(o)
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let consumer_exe = match consumer::exe_beside_this_one("soak") {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(&o.out) {
        eprintln!("creating {}: {e}", o.out.display());
        return ExitCode::from(2);
    }
    let on = if o.cluster {
        "the cluster of stress/cluster.sh".to_owned()
    } else {
        format!("a private RabbitMQ node on port {}", o.port)
    };
    eprintln!(
        "soaking on {on} for {:?} at {} messages a second",
        o.duration, o.rate
    );
    let (broker, node) = if o.cluster {
        let urls = std::env::var("AMQP_CLUSTER_URLS").unwrap_or_default();
        let urls: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        if urls.len() != 3 {
            eprintln!(
                "--cluster needs the three nodes' URLs in AMQP_CLUSTER_URLS: stress/cluster.sh up, then AMQP_CLUSTER_URLS=\"$(stress/cluster.sh urls)\""
            );
            return ExitCode::from(2);
        }
        if let Err(e) = try_cluster_sh(&["start-all"]) {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
        (Broker::Cluster(urls), None)
    } else {
        match PrivateNode::up(o.port, Some(std::process::id())) {
            Ok(node) => (Broker::Node(o.port), Some(node)),
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let config = SoakConfig {
        consumer_exe,
        duration: o.duration,
        warm_up: o.warm_up,
        rate: o.rate,
        seed: o.seed,
        broker,
    };
    let outcome = runtime().block_on(soak::run(&config));
    drop(node);
    if o.cluster
        && let Err(e) = try_cluster_sh(&["start-all"])
    {
        eprintln!("{e}");
    }

    let report = outcome.report();
    print!("{report}");
    let title = format!(
        "The sampled consumer, {}-minute soak{}: orange, end of warm-up; red, a stalled recovery",
        o.duration.as_secs() / 60,
        if o.cluster { " on the cluster" } else { "" }
    );
    let written = std::fs::write(o.out.join("report.txt"), &report)
        .and_then(|()| {
            std::fs::write(
                o.out.join("samples.csv"),
                soak::csv(&outcome.steady.samples),
            )
        })
        .map_err(|e| e.to_string())
        .and_then(|()| {
            soak::plot(
                &outcome.steady.samples,
                o.warm_up,
                &outcome.stalls,
                &title,
                &o.out.join("soak.svg"),
            )
        });
    if let Err(e) = written {
        eprintln!("writing into {}: {e}", o.out.display());
        return ExitCode::FAILURE;
    }
    println!(
        "report, samples and picture in {}; journals {} and {}",
        o.out.display(),
        outcome.steady.journal.display(),
        outcome.crash.journal.display()
    );
    if outcome.problems().is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
