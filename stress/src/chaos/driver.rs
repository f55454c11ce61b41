//! The chaos driver: publishes a run's messages with confirms, keeps consumer processes
//! running, injects faults on a seeded schedule (SIGKILLs, connections closed by the
//! broker, a `stop_app`/`start_app` of the private node), waits until every message is
//! accounted for, stops the consumers gracefully, drains every queue of the plan and
//! reconciles ([`reconcile`](super::reconcile)).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, ConnectionProperties};
use retry_core::{
    ParkedRecord, RetryPolicy, Settlement, Subscription, TopologyPlan, Transport, splitmix64,
};
use tokio::process::{Child, ChildStdin, Command};
use tokio::task::JoinHandle;
use transport_amqp10::Amqp10Transport;
use transport_amqp091::{AmqpConfig, AmqpTransport};

use super::consumer::{ConsumerArgs, Protocol, amqp10_config, amqp091_config, cluster_plan};
use super::journal::{self, Entry, JournalWriter};
use super::node::{PrivateNode, local_ports};
use super::reconcile::{Drained, Reconciled, RunFacts, reconcile};
use super::script::{self, Class, Mix};
use conformance::rabbitmq::{Admin, unique_name};
use test_brokers::rabbitmq::try_cluster_sh;

/// Where a chaos run's consumers run, and what its broker faults do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Broker {
    /// A private node ([`PrivateNode`]) on this port: a broker fault is a
    /// `stop_app`/`start_app` of it, and connections are closed by force.
    Node(u16),
    /// The three-node cluster of `stress/cluster.sh`, by its AMQP 0-9-1 node list: the plan's
    /// queues are quorum queues on all three nodes, the consumers are given the whole list,
    /// and a broker fault stops one node gracefully or kills it (by turns), the next node
    /// each time, then starts it again. Connections are not closed by force there.
    Cluster(Vec<String>),
}

impl Broker {
    /// What a consumer process is given for `protocol`: one URL, or the node list joined by
    /// commas.
    pub fn url(&self, protocol: Protocol) -> String {
        match self {
            Broker::Node(port) => protocol.url(*port),
            Broker::Cluster(urls) => urls.join(","),
        }
    }

    /// The AMQP 0-9-1 URLs to publish and check through, in order of preference.
    fn urls091(&self) -> Vec<String> {
        match self {
            Broker::Node(port) => vec![Protocol::Amqp091.url(*port)],
            Broker::Cluster(urls) => urls.clone(),
        }
    }

    /// An AMQP 0-9-1 transport's configuration for it.
    fn config091(&self, name: String) -> AmqpConfig {
        amqp091_config(&self.url(Protocol::Amqp091))
            .expect("the broker's URL")
            .with_connection_name(name)
    }

    /// The plan of a run on it.
    fn plan(&self, queue: &str, policy: &RetryPolicy) -> TopologyPlan {
        let builder = TopologyPlan::builder(queue, policy);
        match self {
            Broker::Node(_) => builder,
            Broker::Cluster(_) => cluster_plan(builder),
        }
        .build()
        .expect("a chaos plan")
    }

    /// Takes the broker down (`turn` picks the node and the way on a cluster), blocking.
    fn down(&self, turn: usize) -> Result<String, String> {
        match self {
            Broker::Node(port) => PrivateNode::attach(*port)
                .stop_app()
                .map(|()| String::new()),
            Broker::Cluster(_) => {
                let (node, how) = cluster_turn(turn);
                try_cluster_sh(&[how, &node]).map(|()| format!("node={node} how={how}"))
            }
        }
    }

    /// Brings back what [`down`](Self::down) took down, blocking.
    fn up(&self, turn: usize) -> Result<String, String> {
        match self {
            Broker::Node(port) => PrivateNode::attach(*port)
                .start_app()
                .map(|()| String::new()),
            Broker::Cluster(_) => {
                let (node, _) = cluster_turn(turn);
                try_cluster_sh(&["start", &node]).map(|()| format!("node={node}"))
            }
        }
    }
}

/// The cluster node a broker fault takes down on its `turn`, and how: rtest1, rtest2,
/// rtest3 in turn, stopped and killed by turns.
fn cluster_turn(turn: usize) -> (String, &'static str) {
    let how = if turn.is_multiple_of(2) {
        "stop"
    } else {
        "kill"
    };
    (format!("rtest{}", turn % 3 + 1), how)
}

/// A chaos run's settings.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    /// The transport the consumers run on.
    pub protocol: Protocol,
    /// The `chaos_consumer` binary.
    pub consumer_exe: PathBuf,
    /// Messages published before the consumers start.
    pub messages: usize,
    /// What their handlers do.
    pub mix: Mix,
    /// Seeds the mix and the fault schedule.
    pub seed: u64,
    /// Each consumer's prefetch.
    pub prefetch: u16,
    /// How long each handler run takes.
    pub handler: Duration,
    /// The policy's crash limit.
    pub crash_limit: u32,
    /// The policy's first delay (the second is twice as long), also its crash delay.
    pub delay: Duration,
    /// Consumer processes running at once.
    pub consumers: usize,
    /// The window the faults are spread over, from the consumers' start.
    pub chaos: Duration,
    /// SIGKILLs of a consumer process.
    pub kills: usize,
    /// Forced closes of a consumer process's connections.
    pub closes: usize,
    /// `stop_app`/`start_app` cycles of the node.
    pub app_restarts: usize,
    /// How long the application stays stopped.
    pub app_down: Duration,
    /// How long, after the chaos window, the run may take to account for every message.
    pub settle_time: Duration,
    /// Where the journal goes (a file named after the queue when `None`).
    pub journal: Option<PathBuf>,
    /// With a rate, the messages are published at that many a second from the consumers'
    /// start, through every fault, instead of all before it; the chaos window should then
    /// be as long as the publishing (`messages / rate` seconds).
    pub rate: Option<u32>,
    /// Whether the process in the first slot is sampled ([`Sample`]) once a second. Give
    /// such a run no kills and no poison: a sample curve is one process's.
    pub sample: bool,
}

