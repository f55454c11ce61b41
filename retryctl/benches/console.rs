//! What `retryctl serve` costs on a large parking queue of RabbitMQ: the time to build its
//! index, the memory the index takes, and the time to serve a page from it.
//!
//! ```sh
//! cargo bench -p retryctl --bench console               # 100,000 messages, 3 rounds
//! ROUNDS=1 cargo bench -p retryctl --bench console -- 2000
//! ```
//!
//! It parks N (default 100,000) persistent messages of 1 KiB in `Q.parking` of a work queue
//! `Q` of its own (`console-bench-<pid>-<nanos>`), with the headers the engine writes: three
//! reasons, attempts, a parking time spread over the last six hours and last errors from
//! seven templates with variable numbers, ids, addresses and quoted names, which fold into
//! seven failure groups. It then starts the real binary (`CARGO_BIN_EXE_retryctl`) as
//! `retryctl serve Q --listen 127.0.0.1:0 --token … --refresh 1h` and talks to it over HTTP
//! on loopback with the bearer token, one new connection per request. `ROUNDS` times
//! (default 3), interleaved, in alternating order, it measures:
//!
//! * **index build**: the console's walk (`index.walk_seconds` after a
//!   `POST /api/queues/Q/refresh`, and the wall time from the POST until `index.generation`
//!   goes up) against the plain lapin walk a user would write on the same queue, `basic.get`
//!   of every message unacknowledged then closing the channel, which puts them back;
//! * **index memory**: the index's own estimate (`index.bytes`), and the serve process's
//!   peak resident memory (`VmHWM` of `/proc/<pid>/status`) over that of a serve process on
//!   an empty queue of its own (started first, walked once, its pages asked 20 times each),
//!   after each round's walk and once after the console's first walk (at its start), the
//!   only walk with no earlier index alive beside it;
//! * **page serve time**: 200 sequential requests each of `GET /`, the filtered list page
//!   `GET /q/Q/messages?reason=permanent&error=timeout&sort=parked_at&dir=desc` and the JSON
//!   list `GET /api/queues/Q/messages?reason=permanent&error=timeout&per_page=50`, client
//!   side: min, median, p95 and max in ms.
//!
//! It prints each round, then min / median / max over the rounds with the ratios and the
//! goals (pages under 50 ms, index memory under 100 MB with the default 64 MiB cap and
//! 256-byte previews), and the load average. It asserts no timing. At the end (and on an
//! error, as far as it can) it stops the serve processes and deletes its queues.
//! `AMQP_URL` names the broker (loopback: `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bench_support::BoxError;
use bench_support::args::{Args, env_or};
use bench_support::proc::{load1_shown, wait_for_idle_broker};
use bench_support::publish::{confirm_channel, persistent, prefill};
use bench_support::queue::{plain_walk, wait_for_count};
use bench_support::stats::min_median_max;
use bench_support::url::amqp_url;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Connection, ConnectionProperties};
use serde_json::Value;

const USAGE: &str = "usage: cargo bench -p retryctl --bench console [-- MESSAGES] \
                     (ROUNDS=3 and AMQP_URL from the environment)";

/// Requests of each page per round.
const PAGE_REQUESTS: usize = 200;
/// Requests of each page asked of the empty-queue console before its memory is read.
const BASELINE_REQUESTS: usize = 20;
/// The goal for a page, client side, in ms.
const PAGE_GOAL_MS: f64 = 50.0;
/// The goal for the index's memory, in bytes (100 MB).
const MEMORY_GOAL: f64 = 100e6;
const MIB: f64 = 1024.0 * 1024.0;

