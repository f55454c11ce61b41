//! A private RabbitMQ node for the chaos runs, through `stress/chaos-node.sh`: its
//! application is stopped and started and its connections are closed by force, which must
//! never happen to the machine's shared broker.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The script that manages private nodes.
pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("chaos-node.sh")
}

/// A private node, on its own port.
#[derive(Debug)]
pub struct PrivateNode {
    port: u16,
    /// Whether dropping it takes it down.
    owned: bool,
}

fn run(port: u16, args: &[&str]) -> Result<String, String> {
    let out = Command::new(script())
        .args(args)
        .env("CHAOS_PORT", port.to_string())
        .output()
        .map_err(|e| format!("running {}: {e}", script().display()))?;
    if !out.status.success() {
        return Err(format!(
            "chaos-node.sh {} (port {port}) failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl PrivateNode {
    /// Starts a fresh node on `port` (any earlier one there is taken down first). With
    /// `owner`, a watcher takes it down once that process exits, whatever happens to it;
    /// without, dropping the returned value does.
    pub fn up(port: u16, owner: Option<u32>) -> Result<Self, String> {
        let owner = owner.map(|pid| pid.to_string());
        let mut args = vec!["up"];
        args.extend(owner.as_deref());
        run(port, &args)?;
        Ok(PrivateNode {
            port,
            owned: owner.is_none(),
        })
    }

    /// A handle on the node already running on `port`, which dropping leaves running.
    pub fn attach(port: u16) -> Self {
        PrivateNode { port, owned: false }
    }

    /// The node's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `rabbitmqctl stop_app`.
    pub fn stop_app(&self) -> Result<(), String> {
        run(self.port, &["stop-app"]).map(drop)
    }

    /// `rabbitmqctl start_app`, returning once the node serves again.
    pub fn start_app(&self) -> Result<(), String> {
        run(self.port, &["start-app"]).map(drop)
    }

    /// Closes, from the broker's side, the client connections whose client ports are
    /// `ports` (see `close-peers` in the script); says how many it closed and how.
    pub fn close_peers(&self, ports: &BTreeSet<u16>) -> Result<String, String> {
        if ports.is_empty() {
            return Ok("closed=0 killed=0".to_owned());
        }
        let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
        let mut args = vec!["close-peers"];
        args.extend(ports.iter().map(String::as_str));
        run(self.port, &args).map(|out| out.trim().to_owned())
    }

    /// Takes the node down and deletes its data.
    pub fn down(&self) -> Result<(), String> {
        run(self.port, &["down"]).map(drop)
    }
}

impl Drop for PrivateNode {
    fn drop(&mut self) {
        if self.owned
            && let Err(e) = self.down()
        {
            eprintln!("{e}");
        }
    }
}

/// The local ports of the TCP connections process `pid` holds to `remote_port` on this
/// machine, from `/proc`: how the driver finds a consumer process's connections among the
/// node's, whatever the protocol calls them.
pub fn local_ports(pid: u32, remote_port: u16) -> BTreeSet<u16> {
    let mut inodes = BTreeSet::new();
    if let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && let Some(inode) = target
                    .to_str()
                    .and_then(|t| t.strip_prefix("socket:["))
                    .and_then(|t| t.strip_suffix(']'))
            {
                inodes.insert(inode.to_owned());
            }
        }
    }
    let mut ports = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() < 10 || !inodes.contains(cols[9]) {
                continue;
            }
            let port = |addr: &str| {
                addr.rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            };
            if port(cols[2]) == Some(remote_port)
                && let Some(local) = port(cols[1])
            {
                ports.insert(local);
            }
        }
    }
    ports
}