impl ChaosConfig {
    /// The issue's run: 20,000 messages at prefetch 20 with a 20 ms handler, 20 % failing
    /// once, 10 % always, 10 % permanently and one poison message; 45 s of chaos with 11
    /// SIGKILLs, 10 forced connection closes and one `stop_app`/`start_app`.
    pub fn full(protocol: Protocol, consumer_exe: PathBuf, seed: u64) -> Self {
        ChaosConfig {
            protocol,
            consumer_exe,
            messages: 20_000,
            mix: Mix::issue(1),
            seed,
            prefetch: 20,
            handler: Duration::from_millis(20),
            crash_limit: 2,
            delay: Duration::from_millis(300),
            consumers: 2,
            chaos: Duration::from_secs(45),
            kills: 11,
            closes: 10,
            app_restarts: 1,
            app_down: Duration::from_secs(3),
            settle_time: Duration::from_secs(300),
            journal: None,
            rate: None,
            sample: false,
        }
    }

    /// Prefetch 20 and `poison` poison messages among `messages` healthy ones, with no
    /// injected faults but the poison's aborts.
    pub fn poison_heavy(
        protocol: Protocol,
        consumer_exe: PathBuf,
        seed: u64,
        messages: usize,
        poison: usize,
    ) -> Self {
        ChaosConfig {
            messages,
            mix: Mix {
                once: 0.0,
                always: 0.0,
                permanent: 0.0,
                poison,
            },
            crash_limit: 1,
            kills: 0,
            closes: 0,
            app_restarts: 0,
            chaos: Duration::ZERO,
            settle_time: Duration::from_secs(240),
            ..Self::full(protocol, consumer_exe, seed)
        }
    }
}

/// The faults a run injected, and how its processes ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Consumer processes started.
    pub spawns: usize,
    /// SIGKILLs sent.
    pub kills: usize,
    /// SIGKILLs that hit a process holding a suspect (no other was free for long).
    pub kills_during_solo: usize,
    /// Forced closes, and the connections they closed. A close that finds the process
    /// with no connection is tried once more, 500 ms later, and counted again.
    pub closes: (usize, usize),
    /// `stop_app`/`start_app` cycles.
    pub app_restarts: usize,
    /// Processes that aborted (poison).
    pub aborts: usize,
    /// Processes whose `run` ended with an error, while the node was up.
    pub error_exits: usize,
    /// Processes that ended with an error while the node's application was stopped
    /// (connecting failed).
    pub error_exits_while_down: usize,
}

/// What a chaos run found.
#[derive(Debug)]
pub struct ChaosOutcome {
    /// The transport.
    pub protocol: Protocol,
    /// The seed.
    pub seed: u64,
    /// What became of the messages.
    pub reconciled: Reconciled,
    /// The faults injected.
    pub faults: Faults,
    /// From the consumers' start to the last message accounted for.
    pub took: Duration,
    /// Whether the run gave up waiting for messages to be accounted for.
    pub timed_out: bool,
    /// The crash limit.
    pub crash_limit: u32,
    /// The journal.
    pub journal: PathBuf,
    /// Error exits' reasons, from the journal.
    pub exit_errors: Vec<String>,
    /// The first slot's process, once a second, when the run samples it.
    pub samples: Vec<Sample>,
    /// Messages a paced publisher had not published when the run ended.
    pub unpublished: usize,
}

/// A consumer process's resources at one moment, from `/proc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Since the consumers' start.
    pub at: Duration,
    /// The process sampled.
    pub pid: u32,
    /// Resident set size, in KiB (`VmRSS`).
    pub rss_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
}

impl Sample {
    /// Process `pid` now, or `None` once it has ended.
    pub fn of(pid: u32, at: Duration) -> Option<Sample> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
        Some(Sample {
            at,
            pid,
            rss_kib: field("VmRSS:")?,
            fds,
            threads: field("Threads:")?,
        })
    }
}

impl ChaosOutcome {
    /// Everything that breaks the rules; empty for a clean run.
    pub fn problems(&self) -> Vec<String> {
        let mut out = self.reconciled.problems(self.crash_limit);
        if self.timed_out {
            out.push("timed out before every message was accounted for".into());
        }
        if self.unpublished > 0 {
            out.push(format!(
                "{} messages were never published: the publisher fell behind or hung",
                self.unpublished
            ));
        }
        if self.reconciled.bad_lines > 0 {
            out.push(format!(
                "{} journal lines did not parse",
                self.reconciled.bad_lines
            ));
        }
        out
    }