fn main() -> Result<(), BoxError> {
    let mut args = Args::new(USAGE);
    let mut n: u64 = 100_000;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            // `cargo bench` passes --bench to a bench without the default harness.
            "--bench" => {}
            other if other.starts_with('-') => return Err(args.unknown(other)),
            other => {
                n = other
                    .parse()
                    .map_err(|e| format!("{other:?}: {e}; {USAGE}"))?
            }
        }
    }
    let rounds: usize = env_or("ROUNDS", 3)?;
    if n == 0 || rounds == 0 {
        return Err(format!("MESSAGES and ROUNDS must be above 0; {USAGE}").into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let url = amqp_url();
    let conn = rt.block_on(Connection::connect(&url, ConnectionProperties::default()))?;
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
    let work = format!("console-bench-{}-{nanos}", std::process::id());
    let token = format!("console-bench-token-{nanos:032x}");
    let mut declared = Vec::new();
    let result = bench(
        &rt,
        &conn,
        &Setup {
            url: &url,
            work: &work,
            token: &token,
            n,
            rounds,
        },
        &mut declared,
    );
    // The serve processes were stopped when `bench` dropped them, on any path.
    let deleted = rt.block_on(delete_queues(&conn, &declared));
    let _ = rt.block_on(conn.close(200, "console bench done".into()));
    if let Err(e) = &deleted {
        eprintln!("could not delete every queue of the bench: {e}");
    }
    result.and(deleted)
}

/// What a run is about.
struct Setup<'a> {
    url: &'a str,
    work: &'a str,
    token: &'a str,
    n: u64,
    rounds: usize,
}

/// The figures of one round.
struct Round {
    plain_rate: f64,
    walk_rate: f64,
    wall_rate: f64,
    index_bytes: f64,
    hwm: f64,
    rss: f64,
    /// Per page: min, median, p95, max (ms).
    pages: Vec<[f64; 4]>,
}

