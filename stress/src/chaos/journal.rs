//! The chaos journal: one text file that every consumer process of a run and the driver
//! append to, one line per event, so that any message's whole history (and the faults
//! injected around it) can be read back after the run.
//!
//! A line is `<unix-ms> <pid> <kind> <message-id> <fields>`, written with a single `write`
//! on a file opened for appending: a SIGKILL loses at most the line being written, and the
//! lines of concurrent processes never interleave. `<message-id>` is `-` for a line about no
//! message. Fields are `key=value` words, except `err=`, which is always last and runs to the
//! end of the line.
//!
//! Kinds written by a consumer process (see [`super::transport`] and [`super::consumer`]):
//!
//! | kind | when |
//! |---|---|
//! | `start` | the process starts (`protocol=`, `prefetch=`) |
//! | `connected` | its transport connected |
//! | `consume` | a subscription was made (`result=ok` or `err=`) |
//! | `recv` | a delivery was received: `lane=work` (subscription) or `lane=isolation` (fetch), `redelivered=`, `dc=` (AMQP 1.0 delivery-count), `xdc=`, `attempts=`, `crashes=` (the engine's headers), `evidence=` (crash evidence) |
//! | `fetch-none` | a fetch of the isolation queue found nothing |
//! | `recv-err`, `fetch-err`, `ready-err`, `flush-err` | a receive, a fetch of the isolation queue, a watch of it, or a flush of batched acks failed (`err=`) |
//! | `recv-end` | a subscription ended |
//! | `run` | a handler run starts (`attempt=`, `lane=`, `does=` what the script makes it do) |
//! | `ran` | a handler run ended (`attempt=`, `outcome=ok`, `transient` or `permanent`) |
//! | `publish` | a clone is being published (`to=` routing key, `attempts=`, `crashes=`, `reason=`) |
//! | `published` | its result (`to=`, `result=confirmed`, `refused`, `returned` or `failed`, `err=`) |
//! | `settle` | a delivery is being settled (`lane=`, `how=ack`, `requeue` or `reject`) |
//! | `settled` | the settlement's result (`how=`, `result=ok` or `err=`) |
//! | `terminal` | the consumer's `on_terminal` (`lane=`, `attempt=`, `t=handled`, `retried`, `isolated`, `diverted`, `parked`, `dropped` or `requeued`, with `crashes=`, `reason=`, `cause=`) |
//! | `exit` | `run` returned (`result=ok`, the report's counts, or `err=`) |
//!
//! Kinds written by the driver: `sent` (a message published and confirmed: before the
//! consumers start, or while they run when the run publishes at a rate), `spawn`, `exited` (a consumer process ended: `status=`), `kill`,
//! `close` (connections force-closed), `stop-app`, `start-app`, `shutdown` (a consumer asked
//! to stop), `phase`, and `drained` (a message found in a queue of the plan at the end:
//! `queue=`, `reason=`, `crashes=`). With `sent` and `drained`, a journal alone is enough to
//! reconcile its run again.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: every process of a run stamps its lines with it.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Appends lines to a journal file.
#[derive(Debug)]
pub struct JournalWriter {
    file: File,
    pid: u32,
}

impl JournalWriter {
    /// Opens `path` for appending (creating it), writing lines as this process.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(JournalWriter {
            file,
            pid: std::process::id(),
        })
    }

    /// Appends one line, in one write. `fields` must not contain a newline; one that does
    /// has it replaced by a space. A failed write is reported on standard error: the journal
    /// is evidence, and the run goes on without it rather than changing what it observes.
    pub fn line(&self, kind: &str, id: &str, fields: std::fmt::Arguments<'_>) {
        let mut line = String::with_capacity(96);
        let id = if id.is_empty() { "?" } else { id };
        let _ = write!(line, "{} {} {kind} {id} ", unix_ms(), self.pid);
        let start = line.len();
        let _ = line.write_fmt(fields);
        if line[start..].contains('\n') {
            let cleaned = line[start..].replace('\n', " ");
            line.truncate(start);
            line.push_str(&cleaned);
        }
        line.push('\n');
        if let Err(e) = (&self.file).write_all(line.as_bytes()) {
            eprintln!("chaos journal: cannot append: {e}");
        }
    }
}

/// One line of the journal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// When it was written, in Unix milliseconds.
    pub at: u64,
    /// The process that wrote it.
    pub pid: u32,
    /// What happened.
    pub kind: String,
    /// The message it is about, `-` for none.
    pub id: String,
    /// The rest of the line.
    pub fields: String,
}

impl Entry {
    /// The value of field `key`: a `key=value` word, or for `err` the rest of the line.
    pub fn get(&self, key: &str) -> Option<&str> {
        if key == "err" {
            return self.fields.find("err=").map(|at| &self.fields[at + 4..]);
        }
        let before_err = self
            .fields
            .find("err=")
            .map_or(&self.fields[..], |at| &self.fields[..at]);
        before_err.split(' ').find_map(|word| {
            word.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('='))
        })
    }

    /// Field `key` as a number.
    pub fn num(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.parse().ok())
    }

    /// Whether field `key` is `value`.
    pub fn is(&self, key: &str, value: &str) -> bool {
        self.get(key) == Some(value)
    }
}

impl std::fmt::Display for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} {} {}",
            self.at, self.pid, self.kind, self.id, self.fields
        )
    }
}

/// Reads a journal; a missing file is empty. Text after the last newline (a line still
/// being written, or cut by a SIGKILL) is left out, as are lines that do not parse, which
/// are counted in the second value.
pub fn read(path: &Path) -> (Vec<Entry>, usize) {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return (Vec::new(), 0),
        Err(e) => panic!("reading the journal {}: {e}", path.display()),
    };
    let whole = text.rfind('\n').map_or(0, |end| end + 1);
    let mut bad = 0;
    let entries = text[..whole]
        .lines()
        .filter_map(|line| {
            let parsed = parse(line);
            bad += usize::from(parsed.is_none());
            parsed
        })
        .collect();
    (entries, bad)
}

fn parse(line: &str) -> Option<Entry> {
    let mut words = line.splitn(5, ' ');
    Some(Entry {
        at: words.next()?.parse().ok()?,
        pid: words.next()?.parse().ok()?,
        kind: words.next()?.to_owned(),
        id: words.next()?.to_owned(),
        fields: words.next().unwrap_or("").to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_with_their_fields_and_a_cut_line_is_left_out() {
        let path = std::env::temp_dir().join(format!("chaos-journal-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let journal = JournalWriter::open(&path).unwrap();
        journal.line("recv", "m1-ok", format_args!("lane=work redelivered=true"));
        journal.line(
            "published",
            "m1-ok",
            format_args!("to=q.suspect result=failed err=connection lost: a\nb"),
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"17 3 run m2")
            .unwrap();
        let (entries, bad) = read(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!((entries.len(), bad), (2, 0));
        assert_eq!(entries[0].get("lane"), Some("work"));
        assert!(entries[0].is("redelivered", "true"));
        assert_eq!(entries[1].get("result"), Some("failed"));
        assert_eq!(entries[1].get("err"), Some("connection lost: a b"));
        assert_eq!(entries[1].get("a"), None);
        assert_eq!(entries[1].pid, std::process::id());
    }
}