    /// One paragraph of figures.
    pub fn summary(&self) -> String {
        let r = &self.reconciled;
        let f = &self.faults;
        let poison: Vec<String> = r
            .poison
            .iter()
            .map(|p| {
                format!(
                    "{} solo {} work {} kills {} parked-crashes {:?}",
                    p.id, p.solo_runs, p.work_runs, p.kill_charges, p.parked_crashes
                )
            })
            .collect();
        let mut s = String::new();
        let _ = write!(
            s,
            "chaos {} seed {}: {} messages, {} handled, {} parked, {} lost, {} stuck; duplicates {} messages (+{} runs), {} extra parked copies; healthy parked {}, wrongly blamed {}, blamed across processes {}, charged by an injected kill {}, not-alone {}, poison charges without a solo run {}; poison (limit {}): [{}]; faults: {} kills ({} during a solo run), {} closes ({} connections), {} stop_app/start_app, {} aborts, {} error exits (+{} while the app was down), {} processes; {:.1?}{}",
            self.protocol.name(),
            self.seed,
            r.messages,
            r.handled,
            r.parked,
            r.lost.len(),
            r.stuck.len(),
            r.duplicates.0,
            r.duplicates.1,
            r.parked_duplicates,
            r.healthy_parked.len(),
            r.wrongly_blamed.len(),
            r.blamed_across_processes.len(),
            r.charged_by_kill.len(),
            r.alone_violations.len(),
            r.poison_unexplained.len(),
            self.crash_limit,
            poison.join("; "),
            f.kills,
            f.kills_during_solo,
            f.closes.0,
            f.closes.1,
            f.app_restarts,
            f.aborts,
            f.error_exits,
            f.error_exits_while_down,
            f.spawns,
            self.took,
            if self.timed_out { " (TIMED OUT)" } else { "" },
        );
        let left: Vec<String> = r
            .left
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(q, n)| format!("{}={n}", if q.is_empty() { "work" } else { q }))
            .collect();
        let _ = write!(s, "; left in queues: [{}]", left.join(" "));
        s
    }
}

/// A small seeded generator for the fault schedule.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn within(&mut self, from: Duration, to: Duration) -> Duration {
        let span = to.saturating_sub(from).as_millis() as u64;
        from + Duration::from_millis(if span == 0 { 0 } else { self.next() % span })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill,
    Close,
    StopApp,
    StartApp,
}

fn schedule(config: &ChaosConfig, rng: &mut Rng) -> Vec<(Duration, Fault)> {
    let start = Duration::from_secs(1).min(config.chaos);
    let mut out = Vec::new();
    for _ in 0..config.kills {
        out.push((rng.within(start, config.chaos), Fault::Kill));
    }
    for _ in 0..config.closes {
        out.push((rng.within(start, config.chaos), Fault::Close));
    }
    for i in 0..config.app_restarts {
        // Spread over the window, one per slice, each well inside it.
        let slice = config.chaos / config.app_restarts as u32;
        let from = slice * i as u32 + slice / 4;
        let at = rng.within(from, from + slice / 2);
        out.push((at, Fault::StopApp));
        out.push((at + config.app_down, Fault::StartApp));
    }
    out.sort_by_key(|(at, _)| *at);
    out
}

/// Reads the journal as it grows, keeping what the driver needs while the run goes on.
struct Tail {
    file: Option<File>,
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    /// Messages handled (healthy) or parked.
    accounted: HashSet<String>,
    /// Per process, the suspects it holds from the isolation queue.
    solo: HashMap<u32, HashSet<String>>,
    /// Copies on their way to the parking lot, by process, waiting for their confirm.
    parking: HashSet<(u32, String)>,
}

impl Tail {
    fn new(path: &Path) -> Self {
        Tail {
            file: None,
            path: path.to_owned(),
            offset: 0,
            partial: Vec::new(),
            accounted: HashSet::new(),
            solo: HashMap::new(),
            parking: HashSet::new(),
        }
    }

    fn poll(&mut self) {
        if self.file.is_none() {
            self.file = File::open(&self.path).ok();
        }
        let Some(file) = self.file.as_mut() else {
            return;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return;
        }
        let mut bytes = Vec::new();
        let Ok(n) = file.read_to_end(&mut bytes) else {
            return;
        };
        self.offset += n as u64;
        self.partial.extend_from_slice(&bytes);
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let whole: Vec<u8> = self.partial.drain(..=end).collect();
        let text = String::from_utf8_lossy(&whole);
        for line in text.lines() {
            let mut words = line.splitn(5, ' ');
            let (Some(_), Some(pid), Some(kind), Some(id)) =
                (words.next(), words.next(), words.next(), words.next())
            else {
                continue;
            };
            let fields = words.next().unwrap_or("");
            let pid: u32 = pid.parse().unwrap_or(0);
            match kind {
                "ran" if fields.contains("outcome=ok") => {
                    self.accounted.insert(id.to_owned());
                }
                "terminal" if fields.contains("t=parked") => {
                    self.accounted.insert(id.to_owned());
                }
                // A parking copy carries its reason; a retry or an isolation copy has none.
                "publish" if fields.contains("reason=") && !fields.contains("reason=-") => {
                    self.parking.insert((pid, id.to_owned()));
                }
                // Once the broker confirmed the parking copy, the message is parked, even if
                // its process dies before it journals the terminal: were the original's ack
                // lost with it, the original comes back, and the reconciliation counts the
                // second copy.
                "published"
                    if self.parking.remove(&(pid, id.to_owned()))
                        && fields.contains("result=confirmed") =>
                {
                    self.accounted.insert(id.to_owned());
                }
                "recv" if fields.contains("lane=isolation") => {
                    self.solo.entry(pid).or_default().insert(id.to_owned());
                }
                "settled" | "terminal" => {
                    if let Some(held) = self.solo.get_mut(&pid) {
                        held.remove(id);
                    }
                }
                _ => {}
            }
        }
    }

    fn holds_suspect(&self, pid: u32) -> bool {
        self.solo.get(&pid).is_some_and(|s| !s.is_empty())
    }
}

struct Proc {
    child: Child,
    pid: u32,
    stdin: Option<ChildStdin>,
}