fn bench(
    rt: &tokio::runtime::Runtime,
    conn: &Connection,
    setup: &Setup<'_>,
    declared: &mut Vec<String>,
) -> Result<(), BoxError> {
    let Setup {
        url,
        work,
        token,
        n,
        rounds,
    } = *setup;
    let parking = format!("{work}.parking");
    println!(
        "console bench: {n} parked messages of 1 KiB in {parking}, {rounds} round(s); load {} at start",
        load1_shown()
    );

    // The baseline: a console on an empty queue of its own.
    let empty = format!("{work}-empty");
    rt.block_on(declare_topology(conn, &empty, declared))?;
    // The process is killed when `serve` is dropped at the end of the block.
    let (base_rss, base_hwm) = {
        let mut serve = Serve::start(&empty, url, token)?;
        serve.wait_generation(&empty, 0, Duration::from_secs(60))?;
        for path in pages(&empty) {
            for _ in 0..BASELINE_REQUESTS {
                serve.get_ok(&path)?;
            }
        }
        serve
            .memory()
            .ok_or("cannot read the serve process's /proc status")?
    };
    println!(
        "empty-queue console: VmRSS {:.1} MiB, VmHWM {:.1} MiB (after its first walk and {BASELINE_REQUESTS} requests of each page)",
        base_rss as f64 / MIB,
        base_hwm as f64 / MIB
    );

    // Park.
    rt.block_on(declare_topology(conn, work, declared))?;
    let t = Instant::now();
    rt.block_on(park(conn, &parking, n))?;
    let took = t.elapsed().as_secs_f64();
    println!(
        "parked {n} in {took:.1} s ({:.0} msg/s, pipelined with confirms)",
        n as f64 / took
    );
    let check = rt.block_on(conn.create_channel())?;
    let count = rt.block_on(wait_for_count(
        &check,
        &parking,
        queue_count(n)?,
        Duration::from_secs(30),
    ))?;
    if u64::from(count) != n {
        return Err(format!("{parking} holds {count} messages after parking {n}").into());
    }

    // The console: its first walk runs at start.
    let walk_limit = Duration::from_secs(120 + n / 200);
    let t = Instant::now();
    let mut serve = Serve::start(work, url, token)?;
    let first = serve.wait_generation(work, 0, walk_limit)?;
    println!(
        "console started; first walk (at start) read {} in {:.1} s (walk_seconds {:.1}); {} failure groups; load {}",
        first.pointer("/index/read").unwrap_or(&Value::Null),
        t.elapsed().as_secs_f64(),
        number(&first, "/index/walk_seconds")?,
        first.pointer("/groups_total").unwrap_or(&Value::Null),
        load1_shown()
    );
    // The one time only one index was ever built: no earlier index was alive during it.
    let (rss, hwm) = serve
        .memory()
        .ok_or("cannot read the serve process's /proc status")?;
    let first_hwm = hwm.saturating_sub(base_hwm) as f64;
    println!(
        "  after the first walk (no index before it): index {:.1} MiB by its estimate, kept {}, not kept {}; serve VmRSS {:.1} MiB, VmHWM {:.1} MiB: +{:.1} MiB RSS, +{:.1} MiB peak over the empty-queue console",
        number(&first, "/index/bytes")? / MIB,
        first["index"]["kept"],
        first["index"]["not_kept"],
        rss as f64 / MIB,
        hwm as f64 / MIB,
        rss.saturating_sub(base_rss) as f64 / MIB,
        first_hwm / MIB
    );
    for group in first["groups"].as_array().into_iter().flatten() {
        println!(
            "  group {:>7} {:<20} {}",
            group["count"],
            group["reason"].as_str().unwrap_or("other"),
            group["error"].as_str().unwrap_or("")
        );
    }
    let list = serve.get_ok(&pages(work)[2])?;
    let list: Value = serde_json::from_slice(&list.body)?;
    println!(
        "  filter reason=permanent&error=timeout matches {} messages",
        list["matched"]
    );
    rt.block_on(wait_for_count(
        &check,
        &parking,
        queue_count(n)?,
        Duration::from_secs(30),
    ))?;

    let mut figures = Vec::new();
    for round in 0..rounds {
        println!("\nround {} of {rounds} (load {})", round + 1, load1_shown());
        let mut plain_rate = 0.0;
        let mut console = None;
        // Alternate which walk goes first, so that neither always follows the other.
        for step in 0..2 {
            rt.block_on(wait_for_idle_broker());
            if (step + round) % 2 == 0 {
                let t = Instant::now();
                let seen = rt.block_on(plain_walk(conn, &parking))?;
                let took = t.elapsed().as_secs_f64();
                if seen != n {
                    return Err(format!("the plain walk read {seen} of {n}").into());
                }
                plain_rate = n as f64 / took;
                println!(
                    "  plain lapin walk    {n:>8} messages in {took:>7.2} s: {plain_rate:>6.0} msg/s"
                );
            } else {
                console = Some(console_walk(&mut serve, work, n, walk_limit)?);
            }
            let count = rt.block_on(wait_for_count(
                &check,
                &parking,
                queue_count(n)?,
                Duration::from_secs(30),
            ))?;
            if u64::from(count) != n {
                return Err(format!("{parking} holds {count} of {n} after a walk").into());
            }
        }
        let (walk_rate, wall_rate, index_bytes) = console.ok_or("no console walk")?;
        let (rss, hwm) = serve
            .memory()
            .ok_or("cannot read the serve process's /proc status")?;
        println!(
            "  index               {:.1} MiB by its estimate; serve VmRSS {:.1} MiB, VmHWM {:.1} MiB: +{:.1} MiB peak over the empty-queue console",
            index_bytes / MIB,
            rss as f64 / MIB,
            hwm as f64 / MIB,
            hwm.saturating_sub(base_hwm) as f64 / MIB
        );
        let mut page_figures = Vec::new();
        for path in pages(work) {
            let mut ms = Vec::with_capacity(PAGE_REQUESTS);
            let mut size = 0;
            for _ in 0..PAGE_REQUESTS {
                let t = Instant::now();
                let reply = serve.get_ok(&path)?;
                ms.push(t.elapsed().as_secs_f64() * 1e3);
                size = reply.body.len();
            }
            let summary = summary(ms);
            println!(
                "  GET {:<60} {:>7.1} KiB  ms min {:>6.2} median {:>6.2} p95 {:>6.2} max {:>6.2}",
                shorten(&path, work),
                size as f64 / 1024.0,
                summary[0],
                summary[1],
                summary[2],
                summary[3]
            );
            page_figures.push(summary);
        }
        let (rss_after, hwm_after) = serve.memory().unwrap_or((rss, hwm));
        println!(
            "  after the pages     serve VmRSS {:.1} MiB, VmHWM {:.1} MiB",
            rss_after as f64 / MIB,
            hwm_after as f64 / MIB
        );
        figures.push(Round {
            plain_rate,
            walk_rate,
            wall_rate,
            index_bytes,
            hwm: hwm.saturating_sub(base_hwm) as f64,
            rss: rss.saturating_sub(base_rss) as f64,
            pages: page_figures,
        });
    }
    drop(serve);
    print_summary(&figures, first_hwm, work, n);
    Ok(())
}

