//! `retryctl serve`: a web console for the parking lots of one or more work queues.
//!
//! The console keeps an [`Index`] of each parking queue, built by a walk of
//! the queue (the same [`ParkingLot::browse`] as `retryctl parked list`) and rebuilt every
//! `--refresh`, after every action, and on demand; pages are served from it and say "as of"
//! when it was read. Replays and purges act on the queue through [`ParkingLot`], never on
//! the index: a copy is confirmed before its original is acknowledged.
//!
//! Walks and actions run one at a time per queue, each on a thread of its own with its own
//! connection, opened for it and closed after it: a console left open for days holds no
//! connection between walks and survives a broker restart.

mod auth;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod html;
mod http;
pub mod index;
mod jobs;
mod packed;
mod selection;
mod server;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, mpsc};
use std::time::{Duration, Instant, SystemTime};

use clap::Args;
use retry_core::{
    Depth, DynTransport, ParkingLot, QueueRole, RetryPolicy, Timestamp, TopologyPlan,
};

use crate::broker::{Broker, depth};
use crate::error::CliError;
use crate::runtime::block_on;

pub use index::{Index, IndexBuilder, IndexLimits};

/// `retryctl serve`'s options.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The work queues whose parking lots the console shows (`QUEUE.parking` each).
    #[arg(value_name = "QUEUE", required = true)]
    queues: Vec<String>,
    /// The address to listen on. Any but a loopback address needs a token, from
    /// RETRYCTL_TOKEN or --token-file.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Refused: a token on the command line is shown to every user by `ps`.
    #[arg(long, value_name = "TOKEN", hide = true)]
    token: Option<String>,
    /// A file whose first line is the token every page, action and API call needs (by
    /// `Authorization: Bearer`, or the cookie of a session started at /login). The token
    /// may instead be in the environment variable RETRYCTL_TOKEN; never on the command
    /// line. At least 16 characters other than whitespace, none at either end, no control
    /// characters. Without either, the console draws one at start and prints the link that
    /// logs in with it.
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// A session (the cookie /login sets) ends after this long without a request.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_interval)]
    session_idle: Duration,
    /// A session ends this long after its login, however busy; the cookie's Max-Age.
    #[arg(long, value_name = "DURATION", default_value = "8h", value_parser = parse_interval)]
    session_lifetime: Duration,
    /// How long a client may take to send a request's headers, then its body; a
    /// connection idle for this long between requests is closed. At most 256 connections
    /// are open at once: more wait to be accepted.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_interval)]
    client_timeout: Duration,
    /// How often each parking queue is walked again to refresh its index.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_interval)]
    refresh: Duration,
    /// The most memory the index of each queue may take: what does not fit is counted, not
    /// kept, and the pages say so. Bytes, or with KiB, MiB or GiB.
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_size)]
    index_memory: usize,
    /// The bytes of each body kept in the index and shown on its message page.
    #[arg(long, value_name = "BYTES", default_value = "256", value_parser = parse_size)]
    preview_bytes: usize,
    /// The retry policy (TOML) of the work queues, to show the depth of every queue of
    /// their topology; without it, the work, isolation and parking queues.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// How long a walk, replay or purge may go without reading a message before it gives
    /// up: every message it held then goes back to the queue.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_walk_timeout)]
    walk_timeout: Duration,
}

fn parse_walk_timeout(text: &str) -> Result<Duration, String> {
    let d = parse_interval(text)?;
    // A replay at the slowest rate waits 10 s for each message's turn.
    if d < Duration::from_secs(15) {
        return Err(
            "must be at least 15s: a replay at 0.1 a second waits 10 s between messages".into(),
        );
    }
    Ok(d)
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d >= Duration::from_secs(1) => Ok(d),
        Ok(_) => Err("must be at least 1s".into()),
        Err(e) => Err(format!("{e}: expected a duration such as 30s or 5m")),
    }
}

/// A size in bytes: a number, optionally followed by KiB, MiB or GiB.
fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        other => return Err(format!("unknown unit {other:?}: use B, KiB, MiB or GiB")),
    };
    let n: usize = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size: a number of bytes, KiB, MiB or GiB"))?;
    n.checked_mul(1 << shift)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{text:?} must be above 0 and fit in memory"))
}