/// Consumer processes and the faults done to them.
struct Fleet<'a> {
    config: &'a ChaosConfig,
    args: ConsumerArgs,
    journal: Arc<JournalWriter>,
    slots: Vec<Option<Proc>>,
    respawn_at: Vec<Option<Instant>>,
    faults: Faults,
    app_down: bool,
    stderr: PathBuf,
}

impl Fleet<'_> {
    fn spawn(&mut self, slot: usize) {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr)
            .map_or_else(|_| Stdio::null(), Stdio::from);
        // Through a shell that turns core dumps off (each abort would leave one); `exec`
        // keeps the pid, so the exit status is the consumer's own.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("ulimit -c 0 && exec \"$0\" \"$@\"")
            .arg(&self.config.consumer_exe)
            .args(self.args.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("a chaos consumer starts");
        let pid = child.id().unwrap_or(0);
        self.journal
            .line("spawn", "-", format_args!("pid={pid} slot={slot}"));
        self.faults.spawns += 1;
        let stdin = child.stdin.take();
        self.slots[slot] = Some(Proc { child, pid, stdin });
        self.respawn_at[slot] = None;
    }

    /// Notices processes that ended, and starts new ones where it is time.
    fn tend(&mut self, respawn: bool) {
        let now = Instant::now();
        for slot in 0..self.slots.len() {
            if let Some(proc) = self.slots[slot].as_mut()
                && let Ok(Some(status)) = proc.child.try_wait()
            {
                let pid = proc.pid;
                self.journal.line(
                    "exited",
                    "-",
                    format_args!("pid={pid} status={}", status_word(status)),
                );
                self.slots[slot] = None;
                let wait = match status.signal() {
                    Some(6) => {
                        self.faults.aborts += 1;
                        Duration::ZERO
                    }
                    Some(_) => Duration::ZERO,
                    None if status.success() => Duration::ZERO,
                    None => {
                        if self.app_down {
                            self.faults.error_exits_while_down += 1;
                        } else {
                            self.faults.error_exits += 1;
                        }
                        Duration::from_millis(500)
                    }
                };
                self.respawn_at[slot] = Some(now + wait);
            }
            if respawn
                && self.slots[slot].is_none()
                && self.respawn_at[slot].is_none_or(|at| at <= now)
            {
                self.spawn(slot);
            }
        }
    }

    fn live(&self) -> Vec<u32> {
        self.slots.iter().flatten().map(|p| p.pid).collect()
    }

    fn kill(&mut self, pid: u32, during_solo: bool) {
        for proc in self.slots.iter_mut().flatten() {
            if proc.pid == pid {
                self.journal.line(
                    "kill",
                    "-",
                    format_args!("pid={pid} holding-suspect={during_solo}"),
                );
                let _ = proc.child.start_kill();
                self.faults.kills += 1;
                self.faults.kills_during_solo += usize::from(during_solo);
            }
        }
    }

    /// Closes standard input of every process and waits for each to stop; kills those
    /// that do not stop within `grace`.
    async fn stop_all(&mut self, grace: Duration) {
        for proc in self.slots.iter_mut().flatten() {
            self.journal
                .line("shutdown", "-", format_args!("pid={}", proc.pid));
            drop(proc.stdin.take());
        }
        for slot in 0..self.slots.len() {
            let Some(mut proc) = self.slots[slot].take() else {
                continue;
            };
            let status = match tokio::time::timeout(grace, proc.child.wait()).await {
                Ok(Ok(status)) => status_word(status),
                _ => {
                    let _ = proc.child.kill().await;
                    "killed-after-grace".to_owned()
                }
            };
            self.journal.line(
                "exited",
                "-",
                format_args!("pid={} status={status}", proc.pid),
            );
        }
    }
}

fn status_word(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("code:{code}"),
        (_, Some(signal)) => format!("signal:{signal}"),
        _ => "unknown".to_owned(),
    }
}

/// Declares `plan` over AMQP 0-9-1 (the AMQP 1.0 plugin cannot declare queues with
/// arguments).
async fn provision(broker: &Broker, plan: &TopologyPlan) {
    let t = AmqpTransport::connect(broker.config091(unique_name("chaos-provision")))
        .await
        .expect("the provisioning connection opens");
    t.provision(plan).await.expect("provision the chaos plan");
    let _ = t.close().await;
}

/// Publishes `ids` to `queue` as persistent messages (body: the id), waiting for every
/// confirm.
pub async fn publish_all(url: &str, queue: &str, ids: &[String]) {
    let connection = lapin::Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("the publisher connects");
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    for chunk in ids.chunks(500) {
        let mut confirms = Vec::with_capacity(chunk.len());
        for id in chunk {
            confirms.push(publish_one(&channel, queue, id).await.expect("publish"));
        }
        for confirm in confirms {
            let confirm = confirm.await.expect("a confirm");
            assert!(confirm.is_ack(), "a test message was not confirmed");
        }
    }
    let _ = connection.close(200, "published".into()).await;
}

/// Publishes the test message `id` to `queue`: persistent, its id as message id and body.
async fn publish_one(
    channel: &lapin::Channel,
    queue: &str,
    id: &str,
) -> lapin::Result<lapin::PublisherConfirm> {
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            id.as_bytes(),
            BasicProperties::default()
                .with_message_id(id.into())
                .with_delivery_mode(2),
        )
        .await
}

