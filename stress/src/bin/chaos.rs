//! The full chaos run, by hand: see `stress::chaos`.
//!
//! ```text
//! cargo build -p stress --bin chaos --bin chaos_consumer
//! target/debug/chaos                                  # 20,000 messages, 45 s of chaos, both protocols
//! target/debug/chaos --protocol amqp10 --runs 3 --seed 7
//! target/debug/chaos --poison-heavy --messages 2000 --poison 60
//! target/debug/chaos --graceful
//! target/debug/chaos --reconcile /tmp/cf-chaos-….journal --crash-limit 2
//! ```
//!
//! It starts a private RabbitMQ node (`stress/chaos-node.sh`, port 5690 unless `--port`),
//! which goes down when the run ends. Each run prints its figures, and for every lost,
//! stuck or wrongly blamed message its journal; the journals stay in the temporary
//! directory. The exit status is 1 if any run broke a rule.

use std::path::PathBuf;
use std::process::ExitCode;

use conformance::rabbitmq::runtime;
use stress::chaos::consumer::{self, Protocol};
use stress::chaos::driver::{self, ChaosConfig};
use stress::chaos::node::PrivateNode;

const USAGE: &str = "usage: chaos [--protocol amqp091|amqp10|both] [--runs N] [--seed S] [--messages N] [--poison N] [--chaos-secs S] [--kills N] [--closes N] [--restarts N] [--consumers N] [--port P] [--poison-heavy] [--graceful] | --reconcile JOURNAL [--crash-limit N]";

struct Options {
    protocols: Vec<Protocol>,
    runs: u64,
    seed: u64,
    messages: Option<usize>,
    poison: Option<usize>,
    chaos_secs: Option<u64>,
    kills: Option<usize>,
    closes: Option<usize>,
    restarts: Option<usize>,
    consumers: Option<usize>,
    port: u16,
    poison_heavy: bool,
    graceful: bool,
    reconcile: Option<PathBuf>,
    crash_limit: u32,
}

fn parse() -> Result<Options, String> {
    let mut o = Options {
        protocols: vec![Protocol::Amqp091, Protocol::Amqp10],
        runs: 1,
        seed: 1,
        messages: None,
        poison: None,
        chaos_secs: None,
        kills: None,
        closes: None,
        restarts: None,
        consumers: None,
        port: 5690,
        poison_heavy: false,
        graceful: false,
        reconcile: None,
        crash_limit: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse().map_err(|_| format!("{flag}: not a number: {v}"))
        }
        match flag.as_str() {
            "--protocol" => {
                let v = value()?;
                o.protocols = if v == "both" {
                    vec![Protocol::Amqp091, Protocol::Amqp10]
                } else {
                    vec![Protocol::parse(&v)?]
                };
            }
            "--runs" => o.runs = num(&flag, value()?)?,
            "--seed" => o.seed = num(&flag, value()?)?,
            "--messages" => o.messages = Some(num(&flag, value()?)?),
            "--poison" => o.poison = Some(num(&flag, value()?)?),
            "--chaos-secs" => o.chaos_secs = Some(num(&flag, value()?)?),
            "--kills" => o.kills = Some(num(&flag, value()?)?),
            "--closes" => o.closes = Some(num(&flag, value()?)?),
            "--restarts" => o.restarts = Some(num(&flag, value()?)?),
            "--consumers" => o.consumers = Some(num(&flag, value()?)?),
            "--port" => o.port = num(&flag, value()?)?,
            "--poison-heavy" => o.poison_heavy = true,
            "--graceful" => o.graceful = true,
            "--reconcile" => o.reconcile = Some(PathBuf::from(value()?)),
            "--crash-limit" => o.crash_limit = num(&flag, value()?)?,
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
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
    if let Some(journal) = &o.reconcile {
        let r = driver::reconcile_journal(journal, o.crash_limit);
        println!(
            "{} messages, {} handled, {} parked, {} lost, {} stuck, {} wrongly blamed, {} blamed across processes, {} charged by a kill",
            r.messages,
            r.handled,
            r.parked,
            r.lost.len(),
            r.stuck.len(),
            r.wrongly_blamed.len(),
            r.blamed_across_processes.len(),
            r.charged_by_kill.len()
        );
        let problems = r.problems(o.crash_limit);
        for p in &problems {
            println!("  PROBLEM: {p}");
        }
        println!("{}", r.details);
        return if problems.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    let consumer = match consumer::exe_beside_this_one("chaos") {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    eprintln!("starting a private RabbitMQ node on port {}", o.port);
    let node = match PrivateNode::up(o.port, Some(std::process::id())) {
        Ok(node) => node,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    runtime().block_on(async {
        for run in 0..o.runs {
            for &protocol in &o.protocols {
                let seed = o.seed + run;
                if o.graceful {
                    let out =
                        driver::graceful_shutdown(protocol, consumer.clone(), &node, 2000).await;
                    println!("{}", out.summary());
                    if out.redelivered_after > 0 {
                        println!("  redelivered: {:?}", out.redelivered_ids);
                        println!("  journal: {}", out.journal.display());
                        failed = true;
                    }
                    continue;
                }
                let mut config = if o.poison_heavy {
                    ChaosConfig::poison_heavy(protocol, consumer.clone(), seed, 2000, 60)
                } else {
                    ChaosConfig::full(protocol, consumer.clone(), seed)
                };
                if let Some(n) = o.messages {
                    config.messages = n;
                }
                if let Some(n) = o.poison {
                    config.mix.poison = n;
                }
                if let Some(s) = o.chaos_secs {
                    config.chaos = std::time::Duration::from_secs(s);
                }
                if let Some(n) = o.kills {
                    config.kills = n;
                }
                if let Some(n) = o.closes {
                    config.closes = n;
                }
                if let Some(n) = o.restarts {
                    config.app_restarts = n;
                }
                if let Some(n) = o.consumers {
                    config.consumers = n;
                }
                let out = driver::run(&config, &node).await;
                println!("{}", out.summary());
                for e in &out.exit_errors {
                    println!("  consumer run error: {e}");
                }
                let problems = out.problems();
                for p in &problems {
                    println!("  PROBLEM: {p}");
                }
                if !problems.is_empty() {
                    failed = true;
                    println!("{}", out.reconciled.details);
                }
                println!("  journal: {}", out.journal.display());
            }
        }
    });
    drop(node);
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
