//! What happened to each test message: every handler run and every terminal, timed, and a
//! scripted handler that records into it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{Handler, HandlerError, Headers, Message, Terminal};

use crate::harness::Stopwatch;

/// What a scripted handler does on one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Succeed.
    Succeed,
    /// Fail with a transient error.
    Fail,
    /// Fail with a permanent error.
    Permanent,
    /// Fail, asking to be retried after this delay.
    RetryAfter(Duration),
    /// Never return: the consumer is about to crash while holding the delivery.
    Hang,
}

/// Which run a scripted handler is on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunInfo {
    /// The message id.
    pub id: String,
    /// The engine's attempt number for this run (1-based).
    pub attempt: u32,
    /// How many times the handler has run on this message, this run included, in this
    /// scenario (crashed runs included).
    pub run: u32,
}

/// One handler run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    /// Which run.
    pub info: RunInfo,
    /// When it started, on the harness's clock.
    pub at: Duration,
    /// What the script made it do.
    pub step: Step,
    /// The message's headers on this run.
    pub headers: Headers,
}

/// How one delivery ended, as the consumer's `on_terminal` reported it.
#[derive(Clone, Debug, PartialEq)]
pub struct TerminalRecord {
    /// The message id.
    pub id: String,
    /// How it ended.
    pub terminal: Terminal,
    /// The attempt the delivery was on when it ended.
    pub attempt: u32,
    /// When it was reported, on the harness's clock.
    pub at: Duration,
}

#[derive(Debug, Default)]
struct Inner {
    runs: Vec<RunRecord>,
    run_counts: HashMap<String, u32>,
    terminals: Vec<TerminalRecord>,
}

/// A shared, timed record of handler runs and terminals, across consumers and restarts.
#[derive(Clone, Debug)]
pub struct Journal {
    inner: Arc<Mutex<Inner>>,
    clock: Stopwatch,
}

fn message_id(msg: &Message) -> String {
    msg.properties().message_id.clone().unwrap_or_default()
}