/// Publishes `ids` to `queue` at `rate` a second, in batches every 100 ms, journaling each
/// `sent` once confirmed. Through the faults: a batch whose connection fails, or which the
/// broker nacks, is published again on a new connection (so a message may arrive twice,
/// never not at all); connecting is tried again every 500 ms while the node is down.
async fn publish_paced(
    urls: Vec<String>,
    queue: String,
    ids: Vec<String>,
    rate: u32,
    journal: Arc<JournalWriter>,
) {
    let per_tick = (rate as usize).div_ceil(10).max(1);
    let start = Instant::now();
    let mut channel: Option<(lapin::Connection, lapin::Channel)> = None;
    for (n, batch) in ids.chunks(per_tick).enumerate() {
        let due = start + Duration::from_millis(1000 * (n * per_tick) as u64 / u64::from(rate));
        tokio::time::sleep_until(due.into()).await;
        loop {
            if channel.is_none() {
                channel = open_confirm_channel(&urls).await;
            }
            let Some((_, ch)) = channel.as_ref() else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            if publish_confirmed(ch, &queue, batch).await {
                for id in batch {
                    journal.line("sent", id, format_args!("queue={queue}"));
                }
                break;
            }
            if let Some((conn, _)) = channel.take() {
                close_within(conn, "publishing again").await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    if let Some((conn, _)) = channel {
        close_within(conn, "published").await;
    }
}

/// Closes `conn`, giving up after 2 s: a close on a connection to a node that went away can
/// wait for a `close-ok` forever.
async fn close_within(conn: lapin::Connection, why: &str) {
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, why.into())).await;
}

/// A confirm channel on the first of `urls` that opens one within 5 s.
async fn open_confirm_channel(urls: &[String]) -> Option<(lapin::Connection, lapin::Channel)> {
    for url in urls {
        let open = async {
            let conn = lapin::Connection::connect(url, ConnectionProperties::default())
                .await
                .ok()?;
            let ch = conn.create_channel().await.ok()?;
            ch.confirm_select(ConfirmSelectOptions::default())
                .await
                .ok()?;
            Some((conn, ch))
        };
        if let Ok(Some(opened)) = tokio::time::timeout(Duration::from_secs(5), open).await {
            return Some(opened);
        }
    }
    None
}

/// Whether every message of `ids` was published to `queue` and acked within 10 s.
async fn publish_confirmed(channel: &lapin::Channel, queue: &str, ids: &[String]) -> bool {
    let all = async {
        let mut confirms = Vec::with_capacity(ids.len());
        for id in ids {
            confirms.push(publish_one(channel, queue, id).await.ok()?);
        }
        for confirm in confirms {
            if !confirm.await.ok()?.is_ack() {
                return None;
            }
        }
        Some(())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(10), all).await,
        Ok(Some(()))
    )
}

/// Takes every message out of every queue of `plan` through the transport under test (so
/// the engine's headers read as that transport carries them), by queue name after the work
/// queue's.
pub async fn drain_all(
    protocol: Protocol,
    broker: &Broker,
    admin: &Admin,
    plan: &TopologyPlan,
) -> BTreeMap<String, Vec<Drained>> {
    let url = broker.url(protocol);
    match protocol {
        Protocol::Amqp091 => {
            let t = AmqpTransport::connect(broker.config091(unique_name("chaos-drain")))
                .await
                .expect("the drain connects");
            let out = drain_with(&t, admin, plan).await;
            let _ = t.close().await;
            out
        }
        Protocol::Amqp10 => {
            let t = Amqp10Transport::connect(amqp10_config(&url).expect("the broker's URL"))
                .await
                .expect("the drain connects");
            let out = drain_with(&t, admin, plan).await;
            t.close().await;
            out
        }
    }
}

async fn drain_with<T: Transport>(
    transport: &T,
    admin: &Admin,
    plan: &TopologyPlan,
) -> BTreeMap<String, Vec<Drained>> {
    let mut out = BTreeMap::new();
    for queue in plan.queues() {
        let label = queue
            .name
            .strip_prefix(plan.work_queue())
            .unwrap_or(&queue.name)
            .to_owned();
        let n = admin.ready(&queue.name).await;
        let mut taken = Vec::with_capacity(n);
        if n > 0 {
            let prefetch = u16::try_from(n.min(500)).unwrap_or(500);
            let sub = transport
                .consume(&queue.name, prefetch)
                .await
                .expect("consume a queue to drain it");
            while taken.len() < n {
                let d = match tokio::time::timeout(Duration::from_secs(10), sub.recv()).await {
                    Ok(Ok(Some(d))) => d,
                    other => panic!(
                        "drained {} of {n} from {}, then: {other:?}",
                        taken.len(),
                        queue.name
                    ),
                };
                let record = ParkedRecord::decode(d.message.headers());
                taken.push(Drained {
                    id: d
                        .message
                        .properties()
                        .message_id
                        .clone()
                        .unwrap_or_default(),
                    reason: record.reason.map(|r| r.as_str().to_owned()),
                    crashes: record.crashes,
                });
                transport
                    .settle(&d.tag, Settlement::Ack)
                    .await
                    .expect("ack a drained message");
            }
            let _ = sub.flush().await;
            let _ = sub.cancel().await;
        }
        out.insert(label, taken);
    }
    out
}

/// Whether every queue of `plan` but the parking queue is empty.
async fn queues_empty(admin: &Admin, plan: &TopologyPlan) -> bool {
    for q in plan.queues() {
        if q.name != plan.parking_queue() && admin.ready(&q.name).await > 0 {
            return false;
        }
    }
    true
}

/// Runs one chaos run on `node`: see the module docs.
pub async fn run(config: &ChaosConfig, node: &PrivateNode) -> ChaosOutcome {
    run_on(config, &Broker::Node(node.port())).await
}