/// What the console knows of one work queue.
pub struct Queue {
    /// The work queue.
    pub name: String,
    /// Its parking queue.
    pub parking: String,
    /// The queues whose depth the overview shows, with their role.
    pub shown: Vec<(String, &'static str)>,
    /// The latest finished index, and the depths read with it.
    pub snapshot: RwLock<Arc<Snapshot>>,
    /// The walk under way, if any: messages read so far and since when.
    pub building: Mutex<Option<(u64, Instant)>>,
    /// Held by the walk or action running on this queue.
    busy: Mutex<()>,
    /// Asks the refresher to walk now.
    wake: mpsc::Sender<()>,
}

/// A finished walk of a queue.
#[derive(Default)]
pub struct Snapshot {
    /// The index; empty before the first walk ends. Shared, so that the snapshot after a
    /// failed walk keeps it while pages still read the one before.
    pub index: Arc<Index>,
    /// Each shown queue's depth, in the order of [`Queue::shown`].
    pub depths: Vec<Depth>,
    /// Why the latest walk failed, if it did (the index is then the one before).
    pub error: Option<String>,
    /// How many walks have ended, this one included.
    pub generation: u64,
}

impl Queue {
    /// The latest snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.snapshot.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Asks for a walk now.
    pub fn refresh_now(&self) {
        let _ = self.wake.send(());
    }
}

/// The console's state, shared by every request.
pub struct App {
    /// The token and the session.
    auth: auth::Auth,
    /// The broker's URL, password hidden.
    pub broker_shown: String,
    /// The broker: each walk and action connects to it anew.
    broker: Broker,
    /// The work queues, in the order given.
    pub queues: Vec<Arc<Queue>>,
    /// Replays and purges, newest last.
    pub jobs: jobs::Jobs,
    /// Selections waiting for their confirmation.
    selections: selection::Selections,
    limits: IndexLimits,
    refresh: Duration,
    walk_timeout: Duration,
}

impl App {
    /// The queue named `name`.
    pub fn queue(&self, name: &str) -> Option<&Arc<Queue>> {
        self.queues.iter().find(|q| q.name == name)
    }
}

/// Runs `retryctl serve` until the process is stopped.
pub fn run(args: ServeArgs, broker: &Broker) -> Result<(), CliError> {
    // An unknown scheme or protocol is refused now, not at the first walk.
    broker.registration()?;
    let (token, given) = match given_token(&args, std::env::var_os(TOKEN_ENV))? {
        Some(token) => (token, true),
        None => (
            auth::random_hex(24).map_err(|e| CliError::failure_from("cannot draw a token", e))?,
            false,
        ),
    };
    if !given && !is_loopback(args.listen.ip()) {
        return Err(CliError::usage(format!(
            "--listen {} is not a loopback address: anyone on that network could reach the \
             console; give a token (RETRYCTL_TOKEN or --token-file), or listen on 127.0.0.1",
            args.listen
        )));
    }
    let policy = match &args.policy {
        Some(path) => crate::policy::load_policy(path)?,
        None => RetryPolicy::default(),
    };
    let mut queues = Vec::new();
    let mut refreshers = Vec::new();
    for name in &args.queues {
        let plan = TopologyPlan::new(name, &policy)
            .map_err(|e| CliError::usage_from(format!("work queue {name:?}"), e))?;
        let shown = plan
            .queues()
            .iter()
            .filter(|q| {
                args.policy.is_some()
                    || matches!(
                        q.role,
                        QueueRole::Work | QueueRole::Isolation | QueueRole::Parking
                    )
            })
            .map(|q| (q.name.clone(), role_name(q.role)))
            .collect();
        let (wake, woken) = mpsc::channel();
        refreshers.push(woken);
        queues.push(Arc::new(Queue {
            name: name.clone(),
            parking: TopologyPlan::parking_queue_of(name),
            shown,
            snapshot: RwLock::default(),
            building: Mutex::new(None),
            busy: Mutex::new(()),
            wake,
        }));
    }
    let app = Arc::new(App {
        auth: auth::Auth::new(
            token,
            given,
            auth::SessionLimits {
                idle: args.session_idle,
                lifetime: args.session_lifetime,
                ..auth::SessionLimits::default()
            },
        )
        .map_err(|e| CliError::failure_from("cannot draw a session key", e))?,
        broker_shown: broker.shown(),
        broker: broker.clone(),
        queues,
        jobs: jobs::Jobs::default(),
        selections: selection::Selections::default(),
        limits: IndexLimits {
            memory_cap: args.index_memory,
            preview_bytes: args.preview_bytes,
            ..IndexLimits::default()
        },
        refresh: args.refresh,
        walk_timeout: args.walk_timeout,
    });
    for (queue, woken) in app.queues.iter().zip(refreshers) {
        start_refresher(&app, queue, woken);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::failure_from("cannot start the async runtime", e))?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| CliError::failure_from(format!("cannot listen on {}", args.listen), e))?;
        let at = listener
            .local_addr()
            .map_err(|e| CliError::failure_from("cannot read the address listened on", e))?;
        // `[::1]:8080` for IPv6, as a URL writes it.
        let host = at.to_string();
        if app.auth.given {
            eprintln!("retryctl serve: listening on http://{host}/ (log in with the token you gave)");
        } else {
            eprintln!(
                "retryctl serve: listening on http://{host}/\n  open http://{host}/login?token={} to log in",
                app.auth.token()
            );
        }
        let limits = server::Limits {
            client_timeout: args.client_timeout,
            ..server::Limits::default()
        };
        server::serve(listener, http::router(Arc::clone(&app)), limits)
            .await
            .map_err(|e| CliError::failure_from("the console's server stopped", e))
    })
}

