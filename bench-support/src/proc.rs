//! Readings from Linux's `/proc`: CPU time of a process and of the local broker, the load
//! average, and this process's resident memory (its peak, and its growth over a
//! measurement). Each is `None` (or does nothing) where `/proc` cannot be read.

use std::time::{Duration, Instant};

/// One clock tick of `/proc/<pid>/stat` (`getconf CLK_TCK`, `USER_HZ`: 100 on Linux).
pub const TICK: Duration = Duration::from_millis(10);

/// The CPU time (user + system) process `pid` has used so far, from `/proc/<pid>/stat`, in
/// whole clock ticks ([`TICK`]). `pid` may be `"self"`.
pub fn cpu_time(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: fields count from the closing one.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(TICK * u32::try_from(ticks).ok()?)
}

/// The command name of the local RabbitMQ's Erlang VM, as `/proc/<pid>/comm` shows it.
pub const RABBITMQ: &str = "beam.smp";

/// The command name of a local NATS server.
pub const NATS: &str = "nats-server";

/// The process id of the local RabbitMQ's Erlang VM (`beam.smp`), if it runs on this
/// machine and can be seen.
pub fn broker_pid() -> Option<String> {
    server_pid(RABBITMQ)
}

/// The process id of the first process whose command name (`/proc/<pid>/comm`) is `comm`,
/// such as [`RABBITMQ`] or [`NATS`], if one runs on this machine and can be seen.
pub fn server_pid(comm: &str) -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().into_string().ok()?;
            let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            (name.trim() == comm).then_some(pid)
        })
}

/// The CPU time this process and the local broker use from [`CpuClock::start`] on.
///
/// ```
/// let clock = bench_support::proc::CpuClock::start();
/// let used = clock.used();
/// # #[cfg(target_os = "linux")]
/// assert!(used.client.is_some());
/// ```
#[derive(Clone, Debug)]
pub struct CpuClock {
    client: Option<Duration>,
    broker: Option<(String, Duration)>,
}

/// What a [`CpuClock`] read: the CPU time used since it started, `None` if unknown.
#[derive(Clone, Copy, Debug)]
pub struct CpuUsed {
    /// This process.
    pub client: Option<Duration>,
    /// The server the clock was started for (the local broker by default), if it runs on
    /// this machine.
    pub broker: Option<Duration>,
}

impl CpuClock {
    /// Reads both CPU times now: the local RabbitMQ's first, then this process's.
    pub fn start() -> Self {
        Self::of(RABBITMQ)
    }

    /// Reads both CPU times now: first that of the server whose command name is `server`
    /// (see [`server_pid`]), then this process's.
    pub fn of(server: &str) -> Self {
        let broker = server_pid(server).and_then(|pid| {
            let now = cpu_time(&pid)?;
            Some((pid, now))
        });
        CpuClock {
            client: cpu_time("self"),
            broker,
        }
    }

    /// The CPU time used since [`CpuClock::start`]: this process's, then the broker's.
    pub fn used(&self) -> CpuUsed {
        let since = |pid: &str, before: Duration| cpu_time(pid).map(|now| now - before);
        CpuUsed {
            client: self.client.and_then(|before| since("self", before)),
            broker: self
                .broker
                .as_ref()
                .and_then(|(pid, before)| since(pid, *before)),
        }
    }
}

/// Waits (at most 5 s) until the local broker has been idle for 200 ms (under 5% of one
/// core: at most one tick), so that a measurement does not start while the broker still
/// works off the one before (deleting its queues, writing its index). Returns at once if the
/// broker does not run on this machine.
pub async fn wait_for_idle_broker() {
    wait_for_idle_server(RABBITMQ).await;
}

/// [`wait_for_idle_broker`] for the server whose command name is `server`.
pub async fn wait_for_idle_server(server: &str) {
    let Some(pid) = server_pid(server) else {
        return;
    };
    for _ in 0..25 {
        let Some(before) = cpu_time(&pid) else {
            return;
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        match cpu_time(&pid) {
            Some(after) if after - before <= TICK => return,
            Some(_) => {}
            None => return,
        }
    }
}

/// The load averages over 1, 5 and 15 minutes, from `/proc/loadavg`.
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut fields = text.split_whitespace().map(str::parse::<f64>);
    Some([
        fields.next()?.ok()?,
        fields.next()?.ok()?,
        fields.next()?.ok()?,
    ])
}

