//! Each benchmark binary runs on each transport with a few hundred messages and reports: a
//! check that they keep working as the docs say, not of how fast anything is.
//!
//! A server that does not answer skips its cases loudly, unless `REQUIRE_BROKER`
//! (RabbitMQ, AMQP 0-9-1 and 1.0) or `REQUIRE_NATS` is set, as CI sets them: then they fail.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use test_brokers::{amqp_url, amqp10_url, authority, nats_url, no_broker, no_nats};

/// Whether the server at `addr` answers `header` with a protocol header of the same
/// protocol id (RabbitMQ without its AMQP 1.0 plugin answers an AMQP 1.0 header with its
/// AMQP 0-9-1 one).
fn answers(addr: &str, header: &[u8], expect: impl Fn(&[u8]) -> bool) -> Result<(), String> {
    let mut s = TcpStream::connect(addr).map_err(|e| format!("{addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.write_all(header).map_err(|e| format!("{addr}: {e}"))?;
    let mut reply = [0u8; 8];
    s.read_exact(&mut reply)
        .map_err(|e| format!("{addr}: no protocol header back: {e}"))?;
    if expect(&reply) {
        Ok(())
    } else {
        Err(format!("{addr} answered {reply:?}"))
    }
}

/// Whether `transport`'s server is there; `false` (after a loud notice) if not and it is
/// not required; a panic if it is required (`REQUIRE_BROKER`, `REQUIRE_NATS`).
fn server(transport: &str) -> bool {
    let probe = match transport {
        "amqp091" => answers(
            &authority(&amqp_url()),
            b"AMQP\x00\x00\x09\x01",
            |r| r[0] == 1, // a connection.start frame
        ),
        "amqp10" => answers(&authority(&amqp10_url()), b"AMQP\x03\x01\x00\x00", |r| {
            r == b"AMQP\x03\x01\x00\x00"
        })
        .map_err(|e| format!("{e} (is rabbitmq_amqp1_0 enabled?)")),
        "nats" => TcpStream::connect(authority(&nats_url()))
            .map(drop)
            .map_err(|e| e.to_string()),
        other => panic!("no probe for {other}"),
    };
    let Err(why) = probe else { return true };
    let what = format!("the benches on {transport}");
    if transport == "nats" {
        no_nats(&what, &why);
    } else {
        no_broker(&what, &why);
    }
    false
}

/// Runs `bin` with `args`; its standard output if it succeeded.
fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{bin}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{bin} {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout.into_owned()
}

fn throughput(transport: &str) {
    if !server(transport) {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_throughput");
    let table = run(
        bin,
        &[transport, "--n", "200", "--rounds", "1", "--no-wait"],
    );
    // Every path ran, and ours was compared with the plain loops on both paths.
    for section in ["success path", "retry path"] {
        assert!(table.contains(section), "no {section} in:\n{table}");
    }
    let ratios = table.lines().filter(|l| l.contains("ours / ")).count();
    assert!(ratios >= 2, "no ratios of ours to a baseline in:\n{table}");
}

#[test]
fn throughput_runs_on_amqp091() {
    throughput("amqp091");
}

#[test]
fn throughput_runs_on_amqp10() {
    throughput("amqp10");
}

#[test]
fn throughput_runs_on_nats() {
    throughput("nats");
}

#[test]
fn throughput_names_an_unknown_transport() {
    let out = Command::new(env!("CARGO_BIN_EXE_throughput"))
        .arg("kafka")
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("kafka") && stderr.contains("amqp091"),
        "{stderr}"
    );
}

fn lateness(transport: &str, extra: &[&str]) {
    if !server(transport) {
        return;
    }
    let bin = env!("CARGO_BIN_EXE_lateness");
    let mut args = vec![
        transport,
        "--n",
        "40",
        "--rate",
        "200",
        "--rounds",
        "1",
        "--no-wait",
    ];
    args.extend(extra);
    let table = run(bin, &args);
    assert!(
        table.contains("ours - floor") && table.contains("p99"),
        "no comparison with the floor in:\n{table}"
    );
}

#[test]
fn lateness_runs_on_amqp091() {
    lateness("amqp091", &[]);
}

#[test]
fn lateness_runs_on_amqp10() {
    lateness("amqp10", &[]);
}

#[test]
fn lateness_runs_on_nats_with_jitter() {
    lateness("nats", &["--jitter"]);
}

#[test]
fn lateness_refuses_jitter_where_the_floor_cannot_jitter() {
    let out = Command::new(env!("CARGO_BIN_EXE_lateness"))
        .args(["amqp091", "--jitter"])
        .output()
        .expect("the binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--jitter") && stderr.contains("nats"),
        "{stderr}"
    );
}

#[test]
fn first_delivery_runs_on_every_transport() {
    let wanted: Vec<&str> = ["amqp091", "amqp10", "nats"]
        .into_iter()
        .filter(|t| server(t))
        .chain(["memory"])
        .collect();
    let table = run(
        env!("CARGO_BIN_EXE_first_delivery"),
        &["1", "--transports", &wanted.join(",")],
    );
    for transport in wanted {
        assert!(
            table.lines().any(|l| l.contains(transport)),
            "no row for {transport} in:\n{table}"
        );
    }
}
