//! What the `crashing_consumer` binary and the test that restarts it share: its arguments,
//! its policy, and the record it appends to as it runs.
//!
//! The record is a text file, one line per event, each written with a single `write` on a
//! file opened for appending, so a line is on disk before the process can abort and lines
//! from successive processes never interleave:
//!
//! ```text
//! <pid> run <message-id> <attempt> work|alone
//! <pid> succeeded <message-id> <attempt>
//! <pid> terminal <message-id> handled <attempt>
//! <pid> terminal <message-id> isolated
//! <pid> terminal <message-id> diverted <crashes> <delay-ms>
//! <pid> terminal <message-id> parked <reason>
//! ```

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use retry_core::{RetryPolicy, Terminal};

/// The crashing consumer's settings, passed as command-line arguments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessArgs {
    /// The work queue.
    pub queue: String,
    /// The message ids that make the process abort.
    pub poison: Vec<String>,
    /// Where to append the record.
    pub record: PathBuf,
    /// The policy's crash limit.
    pub crash_limit: u32,
    /// The policy's only delay, also its crash delay.
    pub delay: Duration,
    /// The consumer's prefetch.
    pub prefetch: u16,
}

impl ProcessArgs {
    /// The command-line arguments that [`parse`](Self::parse) reads back.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            self.queue.clone(),
            self.poison.join(","),
            self.record.display().to_string(),
            self.crash_limit.to_string(),
            self.delay.as_millis().to_string(),
            self.prefetch.to_string(),
        ]
    }

    /// Reads `queue poison-ids record crash-limit delay-ms prefetch`; the poison ids are
    /// separated by commas.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, String> {
        let args: Vec<String> = args.into_iter().collect();
        let [queue, poison, record, limit, delay, prefetch] = args.as_slice() else {
            return Err(format!(
                "usage: crashing_consumer QUEUE POISON_IDS RECORD_FILE CRASH_LIMIT DELAY_MS PREFETCH (got {args:?})"
            ));
        };
        Ok(ProcessArgs {
            queue: queue.clone(),
            poison: poison.split(',').map(str::to_owned).collect(),
            record: PathBuf::from(record),
            crash_limit: limit.parse().map_err(|e| format!("CRASH_LIMIT: {e}"))?,
            delay: Duration::from_millis(delay.parse().map_err(|e| format!("DELAY_MS: {e}"))?),
            prefetch: prefetch.parse().map_err(|e| format!("PREFETCH: {e}"))?,
        })
    }

    /// The policy both sides use: one delay, which is also the crash delay.
    pub fn policy(&self) -> RetryPolicy {
        RetryPolicy::delays([self.delay])
            .with_crash_limit(self.crash_limit)
            .build()
            .expect("a valid crash-loop policy")
    }
}

/// One event in the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The handler started on a message.
    Run {
        /// The message id.
        id: String,
        /// The engine's attempt number.
        attempt: u32,
        /// Whether it ran alone: a suspect from the isolation queue.
        alone: bool,
    },
    /// The handler returned success. Its ack can still be lost (the process dies first,
    /// and the message runs again) or be sent with no `terminal` line after it (the process
    /// dies between the two): success is what accounting counts, terminals are how
    /// deliveries ended when the record saw it.
    Succeeded {
        /// The message id.
        id: String,
        /// The engine's attempt number.
        attempt: u32,
    },
    /// A delivery was settled, ending as the line says.
    Terminal {
        /// The message id.
        id: String,
        /// How it ended, in the record's words (`handled 1`, `diverted 2 300`, ...).
        outcome: String,
    },
}

/// A line of the record: which process wrote it, and what happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// The process id of the consumer that wrote it.
    pub pid: u32,
    /// What happened.
    pub event: Event,
}

/// A terminal in the record's words.
pub fn encode_terminal(terminal: &Terminal) -> String {
    match terminal {
        Terminal::Handled { attempt } => format!("handled {attempt}"),
        Terminal::Retried { attempts, delay } => {
            format!("retried {attempts} {}", delay.as_millis())
        }
        Terminal::Isolated => "isolated".to_owned(),
        Terminal::Diverted { crashes, delay } => {
            format!("diverted {crashes} {}", delay.as_millis())
        }
        Terminal::DeadLettered { reason } => format!("parked {reason}"),
        Terminal::Dropped { reason } => format!("dropped {reason}"),
        Terminal::Requeued { cause } => format!("requeued {cause:?}"),
    }
}

/// Appends one event to the record at `path`, in one write.
pub fn append(path: &Path, event: &Event) -> std::io::Result<()> {
    let line = match event {
        Event::Run { id, attempt, alone } => {
            let lane = if *alone { "alone" } else { "work" };
            format!("{} run {id} {attempt} {lane}\n", std::process::id())
        }
        Event::Succeeded { id, attempt } => {
            format!("{} succeeded {id} {attempt}\n", std::process::id())
        }
        Event::Terminal { id, outcome } => {
            format!("{} terminal {id} {outcome}\n", std::process::id())
        }
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    file.write_all(line.as_bytes())
}

/// Reads the record; a missing file is an empty record. Panics on a malformed line.
///
/// The record may be read while a consumer process appends to it: a reader can see part of
/// a write under way, so text after the last newline is not a line yet and is left for the
/// next read. Every [`append`] ends its line in the same write.
pub fn read(path: &Path) -> Vec<Line> {
    let mut text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
    text.lines()
        .map(|line| {
            let mut words = line.splitn(4, ' ');
            let (pid, kind, id, rest) = (
                words.next().and_then(|p| p.parse().ok()),
                words.next(),
                words.next(),
                words.next(),
            );
            let (Some(pid), Some(kind), Some(id), Some(rest)) = (pid, kind, id, rest) else {
                panic!("malformed record line {line:?}");
            };
            let id = id.to_owned();
            let event = match kind {
                "run" => {
                    let (attempt, lane) = rest
                        .split_once(' ')
                        .unwrap_or_else(|| panic!("bad run line: {line:?}"));
                    Event::Run {
                        id,
                        attempt: attempt
                            .parse()
                            .unwrap_or_else(|_| panic!("bad attempt: {line:?}")),
                        alone: lane == "alone",
                    }
                }
                "succeeded" => Event::Succeeded {
                    id,
                    attempt: rest
                        .parse()
                        .unwrap_or_else(|_| panic!("bad attempt: {line:?}")),
                },
                "terminal" => Event::Terminal {
                    id,
                    outcome: rest.to_owned(),
                },
                _ => panic!("unknown record line {line:?}"),
            };
            Line { pid, event }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_still_being_written_is_read_once_it_is_whole() {
        let path = std::env::temp_dir().join(format!("record-{}", std::process::id()));
        std::fs::write(&path, "7 run m-1 1 work\n7 succeeded m-1").unwrap();
        assert_eq!(read(&path).len(), 1);
        std::fs::write(&path, "7 run m-1 1 work\n7 succeeded m-1 1\n").unwrap();
        let lines = read(&path);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            &lines[1].event,
            Event::Succeeded { id, attempt: 1 } if id == "m-1"
        ));
    }

    #[test]
    #[should_panic(expected = "malformed record line \"7 succeeded\"")]
    fn a_whole_malformed_line_is_refused() {
        let path = std::env::temp_dir().join(format!("malformed-{}", std::process::id()));
        std::fs::write(&path, "7 succeeded\n").unwrap();
        let read = std::panic::catch_unwind(|| read(&path));
        std::fs::remove_file(&path).unwrap();
        std::panic::resume_unwind(read.unwrap_err());
    }
}