/// The environment variable that may hold the token.
const TOKEN_ENV: &str = "RETRYCTL_TOKEN";

/// The token the operator gave, from `RETRYCTL_TOKEN` (`env`) or `--token-file`, checked;
/// `None` when neither gives one. `--token` is refused: `ps` shows a command line to every
/// user of the machine.
fn given_token(
    args: &ServeArgs,
    env: Option<std::ffi::OsString>,
) -> Result<Option<String>, CliError> {
    if args.token.is_some() {
        return Err(CliError::usage(
            "--token is refused: a command line is shown to every user of the machine by ps; \
             put the token in the environment variable RETRYCTL_TOKEN, or in a file read with \
             --token-file FILE",
        ));
    }
    let (token, source) = match (env, &args.token_file) {
        (Some(_), Some(_)) => {
            return Err(CliError::usage(
                "RETRYCTL_TOKEN and --token-file both give a token: give one of them",
            ));
        }
        (Some(value), None) => {
            let token = value.into_string().map_err(|_| {
                CliError::usage("RETRYCTL_TOKEN is not UTF-8: the token must be text")
            })?;
            (token, TOKEN_ENV.to_owned())
        }
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                CliError::usage_from(format!("cannot read --token-file {}", path.display()), e)
            })?;
            let first = text.lines().next().unwrap_or("").to_owned();
            (
                first,
                format!("the first line of --token-file {}", path.display()),
            )
        }
        (None, None) => return Ok(None),
    };
    check_token(&token)
        .map_err(|problem| CliError::usage(format!("the token in {source} {problem}")))?;
    Ok(Some(token))
}

/// Why `token` cannot be the console's token, in words that never repeat it.
fn check_token(token: &str) -> Result<(), String> {
    const MIN: usize = 16;
    if token.is_empty() {
        return Err("is empty".into());
    }
    if token.starts_with(char::is_whitespace) || token.ends_with(char::is_whitespace) {
        return Err(
            "starts or ends with whitespace: a token copied with a space or a line break \
             around it would be refused at login"
                .into(),
        );
    }
    if token.chars().any(char::is_control) {
        return Err("holds a control character".into());
    }
    let counted = token.chars().filter(|c| !c.is_whitespace()).count();
    if counted < MIN {
        return Err(format!(
            "has {counted} characters other than whitespace, fewer than {MIN}: anyone who can \
             reach the console can try guesses"
        ));
    }
    Ok(())
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn role_name(role: QueueRole) -> &'static str {
    match role {
        QueueRole::Work => "work",
        QueueRole::Delay { .. } => "delay",
        QueueRole::Isolation => "isolation",
        QueueRole::CrashDelay { .. } => "crash delay",
        QueueRole::Parking => "parking",
        _ => "other",
    }
}