impl Journal {
    /// An empty journal timed by `clock`.
    pub fn new(clock: Stopwatch) -> Self {
        Journal {
            inner: Arc::default(),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A callback for `ConsumerBuilder::with_on_terminal` that records into this journal.
    pub fn observer(&self) -> impl Fn(&Message, &Terminal) + Send + Sync + 'static {
        let journal = self.clone();
        move |msg, terminal| {
            let record = TerminalRecord {
                id: message_id(msg),
                terminal: *terminal,
                attempt: msg.attempt(),
                at: journal.clock.elapsed(),
            };
            journal.lock().terminals.push(record);
        }
    }

    /// A handler that runs `script` and records each run here.
    pub fn handler(
        &self,
        script: impl Fn(&RunInfo) -> Step + Send + Sync + 'static,
    ) -> ScriptedHandler {
        ScriptedHandler {
            journal: self.clone(),
            script: Arc::new(script),
        }
    }

    /// Every run of message `id`, in order.
    pub fn runs_of(&self, id: &str) -> Vec<RunRecord> {
        self.lock()
            .runs
            .iter()
            .filter(|r| r.info.id == id)
            .cloned()
            .collect()
    }

    /// Every run, in order.
    pub fn runs(&self) -> Vec<RunRecord> {
        self.lock().runs.clone()
    }

    /// Every terminal of message `id`, in the order of the attempts they ended (see
    /// [`Journal::terminals_by_message`] for why that is not always the report order).
    pub fn terminals_of(&self, id: &str) -> Vec<Terminal> {
        let mut records = self.terminal_records_of(id);
        records.sort_by_key(|r| r.attempt);
        records.into_iter().map(|r| r.terminal).collect()
    }

    /// Every terminal record of message `id`, in the order they were reported.
    pub fn terminal_records_of(&self, id: &str) -> Vec<TerminalRecord> {
        self.lock()
            .terminals
            .iter()
            .filter(|t| t.id == id)
            .cloned()
            .collect()
    }

    /// Every message's terminals, in the order of the attempts they ended, by message id.
    ///
    /// Terminals are reported when a settlement completes, and on a real broker the
    /// settlements of one message's successive deliveries can complete out of order (an ack
    /// batched behind others finishes after the next delivery was already handled), so the
    /// report order is not the decision order; the attempt is.
    pub fn terminals_by_message(&self) -> BTreeMap<String, Vec<Terminal>> {
        let mut ordered: BTreeMap<String, Vec<(u32, Terminal)>> = BTreeMap::new();
        for t in &self.lock().terminals {
            ordered
                .entry(t.id.clone())
                .or_default()
                .push((t.attempt, t.terminal));
        }
        ordered
            .into_iter()
            .map(|(id, mut ts)| {
                ts.sort_by_key(|(attempt, _)| *attempt);
                (id, ts.into_iter().map(|(_, t)| t).collect())
            })
            .collect()
    }

    /// How many distinct messages have reached a final terminal.
    pub fn finished(&self) -> usize {
        let inner = self.lock();
        let mut ids: Vec<&str> = inner
            .terminals
            .iter()
            .filter(|t| t.terminal.is_final())
            .map(|t| t.id.as_str())
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }

    /// Whether message `id` has reached a final terminal.
    pub fn is_finished(&self, id: &str) -> bool {
        self.lock()
            .terminals
            .iter()
            .any(|t| t.id == id && t.terminal.is_final())
    }

    fn record_run(&self, msg: &Message, script: &dyn Fn(&RunInfo) -> Step) -> Step {
        let at = self.clock.elapsed();
        let id = message_id(msg);
        let mut inner = self.lock();
        let run = {
            let n = inner.run_counts.entry(id.clone()).or_default();
            *n += 1;
            *n
        };
        let info = RunInfo {
            id,
            attempt: msg.attempt(),
            run,
        };
        let step = script(&info);
        inner.runs.push(RunRecord {
            info,
            at,
            step,
            headers: msg.headers().clone(),
        });
        step
    }
}

type Script = Arc<dyn Fn(&RunInfo) -> Step + Send + Sync>;

/// A [`Handler`] that does what its script says for each run and records the run in a
/// [`Journal`]. Failure causes name the attempt, so the parked diagnostics can be checked.
#[derive(Clone)]
pub struct ScriptedHandler {
    journal: Journal,
    script: Script,
}

impl std::fmt::Debug for ScriptedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScriptedHandler").finish_non_exhaustive()
    }
}

/// The cause a scripted transient failure reports on `attempt`.
pub fn transient_cause(attempt: u32) -> String {
    format!("transient failure on attempt {attempt}")
}

/// The cause a scripted permanent failure reports on `attempt`.
pub fn permanent_cause(attempt: u32) -> String {
    format!("permanent failure on attempt {attempt}")
}

#[async_trait]
impl Handler for ScriptedHandler {
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        let step = self.journal.record_run(msg, &*self.script);
        let attempt = msg.attempt();
        match step {
            Step::Succeed => Ok(()),
            Step::Fail => Err(HandlerError::transient(transient_cause(attempt))),
            Step::Permanent => Err(HandlerError::permanent(permanent_cause(attempt))),
            Step::RetryAfter(d) => Err(HandlerError::retry_after(
                d,
                format!("retry after {d:?} on attempt {attempt}"),
            )),
            Step::Hang => futures::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retry_core::{MessageParts, Properties};

    #[test]
    fn terminals_of_orders_by_attempt_not_by_report() {
        let journal = Journal::new(Stopwatch::new(|| Duration::ZERO));
        let observe = journal.observer();
        let msg = Message::new(MessageParts {
            properties: Properties {
                message_id: Some("m".into()),
                ..Default::default()
            },
            ..Default::default()
        });
        let retried = Terminal::Retried {
            attempts: 1,
            delay: Duration::from_millis(200),
        };
        let handled = Terminal::Handled { attempt: 2 };
        // The clone was handled before the first delivery's settlement completed.
        observe(&msg.with_attempt(2), &handled);
        observe(&msg, &retried);
        assert_eq!(journal.terminals_of("m"), [retried, handled]);
        assert_eq!(
            journal.terminal_records_of("m")[0].terminal,
            handled,
            "records keep the report order"
        );
        assert_eq!(journal.terminals_by_message()["m"], [retried, handled]);
    }
}