/// The one-minute load average, from `/proc/loadavg`.
pub fn load1() -> Option<f64> {
    load_average().map(|[one, _, _]| one)
}

/// The one-minute load average as `/proc/loadavg` shows it (two decimals), or `?` if
/// unknown.
pub fn load1_shown() -> String {
    load1().map_or_else(|| "?".into(), |l| format!("{l:.2}"))
}

/// The three load averages as `/proc/loadavg` shows them (`0.52 0.40 0.33`), or `?` if
/// unknown.
pub fn load_average_shown() -> String {
    load_average().map_or_else(
        || "?".into(),
        |loads| loads.map(|l| format!("{l:.2}")).join(" "),
    )
}

/// The peak resident memory of this process so far (`VmHWM`), in bytes; 0 if unknown.
pub fn peak_rss() -> u64 {
    status_kib("VmHWM:").map_or(0, |kib| kib * 1024)
}

/// The resident memory of this process now (`VmRSS`), in bytes; `None` if unknown.
pub fn rss() -> Option<u64> {
    status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// A field of `/proc/self/status` given in kB, such as `VmHWM:`.
fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// How far this process's resident memory rises above where it was at
/// [`RssGrowth::start`]: the peak (`VmHWM`) at [`RssGrowth::peak`] minus the resident memory
/// (`VmRSS`) at the start.
///
/// Starting resets the peak to the current resident memory (`5` written to
/// `/proc/self/clear_refs`, Linux 4.0 on), so that what the process did before (prefilling a
/// queue, say) does not count; without that reset the growth is unknown. Memory freed before
/// the start and kept by the allocator is reused without showing as growth, so a figure is
/// only comparable with another taken in a fresh process doing the same setup.
///
/// ```
/// let growth = bench_support::proc::RssGrowth::start();
/// let buffer = vec![1u8; 8 << 20];
/// if let Some(grown) = growth.peak() {
///     assert!(grown >= 4 << 20);
/// }
/// drop(buffer);
/// ```
#[derive(Clone, Copy, Debug)]
pub struct RssGrowth {
    start: Option<u64>,
}

impl RssGrowth {
    /// Resets the process's peak resident memory and reads the current one.
    pub fn start() -> Self {
        let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        RssGrowth {
            start: reset.then(rss).flatten(),
        }
    }

    /// The peak resident memory since [`RssGrowth::start`] minus the resident memory then,
    /// in bytes (0 if it never rose); `None` if unknown.
    pub fn peak(&self) -> Option<u64> {
        let start = self.start?;
        let peak = status_kib("VmHWM:")? * 1024;
        Some(peak.saturating_sub(start))
    }
}

/// The wall time and [`CpuClock`] of one measurement, started together.
///
/// ```
/// let clock = bench_support::proc::Clock::start();
/// let timing = clock.stop();
/// assert!(timing.wall < std::time::Duration::from_secs(60));
/// ```
#[derive(Clone, Debug)]
pub struct Clock {
    cpu: CpuClock,
    start: Instant,
}

/// What a [`Clock`] measured.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Wall time from [`Clock::start`] to [`Clock::stop`].
    pub wall: Duration,
    /// CPU time over the same span.
    pub cpu: CpuUsed,
}

impl Clock {
    /// Reads the CPU times (this process's and the local RabbitMQ's), then starts the wall
    /// clock.
    pub fn start() -> Self {
        Self::of(RABBITMQ)
    }

    /// Reads the CPU times of this process and of the server whose command name is
    /// `server`, then starts the wall clock.
    pub fn of(server: &str) -> Self {
        let cpu = CpuClock::of(server);
        Clock {
            cpu,
            start: Instant::now(),
        }
    }

    /// Stops the wall clock, then reads the CPU times.
    pub fn stop(self) -> Timing {
        let wall = self.start.elapsed();
        Timing {
            wall,
            cpu: self.cpu.used(),
        }
    }
}