/// Starts the thread that walks `queue` at start, every `--refresh`, and when `woken`
/// says so.
fn start_refresher(app: &Arc<App>, queue: &Arc<Queue>, woken: mpsc::Receiver<()>) {
    let app = Arc::clone(app);
    let queue = Arc::clone(queue);
    std::thread::Builder::new()
        .name(format!("index {}", queue.name))
        .spawn(move || {
            loop {
                refresh(&app, &queue);
                match woken.recv_timeout(app.refresh) {
                    Ok(()) | Err(mpsc::RecvTimeoutError::Timeout) => {
                        // Asked several times while walking: one walk answers them all.
                        while woken.try_recv().is_ok() {}
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
        })
        .expect("a thread for the index");
}

/// Walks `queue` once, and publishes the new snapshot (or the error, keeping the last
/// index).
pub fn refresh(app: &App, queue: &Queue) {
    let _busy = queue.busy.lock().unwrap_or_else(|e| e.into_inner());
    *queue.building.lock().unwrap_or_else(|e| e.into_inner()) = Some((0, Instant::now()));
    // A panic fails this walk, with its message; the next walk runs as planned.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        block_on(app.broker.with_transport(&[], async |transport| {
            build_snapshot(transport, app, queue).await
        }))
    }))
    .unwrap_or_else(|panic| Err(CliError::failure(panic_text(&*panic))));
    *queue.building.lock().unwrap_or_else(|e| e.into_inner()) = None;
    let mut slot = queue.snapshot.write().unwrap_or_else(|e| e.into_inner());
    *slot = Arc::new(Snapshot::after(&slot, result.map_err(|e| e.chain())));
}

impl Snapshot {
    /// The snapshot that follows `previous` once a walk ended with `result`: the new index
    /// and depths, or, when the walk failed, the previous ones with the reason.
    fn after(previous: &Arc<Snapshot>, result: Result<(Index, Vec<Depth>), String>) -> Snapshot {
        let generation = previous.generation + 1;
        match result {
            Ok((index, depths)) => Snapshot {
                index: Arc::new(index),
                depths,
                error: None,
                generation,
            },
            Err(error) => Snapshot {
                index: Arc::clone(&previous.index),
                depths: previous.depths.clone(),
                error: Some(error),
                generation,
            },
        }
    }
}

async fn build_snapshot(
    transport: &DynTransport,
    app: &App,
    queue: &Queue,
) -> Result<(Index, Vec<Depth>), CliError> {
    let mut depths = Vec::new();
    for (name, _) in &queue.shown {
        depths.push(depth(transport, name).await?);
    }
    let started = Instant::now();
    // The index being served, shared with the new one where a message is unchanged.
    let previous = queue.snapshot();
    let mut builder = IndexBuilder::new(
        app.limits,
        Timestamp::from_system_time(SystemTime::now()),
        Some(&previous.index),
    );
    let lot = ParkingLot::with_queues(
        transport.clone(),
        queue.name.as_str(),
        queue.parking.as_str(),
    );
    let moved = AtomicU64::new(0);
    let walk = async {
        lot.browse(&retry_core::ParkedFilter::all(), |parked| {
            builder.add(parked.message());
            moved.store(builder.seen(), Ordering::Relaxed);
            if builder.seen().is_multiple_of(256)
                && let Ok(mut b) = queue.building.lock()
            {
                *b = Some((builder.seen(), started));
            }
            std::ops::ControlFlow::Continue(())
        })
        .await
        .map_err(|e| CliError::failure_from(format!("cannot read {}", queue.parking), e))
    };
    watched(walk, &moved, app.walk_timeout, &queue.parking).await?;
    Ok((builder.finish(started.elapsed()), depths))
}

/// Runs `walk` of `queue`, failing it once `moved` (the messages it has read) stays the same
/// for `limit`: a walk never waits forever on one message. The caller then closes the
/// connection, and the broker puts back every message the walk held.
async fn watched<T>(
    walk: impl Future<Output = Result<T, CliError>>,
    moved: &AtomicU64,
    limit: Duration,
    queue: &str,
) -> Result<T, CliError> {
    let watchdog = async {
        let mut last = moved.load(Ordering::Relaxed);
        let mut since = Instant::now();
        loop {
            tokio::time::sleep((limit / 10).max(Duration::from_millis(10))).await;
            let now = moved.load(Ordering::Relaxed);
            if now != last {
                (last, since) = (now, Instant::now());
            } else if since.elapsed() >= limit {
                return CliError::failure(format!(
                    "reading {queue} stalled: no message came in {} after {now} read \
                     (--walk-timeout); the walk gave up and every message it held goes back",
                    humantime::format_duration(limit)
                ));
            }
        }
    };
    tokio::select! {
        result = walk => result,
        stalled = watchdog => Err(stalled),
    }
}