/// One console walk: POST refresh, wait for the generation to go up. Returns msg/s by
/// `walk_seconds`, msg/s by wall time from the POST, and `index.bytes`.
fn console_walk(
    serve: &mut Serve,
    work: &str,
    n: u64,
    limit: Duration,
) -> Result<(f64, f64, f64), BoxError> {
    let before = number(&serve.queue(work)?, "/index/generation")? as u64;
    let t = Instant::now();
    let reply = serve.request("POST", &format!("/api/queues/{work}/refresh"))?;
    if reply.status != 202 {
        return Err(format!(
            "POST refresh answered {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        )
        .into());
    }
    let state = serve.wait_generation(work, before, limit)?;
    let wall = t.elapsed().as_secs_f64();
    let walk = number(&state, "/index/walk_seconds")?;
    let read = number(&state, "/index/read")? as u64;
    if read != n {
        return Err(format!("the console's walk read {read} of {n}").into());
    }
    let bytes = number(&state, "/index/bytes")?;
    println!(
        "  console walk        {n:>8} messages in {walk:>7.2} s: {:>6.0} msg/s (walk_seconds); POST to generation {:.2} s: {:.0} msg/s; kept {}, not kept {}, cap {:.0} MiB",
        n as f64 / walk,
        wall,
        n as f64 / wall,
        state["index"]["kept"],
        state["index"]["not_kept"],
        number(&state, "/index/memory_cap")? / MIB,
    );
    Ok((n as f64 / walk, n as f64 / wall, bytes))
}

fn print_summary(figures: &[Round], first_hwm: f64, work: &str, n: u64) {
    let col = |f: fn(&Round) -> f64| min_median_max(figures.iter().map(f).collect());
    let line = |what: &str, (a, b, c): (f64, f64, f64), digits: usize| {
        println!("{what:<44} {a:>9.digits$} {b:>9.digits$} {c:>9.digits$}");
    };
    println!(
        "\nsummary: {n} messages, {} round(s); load {} at the end",
        figures.len(),
        load1_shown()
    );
    println!("{:<44} {:>9} {:>9} {:>9}", "", "min", "median", "max");
    println!("index build, msg/s");
    line("  plain lapin walk (baseline)", col(|r| r.plain_rate), 0);
    line("  console, by walk_seconds", col(|r| r.walk_rate), 0);
    line("  console, POST to new generation", col(|r| r.wall_rate), 0);
    line(
        "  ratio console/plain (walk_seconds)",
        col(|r| r.walk_rate / r.plain_rate),
        2,
    );
    line(
        "  ratio console/plain (POST to generation)",
        col(|r| r.wall_rate / r.plain_rate),
        2,
    );
    println!("index memory, MiB");
    line(
        "  index.bytes (its own estimate)",
        col(|r| r.index_bytes / MIB),
        1,
    );
    line(
        "  serve VmHWM over the empty-queue console",
        col(|r| r.hwm / MIB),
        1,
    );
    line(
        "  serve VmRSS over the empty-queue console",
        col(|r| r.rss / MIB),
        1,
    );
    println!(
        "  serve VmHWM over the empty-queue console after the first walk only: {:.1}",
        first_hwm / MIB
    );
    let worst_hwm = figures.iter().map(|r| r.hwm).fold(0.0, f64::max);
    println!(
        "  goal: under 100 MB ({:.1} MiB) with the default cap: {} (peak growth {:.1} MiB)",
        MEMORY_GOAL / MIB,
        if worst_hwm < MEMORY_GOAL {
            "met"
        } else {
            "NOT met"
        },
        worst_hwm / MIB
    );
    println!("page serve time, ms (client side, new connection each; over the rounds)");
    for (i, path) in pages(work).iter().enumerate() {
        println!("  GET {}", shorten(path, work));
        let of = |k: usize| min_median_max(figures.iter().map(|r| r.pages[i][k]).collect());
        line("    median", of(1), 2);
        line("    p95", of(2), 2);
        line("    max", of(3), 2);
    }
    let worst_p95 = figures
        .iter()
        .flat_map(|r| r.pages.iter().map(|p| p[2]))
        .fold(0.0, f64::max);
    let worst = figures
        .iter()
        .flat_map(|r| r.pages.iter().map(|p| p[3]))
        .fold(0.0, f64::max);
    println!(
        "  goal: pages under {PAGE_GOAL_MS:.0} ms: {} (worst p95 {worst_p95:.2} ms, worst single request {worst:.2} ms)",
        if worst_p95 < PAGE_GOAL_MS {
            "met at p95"
        } else {
            "NOT met at p95"
        },
    );
}

/// The three pages measured.
fn pages(work: &str) -> [String; 3] {
    [
        "/".into(),
        format!("/q/{work}/messages?reason=permanent&error=timeout&sort=parked_at&dir=desc"),
        format!("/api/queues/{work}/messages?reason=permanent&error=timeout&per_page=50"),
    ]
}

/// `path` with the queue's name shown as `Q`.
fn shorten(path: &str, work: &str) -> String {
    path.replace(work, "Q")
}

/// min, median, p95 (nearest rank), max of `values` (not empty).
fn summary(values: Vec<f64>) -> [f64; 4] {
    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    let p95 = sorted[((sorted.len() as f64 * 0.95).ceil() as usize).clamp(1, sorted.len()) - 1];
    let (min, median, max) = min_median_max(values);
    [min, median, p95, max]
}

fn number(value: &Value, pointer: &str) -> Result<f64, BoxError> {
    value
        .pointer(pointer)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("the console's JSON has no number at {pointer}: {value}").into())
}