/// Runs one chaos run on `broker`.
pub async fn run_on(config: &ChaosConfig, broker: &Broker) -> ChaosOutcome {
    let urls091 = broker.urls091();
    let url091 = urls091[0].clone();
    let queue = unique_name("chaos");
    let journal_path = config
        .journal
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("{queue}.journal")));
    let journal = Arc::new(JournalWriter::open(&journal_path).expect("the journal opens"));
    let policy = script::policy(config.crash_limit, config.delay);
    let plan = broker.plan(&queue, &policy);
    let ids = config.mix.ids(config.messages, config.seed);

    // Declared on a connection of its own, closed before the chaos: an admin connection
    // would not live through stop_app. A new one checks the queues once the chaos is over.
    provision(broker, &plan).await;
    let mut publisher = match config.rate {
        None => {
            publish_all(&url091, &queue, &ids).await;
            for id in &ids {
                journal.line("sent", id, format_args!("queue={queue}"));
            }
            None
        }
        Some(rate) => Some(tokio::spawn(publish_paced(
            urls091.clone(),
            queue.clone(),
            ids.clone(),
            rate,
            Arc::clone(&journal),
        ))),
    };
    journal.line(
        "phase",
        "-",
        format_args!(
            "published={} queue={queue} protocol={} seed={}",
            ids.len(),
            config.protocol.name(),
            config.seed
        ),
    );

    let mut rng = Rng(config.seed ^ 0x00C4_A05C_4A05);
    let mut faults = schedule(config, &mut rng);
    faults.reverse(); // popped from the end, earliest first
    let mut fleet = Fleet {
        config,
        args: ConsumerArgs {
            protocol: config.protocol,
            url: broker.url(config.protocol),
            queue: queue.clone(),
            journal: journal_path.clone(),
            prefetch: config.prefetch,
            handler: config.handler,
            crash_limit: config.crash_limit,
            delay: config.delay,
        },
        journal: Arc::clone(&journal),
        slots: (0..config.consumers).map(|_| None).collect(),
        respawn_at: vec![None; config.consumers],
        faults: Faults::default(),
        app_down: false,
        stderr: journal_path.with_extension("stderr"),
    };
    let mut tail = Tail::new(&journal_path);
    let started = Instant::now();
    let deadline = started + config.chaos + config.settle_time;
    let mut node_op: Option<JoinHandle<(Fault, Result<String, String>)>> = None;
    let mut deferred_kill: Option<Instant> = None;
    let mut checker: Option<Admin> = None;
    let mut next_check = Instant::now();
    let mut timed_out = false;
    let mut accounted_at = None;
    let mut close_retries = config.closes;
    let mut broker_turn = 0;
    let mut samples = Vec::new();
    let mut next_sample = Instant::now();

    loop {
        tail.poll();
        fleet.tend(true);
        if config.sample && Instant::now() >= next_sample {
            next_sample += Duration::from_secs(1);
            if let Some(sample) = fleet.slots[0]
                .as_ref()
                .and_then(|p| Sample::of(p.pid, started.elapsed()))
            {
                samples.push(sample);
            }
        }
        if publisher.as_ref().is_some_and(JoinHandle::is_finished) {
            publisher
                .take()
                .expect("checked")
                .await
                .expect("the publisher");
        }
        if let Some(op) = node_op.as_mut()
            && op.is_finished()
        {
            let (fault, result) = node_op.take().expect("checked").await.expect("a node op");
            match (fault, result) {
                (Fault::StopApp, Ok(what)) => {
                    journal.line("stop-app", "-", format_args!("done {what}"));
                }
                (Fault::StartApp, Ok(what)) => {
                    fleet.app_down = false;
                    fleet.faults.app_restarts += 1;
                    broker_turn += 1;
                    journal.line("start-app", "-", format_args!("done {what}"));
                }
                (Fault::Close, Ok(what)) => {
                    journal.line("close", "-", format_args!("{what}"));
                    // The process had no connection (it was reconnecting or starting):
                    // once more, a little later.
                    if what.contains("closed=0 killed=0") && close_retries > 0 {
                        close_retries -= 1;
                        let at = started.elapsed() + Duration::from_millis(500);
                        faults.push((at, Fault::Close));
                        faults.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
                    }
                }
                (Fault::Close, Err(e)) => {
                    journal.line("close", "-", format_args!("closed=0 killed=0 err={e}"));
                }
                (fault, Err(e)) => panic!("{fault:?} on {broker:?} failed: {e}"),
                (Fault::Kill, _) => unreachable!("kills are not node operations"),
            }
        }
        let elapsed = started.elapsed();
        if node_op.is_none()
            && let Some(&(at, fault)) = faults.last()
            && at <= elapsed
        {
            match fault {
                Fault::Kill => {
                    let live = fleet.live();
                    let free: Vec<u32> = live
                        .iter()
                        .copied()
                        .filter(|pid| !tail.holds_suspect(*pid))
                        .collect();
                    let give_up =
                        deferred_kill.is_some_and(|since| since.elapsed() > Duration::from_secs(3));
                    if !free.is_empty() {
                        let pid = free[rng.below(free.len())];
                        fleet.kill(pid, false);
                        faults.pop();
                        deferred_kill = None;
                    } else if give_up && !live.is_empty() {
                        let pid = live[rng.below(live.len())];
                        fleet.kill(pid, true);
                        faults.pop();
                        deferred_kill = None;
                    } else {
                        deferred_kill.get_or_insert_with(Instant::now);
                    }
                }
                Fault::Close if fleet.app_down => {
                    // Nothing to close while the application is stopped: after it starts.
                    faults.pop();
                    let after = faults
                        .iter()
                        .find(|(_, f)| *f == Fault::StartApp)
                        .map_or(elapsed, |(at, _)| *at);
                    faults.push((after + Duration::from_millis(500), Fault::Close));
                    faults.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
                }
                Fault::Close => {
                    faults.pop();
                    let live = fleet.live();
                    let Broker::Node(node_port) = *broker else {
                        panic!("connections are closed by force on a private node only");
                    };
                    if !live.is_empty() {
                        let pid = live[rng.below(live.len())];
                        let ports = local_ports(pid, node_port);
                        fleet.faults.closes.0 += 1;
                        node_op = Some(tokio::task::spawn_blocking(move || {
                            let node = PrivateNode::attach(node_port);
                            let result = node.close_peers(&ports).map(|done| {
                                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                                format!("pid={pid} ports={} {done}", ports.join(","))
                            });
                            (Fault::Close, result)
                        }));
                    }
                }
                Fault::StopApp | Fault::StartApp => {
                    faults.pop();
                    if fault == Fault::StopApp {
                        fleet.app_down = true;
                        journal.line("stop-app", "-", format_args!("begin"));
                    } else {
                        journal.line("start-app", "-", format_args!("begin"));
                    }
                    let broker = broker.clone();
                    node_op = Some(tokio::task::spawn_blocking(move || {
                        let result = if fault == Fault::StopApp {
                            broker.down(broker_turn)
                        } else {
                            broker.up(broker_turn)
                        };
                        (fault, result)
                    }));
                }
            }
        }
        // Count the closes' connections as they complete.
        let chaos_over = faults.is_empty() && node_op.is_none() && publisher.is_none();
        if chaos_over && tail.accounted.len() >= ids.len() && Instant::now() >= next_check {
            accounted_at.get_or_insert_with(|| started.elapsed());
            if checker.is_none() {
                checker = Some(Admin::connect(&url091).await);
            }
            if queues_empty(checker.as_ref().expect("connected"), &plan).await {
                break;
            }
            next_check = Instant::now() + Duration::from_millis(500);
        }
        if Instant::now() >= deadline {
            timed_out = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = accounted_at.unwrap_or_else(|| started.elapsed());
    if let Some(publisher) = publisher.take() {
        publisher.abort();
    }
    fleet.stop_all(Duration::from_secs(20)).await;
    if let Some(op) = node_op.take() {
        let _ = op.await;
    }
    let admin = match checker {
        Some(admin) => admin,
        None => Admin::connect(&url091).await,
    };
    admin.track(&plan);
    let drained = drain_all(config.protocol, broker, &admin, &plan).await;
    admin.cleanup().await;
    for (queue, messages) in &drained {
        for m in messages {
            journal.line(
                "drained",
                &m.id,
                format_args!(
                    "queue={} reason={} crashes={}",
                    if queue.is_empty() { "work" } else { queue },
                    m.reason.as_deref().unwrap_or("-"),
                    m.crashes
                ),
            );
        }
    }

    let (entries, bad) = journal::read(&journal_path);
    fleet.faults.closes.1 = entries
        .iter()
        .filter(|e| e.kind == "close")
        .map(|e| e.num("closed").unwrap_or(0) + e.num("killed").unwrap_or(0))
        .sum::<u64>() as usize;
    let exit_errors = exit_errors(&entries);
    // Only what was published can be lost; what a paced publisher never got to is said
    // apart.
    let sent: HashSet<&str> = entries
        .iter()
        .filter(|e| e.kind == "sent")
        .map(|e| e.id.as_str())
        .collect();
    let (ids, unpublished): (Vec<String>, Vec<String>) =
        ids.into_iter().partition(|id| sent.contains(id.as_str()));
    let facts = RunFacts {
        ids,
        crash_limit: config.crash_limit,
        drained,
    };
    ChaosOutcome {
        protocol: config.protocol,
        seed: config.seed,
        reconciled: reconcile(&entries, bad, &facts),
        faults: fleet.faults,
        took,
        timed_out,
        crash_limit: config.crash_limit,
        journal: journal_path,
        exit_errors,
        samples,
        unpublished: unpublished.len(),
    }
}

/// Reconciles a run again from its journal alone: the messages sent and drained are in it
/// (`sent` and `drained` lines).
pub fn reconcile_journal(path: &Path, crash_limit: u32) -> Reconciled {
    let (entries, bad) = journal::read(path);
    let mut facts = RunFacts {
        crash_limit,
        ..RunFacts::default()
    };
    for e in &entries {
        match e.kind.as_str() {
            "sent" => facts.ids.push(e.id.clone()),
            "drained" => {
                let queue = match e.get("queue") {
                    Some("work") | None => String::new(),
                    Some(q) => q.to_owned(),
                };
                facts.drained.entry(queue).or_default().push(Drained {
                    id: e.id.clone(),
                    reason: e.get("reason").filter(|r| *r != "-").map(str::to_owned),
                    crashes: e.num("crashes").unwrap_or(0) as u32,
                });
            }
            _ => {}
        }
    }
    reconcile(&entries, bad, &facts)
}

/// The distinct reasons consumer processes gave for a failed `run`, with a count each.
fn exit_errors(entries: &[Entry]) -> Vec<String> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for e in entries {
        if e.kind == "exit"
            && let Some(err) = e.get("err")
        {
            *counts.entry(err).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .map(|(err, n)| format!("{n}× {err}"))
        .collect()
}

/// What the graceful-shutdown check found.
#[derive(Debug)]
pub struct GracefulOutcome {
    /// The transport.
    pub protocol: Protocol,
    /// Messages published.
    pub messages: usize,
    /// Messages the first process handled before it stopped.
    pub handled_before: usize,
    /// How the first process ended: its `exit` line.
    pub first_exit: String,
    /// Deliveries the next process received flagged redelivered (or with crash evidence).
    pub redelivered_after: usize,
    /// Of those, the ids.
    pub redelivered_ids: Vec<String>,
    /// Distinct messages handled in all.
    pub handled: usize,
    /// Messages handled more than once.
    pub duplicates: usize,
    /// The journal.
    pub journal: PathBuf,
}

impl GracefulOutcome {
    /// One line of figures.
    pub fn summary(&self) -> String {
        format!(
            "graceful shutdown {}: {} messages; the first process handled {} and ended [{}]; the next received {} redelivered; {} handled in all, {} twice",
            self.protocol.name(),
            self.messages,
            self.handled_before,
            self.first_exit,
            self.redelivered_after,
            self.handled,
            self.duplicates
        )
    }
}

/// A consumer is given its shutdown signal mid-stream and a new one started: counts what
/// comes back redelivered to the new one.
pub async fn graceful_shutdown(
    protocol: Protocol,
    consumer_exe: PathBuf,
    node: &PrivateNode,
    messages: usize,
) -> GracefulOutcome {
    let config = ChaosConfig {
        messages,
        mix: Mix {
            once: 0.0,
            always: 0.0,
            permanent: 0.0,
            poison: 0,
        },
        consumers: 1,
        ..ChaosConfig::full(protocol, consumer_exe, 1)
    };
    let port = node.port();
    let url091 = Protocol::Amqp091.url(port);
    let queue = unique_name("graceful");
    let journal_path = std::env::temp_dir().join(format!("{queue}.journal"));
    let journal = Arc::new(JournalWriter::open(&journal_path).expect("the journal opens"));
    let plan = TopologyPlan::new(&queue, &script::policy(config.crash_limit, config.delay))
        .expect("a plan");
    let ids = config.mix.ids(messages, 1);
    let admin = Admin::connect(&url091).await;
    admin.provision(&plan, &Default::default()).await;
    publish_all(&url091, &queue, &ids).await;
    let mut fleet = Fleet {
        config: &config,
        args: ConsumerArgs {
            protocol,
            url: protocol.url(port),
            queue: queue.clone(),
            journal: journal_path.clone(),
            prefetch: config.prefetch,
            handler: config.handler,
            crash_limit: config.crash_limit,
            delay: config.delay,
        },
        journal: Arc::clone(&journal),
        slots: vec![None],
        respawn_at: vec![None],
        faults: Faults::default(),
        app_down: false,
        stderr: journal_path.with_extension("stderr"),
    };
    let mut tail = Tail::new(&journal_path);
    let deadline = Instant::now() + Duration::from_secs(120);
    let wait_for = |tail: &mut Tail, n: usize| {
        tail.poll();
        tail.accounted.len() >= n
    };
    fleet.spawn(0);
    let first = fleet.slots[0].as_ref().map_or(0, |p| p.pid);
    while !wait_for(&mut tail, messages / 3) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fleet.stop_all(Duration::from_secs(20)).await;
    tail.poll();
    let handled_before = tail.accounted.len();
    fleet.spawn(0);
    let second = fleet.slots[0].as_ref().map_or(0, |p| p.pid);
    while !wait_for(&mut tail, messages) && Instant::now() < deadline {
        fleet.tend(false);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    fleet.stop_all(Duration::from_secs(20)).await;
    admin.cleanup().await;

    let (entries, _) = journal::read(&journal_path);
    let first_exit = entries
        .iter()
        .find(|e| e.pid == first && e.kind == "exit")
        .map_or_else(|| "no exit line".to_owned(), |e| e.fields.clone());
    let redelivered: Vec<&Entry> = entries
        .iter()
        .filter(|e| {
            e.pid == second
                && e.kind == "recv"
                && (e.is("redelivered", "true") || e.num("evidence").unwrap_or(0) > 0)
        })
        .collect();
    let mut runs: HashMap<&str, usize> = HashMap::new();
    for e in &entries {
        if e.kind == "ran" && e.is("outcome", "ok") {
            *runs.entry(e.id.as_str()).or_default() += 1;
        }
    }
    debug_assert!(ids.iter().all(|id| Class::of(id) == Some(Class::Ok)));
    GracefulOutcome {
        protocol,
        messages,
        handled_before,
        first_exit,
        redelivered_after: redelivered.len(),
        redelivered_ids: redelivered.iter().map(|e| e.id.clone()).collect(),
        handled: runs.len(),
        duplicates: runs.values().filter(|n| **n > 1).count(),
        journal: journal_path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_whose_parking_copy_was_confirmed_is_accounted_for() {
        let path = std::env::temp_dir().join(format!("chaos-tail-{}", std::process::id()));
        std::fs::write(
            &path,
            "1 7 publish m1-perm to=q attempts=1 crashes=0 reason=permanent\n\
             1 7 publish m2-once to=q.retry.300ms attempts=1 crashes=0 reason=-\n\
             1 7 published m2-once to=q.retry.300ms result=confirmed\n\
             1 7 publish m3-perm to=q attempts=1 crashes=0 reason=permanent\n\
             1 7 published m3-perm to=q result=failed err=connection lost\n\
             1 7 published m1-perm to=q result=confirmed\n",
        )
        .unwrap();
        let mut tail = Tail::new(&path);
        tail.poll();
        let _ = std::fs::remove_file(&path);
        // m1's process died before it journaled the terminal; m2 was only retried; m3's
        // parking copy failed.
        assert_eq!(tail.accounted, HashSet::from(["m1-perm".to_owned()]));
    }
}