/// What a panic said, for a job or walk it ended.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    let said = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    format!("stopped by a bug in retryctl (a panic: {said}); nothing was lost")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_walk_keeps_the_index_it_replaces_even_while_a_page_reads_it() {
        let mut builder =
            IndexBuilder::new(IndexLimits::default(), Timestamp::from_millis(1), None);
        builder.add(&retry_core::Message::new(
            retry_core::MessageParts::default(),
        ));
        let first = Arc::new(Snapshot::after(
            &Arc::default(),
            Ok((builder.finish(Duration::ZERO), vec![Depth::Ready(1)])),
        ));
        // A request holds the snapshot while the next walk fails.
        let page = Arc::clone(&first);
        let second = Snapshot::after(&first, Err("the broker went away".into()));
        assert_eq!(
            second.index.total, 1,
            "the index the failed walk replaced is kept"
        );
        assert_eq!(second.depths.len(), 1);
        assert_eq!(second.error.as_deref(), Some("the broker went away"));
        assert_eq!(second.generation, 2);
        drop(page);
    }

    #[test]
    fn sizes_and_intervals_are_read_or_refused_naming_the_input() {
        assert_eq!(parse_size("256"), Ok(256));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("2 KiB"), Ok(2048));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_size("MiB").unwrap_err().contains("MiB"));
        assert!(parse_size("99999999999999999999GiB").is_err());
        assert_eq!(parse_interval("90s"), Ok(Duration::from_secs(90)));
        assert!(parse_interval("10ms").is_err());
        assert!(parse_interval("soon").is_err());
    }

    #[test]
    fn a_walk_that_reads_nothing_for_its_limit_is_given_up() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let moved = AtomicU64::new(0);
        let limit = Duration::from_millis(200);
        // A walk that never reads its next message.
        let stuck = runtime.block_on(watched(
            std::future::pending::<Result<(), CliError>>(),
            &moved,
            limit,
            "q.parking",
        ));
        let text = stuck.unwrap_err().chain();
        assert!(
            text.contains("q.parking") && text.contains("stalled"),
            "{text}"
        );
        // A walk that keeps reading, slower than the limit in all but faster per message,
        // is left to finish.
        let reading = async {
            for n in 1..=6 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                moved.store(n, Ordering::Relaxed);
            }
            Ok::<_, CliError>(6)
        };
        assert_eq!(
            runtime
                .block_on(watched(reading, &moved, limit, "q.parking"))
                .unwrap(),
            6
        );
    }

    #[test]
    fn a_token_is_refused_for_its_shape_never_quoting_it() {
        assert_eq!(check_token("0123456789abcdef"), Ok(()));
        assert_eq!(check_token("correct horse battery staple"), Ok(()));
        for (token, problem) in [
            ("", "is empty"),
            (&" ".repeat(16), "whitespace"),
            (" 0123456789abcdef", "whitespace"),
            ("0123456789abcdef\r", "whitespace"),
            ("01234567\u{1b}89abcdef", "control character"),
            ("0123456789abcde", "has 15 characters"),
            ("0123 4567 89ab cde", "has 15 characters"),
        ] {
            let why = check_token(token).unwrap_err();
            assert!(why.contains(problem), "{token:?}: {why}");
            assert!(!why.contains("0123"), "{why}");
        }
    }

    #[test]
    fn loopback_addresses_are_told_apart() {
        for (ip, loopback) in [
            ("127.0.0.1", true),
            ("127.9.9.9", true),
            ("::1", true),
            ("::ffff:127.0.0.1", true),
            ("0.0.0.0", false),
            ("10.0.0.5", false),
            ("::", false),
        ] {
            assert_eq!(is_loopback(ip.parse().unwrap()), loopback, "{ip}");
        }
    }
}