fn queue_count(n: u64) -> Result<u32, BoxError> {
    u32::try_from(n).map_err(|_| "too many messages for one queue's count".into())
}

// ---- the broker ----

/// Declares `work`, `work.parking` and `work.suspect`: durable, classic.
async fn declare_topology(
    conn: &Connection,
    work: &str,
    declared: &mut Vec<String>,
) -> Result<(), BoxError> {
    let ch = conn.create_channel().await?;
    for name in [
        work.to_owned(),
        format!("{work}.parking"),
        format!("{work}.suspect"),
    ] {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from("classic")),
        );
        ch.queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            arguments,
        )
        .await?;
        declared.push(name);
    }
    ch.close(200, "declared".into()).await?;
    Ok(())
}

/// Deletes `queues`, each on a channel of its own (a missing one closes its channel).
async fn delete_queues(conn: &Connection, queues: &[String]) -> Result<(), BoxError> {
    let mut failed = Vec::new();
    for name in queues {
        let deleted = async {
            let ch = conn.create_channel().await?;
            ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await?;
            ch.close(200, "deleted".into()).await?;
            Ok::<_, BoxError>(())
        }
        .await;
        if let Err(e) = deleted {
            failed.push(format!("{name}: {e}"));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; ").into())
    }
}

/// splitmix64: the pseudo-random numbers of the parked messages, the same every run.
fn mix(i: u64) -> u64 {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Message `i`'s reason, attempts and last error: seven templates, one reason each.
fn failure(i: u64) -> (&'static str, i64, String) {
    let h = mix(i);
    let r = mix(h);
    let ms = 1_000 + r % 59_000;
    match h % 100 {
        0..25 => ("permanent", 1, format!("order {} not found", 100_000 + i)),
        25..35 => (
            "permanent",
            1 + (r % 2) as i64,
            format!(
                "upstream timeout: request {:08x}-{:04x}-{:04x}-{:04x}-{:012x} took {ms} ms",
                r >> 32,
                (r >> 16) & 0xffff,
                r & 0xffff,
                (h >> 16) & 0xffff,
                h & 0xffff_ffff_ffff
            ),
        ),
        35..40 => {
            let field = ["customer_id", "amount", "currency", "sku"][(r % 4) as usize];
            (
                "permanent",
                1,
                format!("invalid payload: field \"{field}\" is missing"),
            )
        }
        40..62 => ("attempts-exhausted", 5, format!("db timeout after {ms} ms")),
        62..80 => (
            "attempts-exhausted",
            5,
            format!(
                "connect to 10.0.{}.{}:5432 refused",
                r % 8,
                (r >> 8) % 250 + 1
            ),
        ),
        80..90 => (
            "attempts-exhausted",
            5,
            format!(
                "HTTP 503 from payments for customer user{}@example.com",
                r % 5_000
            ),
        ),
        _ => (
            "crash-loop",
            1 + (r % 3) as i64,
            format!(
                "consumer crashed {} times running it (last on worker-{})",
                3 + r % 3,
                r % 16
            ),
        ),
    }
}

/// Parks `n` persistent 1 KiB messages in `parking` with the engine's headers, pipelined
/// with confirms.
async fn park(conn: &Connection, parking: &str, n: u64) -> Result<(), BoxError> {
    let ch = confirm_channel(conn).await?;
    let body = vec![b'x'; 1024];
    let now_ms = i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis())?;
    const SPREAD_MS: u64 = 6 * 3600 * 1000;
    prefill(&ch, parking, n, |i| {
        let (reason, attempts, error) = failure(i);
        let mut headers = FieldTable::default();
        headers.insert(
            "x-retry-reason".into(),
            AMQPValue::LongString(LongString::from(reason)),
        );
        headers.insert("x-retry-attempts".into(), AMQPValue::LongLongInt(attempts));
        let ago = (mix(i ^ 0x5555) % SPREAD_MS) as i64;
        headers.insert(
            "x-retry-last-failure".into(),
            AMQPValue::LongLongInt(now_ms - ago),
        );
        headers.insert(
            "x-retry-last-error".into(),
            AMQPValue::LongString(LongString::from(error)),
        );
        let properties = persistent()
            .with_message_id(format!("m{i}").into())
            .with_headers(headers);
        (&body, properties)
    })
    .await?;
    ch.close(200, "parked".into()).await?;
    Ok(())
}

// ---- the console ----

/// A running `retryctl serve`, killed when dropped.
struct Serve {
    child: Child,
    addr: SocketAddr,
    token: String,
    stderr: Arc<Mutex<String>>,
}

/// An HTTP response: its status and body.
struct Reply {
    status: u16,
    body: Vec<u8>,
}

impl Serve {
    /// Starts `retryctl serve work` on a port the system picks; returns once it listens.
    fn start(work: &str, url: &str, token: &str) -> Result<Serve, BoxError> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_retryctl"))
            .args(["serve", work, "--listen", "127.0.0.1:0"])
            .args(["--refresh", "1h"])
            .env("AMQP_URL", url)
            .env("RETRYCTL_TOKEN", token)
            .env_remove("RETRYCTL_PROTOCOL")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        let pipe = child.stderr.take().ok_or("no stderr pipe")?;
        let text = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or("").to_owned());
                }
                let mut text = text.lock().unwrap_or_else(|e| e.into_inner());
                text.push_str(&line);
                text.push('\n');
            }
        });
        let mut serve = Serve {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: token.to_owned(),
            stderr,
        };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => {
                serve.addr = addr
                    .parse()
                    .map_err(|e| format!("retryctl serve listens on {addr:?}: {e}"))?;
                Ok(serve)
            }
            Err(_) => {
                let status = serve.child.try_wait()?;
                Err(format!(
                    "retryctl serve did not say where it listens (exit {status:?}); stderr:\n{}",
                    serve.stderr()
                )
                .into())
            }
        }
    }

    fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// VmRSS and VmHWM of the process, in bytes.
    fn memory(&self) -> Option<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let field = |name: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(name))?;
            Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }

    /// One request on a new connection, `Connection: close`, read to the end.
    fn request(&self, method: &str, path: &str) -> Result<Reply, BoxError> {
        let mut stream = TcpStream::connect_timeout(&self.addr, Duration::from_secs(10))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\
             Connection: close\r\nContent-Length: 0\r\n\r\n",
            self.addr, self.token
        );
        stream.write_all(request.as_bytes())?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw)?;
        parse_response(&raw).map_err(|e| format!("{method} {path}: {e}").into())
    }

    /// A GET that must answer 200.
    fn get_ok(&self, path: &str) -> Result<Reply, BoxError> {
        let reply = self.request("GET", path)?;
        if reply.status != 200 {
            return Err(format!(
                "GET {path} answered {}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            )
            .into());
        }
        Ok(reply)
    }

    /// `GET /api/queues/work`, parsed.
    fn queue(&self, work: &str) -> Result<Value, BoxError> {
        let reply = self.get_ok(&format!("/api/queues/{work}"))?;
        Ok(serde_json::from_slice(&reply.body)?)
    }

    /// Polls `GET /api/queues/work` every 50 ms until `index.generation` is above `above`;
    /// an error if that walk failed, or none ends within `limit`.
    fn wait_generation(
        &mut self,
        work: &str,
        above: u64,
        limit: Duration,
    ) -> Result<Value, BoxError> {
        let start = Instant::now();
        let mut told = Instant::now();
        loop {
            let state = self.queue(work)?;
            if number(&state, "/index/generation")? as u64 > above {
                if let Some(error) = state.pointer("/index/error").filter(|e| !e.is_null()) {
                    return Err(format!("the console's walk failed: {error}").into());
                }
                return Ok(state);
            }
            if start.elapsed() > limit {
                return Err(format!(
                    "no walk ended within {limit:?}: {}; stderr:\n{}",
                    state["index"],
                    self.stderr()
                )
                .into());
            }
            if let Some(status) = self.child.try_wait()? {
                return Err(format!(
                    "retryctl serve exited ({status}); stderr:\n{}",
                    self.stderr()
                )
                .into());
            }
            if told.elapsed() > Duration::from_secs(15) {
                eprintln!(
                    "  … walking: {} after {:.0} s",
                    state["index"]["building"],
                    start.elapsed().as_secs_f64()
                );
                told = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status and body of an HTTP/1.1 response read to its end (a `Content-Length` body,
/// a chunked one, or one ended by the connection's close).
fn parse_response(raw: &[u8]) -> Result<Reply, BoxError> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers in the response")?;
    let head = std::str::from_utf8(&raw[..end])?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or("no status in the response")?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>()?);
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = length {
        rest.get(..length)
            .ok_or("the body is shorter than its Content-Length")?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Reply { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, BoxError> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without its size line")?;
        let size_text = std::str::from_utf8(&rest[..line_end])?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(rest.get(..size).ok_or("a chunk cut short")?);
        rest = rest.get(size + 2..).ok_or("a chunk cut short")?;
    }
}
