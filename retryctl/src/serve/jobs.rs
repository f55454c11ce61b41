//! Replays and purges started from the console: each runs on a thread of its own, through
//! [`ParkingLot`], and its progress and result (the same [`ParkingReport`] the CLI prints)
//! are kept for its page.
//!
//! A job takes exactly the messages of its [`Selection`], each once, and leaves every other
//! message it reads. It can be cancelled: it stops before the next message it would take
//! (under a rate, once that message's turn has come), and every message it has not taken
//! stays parked.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use retry_core::{
    Admin, DynTransport, Message, ParkedFilter, ParkingLot, ParkingReport, Pick, ReplayOptions,
    Timestamp,
};

use super::index::Key;
use super::selection::Selection;
use super::{App, Queue, watched};
use crate::error::CliError;
use crate::present::{hidden_headers_refusal, walk_error_text};
use crate::runtime::block_on;

/// The slowest and fastest replay rates the console takes, messages a second. At the
/// slowest, a cancelled replay stops within 10 s.
pub const RATES: (f64, f64) = (0.1, 100_000.0);

/// What an action does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    /// Replays, at most `rate` a second; counts only when `dry_run`.
    Replay {
        /// At most this many a second.
        rate: Option<f64>,
        /// Counts what would be replayed, and replays nothing.
        dry_run: bool,
    },
    /// Removes for good.
    Purge,
}

impl Action {
    /// Its name in pages and the API.
    pub fn name(self) -> &'static str {
        match self {
            Action::Replay { dry_run: true, .. } => "dry run",
            Action::Replay { .. } => "replay",
            Action::Purge => "purge",
        }
    }
}

/// How a job stands.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    /// The report so far, or the final one.
    pub report: ParkingReport,
    /// Whether it has ended.
    pub done: bool,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Whether it was cancelled before it ended.
    pub cancelled: bool,
    /// When it ended.
    pub ended: Option<Timestamp>,
}

/// A replay or purge.
pub struct Job {
    /// Its number, from 1.
    pub id: u64,
    /// The work queue.
    pub queue: String,
    /// What it does.
    pub action: Action,
    /// The selection, as the page says it.
    pub selection: String,
    /// How many messages the selection holds: the most it takes.
    pub selected: u64,
    /// Asks it to stop.
    cancel: AtomicBool,
    /// When it started.
    pub started: Timestamp,
    /// How it stands.
    pub progress: Mutex<Progress>,
}

impl Job {
    /// Asks it to stop before the next message it would take; `false` if it has ended.
    pub fn cancel(&self) -> bool {
        self.cancel.store(true, Ordering::SeqCst);
        !self.progress().done
    }

    /// A copy of how it stands.
    pub fn progress(&self) -> Progress {
        self.progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Every job of this run of the console (the newest 1,000).
#[derive(Default)]
pub struct Jobs {
    jobs: Mutex<Vec<Arc<Job>>>,
}

/// Jobs kept for their pages.
const KEPT: usize = 1000;

impl Jobs {
    /// The job numbered `id`.
    pub fn get(&self, id: u64) -> Option<Arc<Job>> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.iter().find(|j| j.id == id).cloned()
    }

    /// The newest `n` jobs, newest first.
    pub fn recent(&self, n: usize) -> Vec<Arc<Job>> {
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.iter().rev().take(n).cloned().collect()
    }

    fn add(&self, queue: &str, action: Action, selection: &Selection) -> Arc<Job> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let id = jobs.last().map_or(1, |j| j.id + 1);
        let job = Arc::new(Job {
            id,
            queue: queue.to_owned(),
            action,
            selection: selection.description.clone(),
            selected: selection.count(),
            cancel: AtomicBool::new(false),
            started: Timestamp::from_system_time(SystemTime::now()),
            progress: Mutex::new(Progress::default()),
        });
        jobs.push(Arc::clone(&job));
        if jobs.len() > KEPT {
            jobs.remove(0);
        }
        job
    }
}

/// Starts `action` on the messages of `selection` on `queue`, and returns its job; the index
/// is walked again when it ends (but for a dry run).
pub fn start(
    app: &Arc<App>,
    queue: &Arc<Queue>,
    action: Action,
    selection: &Arc<Selection>,
) -> Arc<Job> {
    let job = app.jobs.add(&queue.name, action, selection);
    let (app, queue, running, selection) = (
        Arc::clone(app),
        Arc::clone(queue),
        Arc::clone(&job),
        Arc::clone(selection),
    );
    std::thread::Builder::new()
        .name(format!("{} {}", action.name(), queue.name))
        .spawn(move || {
            let result = {
                let _busy = queue.busy.lock().unwrap_or_else(|e| e.into_inner());
                // A panic ends the job with its message, never leaves it running for ever.
                std::panic::catch_unwind(AssertUnwindSafe(|| {
                    block_on(app.broker.with_transport(&[], async |transport| {
                        act(transport, &app, &queue, action, &selection, &running).await
                    }))
                }))
                .unwrap_or_else(|panic| Err(CliError::failure(super::panic_text(&*panic))))
            };
            let mut progress = running.progress.lock().unwrap_or_else(|e| e.into_inner());
            progress.done = true;
            progress.cancelled = running.cancel.load(Ordering::SeqCst);
            progress.ended = Some(Timestamp::from_system_time(SystemTime::now()));
            match result {
                Ok(report) => progress.report = report,
                Err(e) => progress.error = Some(e.chain()),
            }
            drop(progress);
            if !matches!(action, Action::Replay { dry_run: true, .. }) {
                queue.refresh_now();
            }
        })
        .expect("a thread for the job");
    job
}

/// The pick of a job: takes a message while the selection holds one more of its key, stops
/// once the job is cancelled.
fn picker<'a>(selection: &Selection, cancel: &'a AtomicBool) -> impl FnMut(&Message) -> Pick + 'a {
    let mut wanted: HashMap<Key, u32> = HashMap::new();
    for key in &selection.keys {
        *wanted.entry(*key).or_default() += 1;
    }
    move |message| {
        if cancel.load(Ordering::SeqCst) {
            return Pick::Stop;
        }
        let key = Key::of(message);
        match wanted.get_mut(&key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                wanted.remove(&key);
            }
            None => return Pick::Leave,
        }
        Pick::Take
    }
}

async fn act(
    transport: &DynTransport,
    app: &App,
    queue: &Queue,
    action: Action,
    selection: &Selection,
    job: &Job,
) -> Result<ParkingReport, CliError> {
    let lot = ParkingLot::with_queues(
        transport.clone(),
        queue.name.as_str(),
        queue.parking.as_str(),
    );
    let moved = AtomicU64::new(0);
    let progress = |r: &ParkingReport| {
        moved.store(r.seen, Ordering::Relaxed);
        if let Ok(mut p) = job.progress.lock() {
            p.report = *r;
        }
    };
    // Every message is read, so that the report says how many were left, as the CLI's does;
    // the pick takes only the selection's.
    let all = ParkedFilter::all();
    let pick = picker(selection, &job.cancel);
    let run = async {
        match action {
            Action::Replay { rate, dry_run } => {
                if transport.may_hide_headers() && !dry_run {
                    let selected: HashSet<Key> = selection.keys.iter().copied().collect();
                    let mut hidden = 0u64;
                    let mut why = None;
                    lot.browse(&all, |parked| {
                        moved.fetch_add(1, Ordering::Relaxed);
                        if selected.contains(&Key::of(parked.message()))
                            && let Some(said) = transport.hidden_headers(parked.message())
                        {
                            hidden += 1;
                            why.get_or_insert(said);
                        }
                        ControlFlow::Continue(())
                    })
                    .await
                    .map_err(|e| {
                        CliError::failure_from(format!("cannot read {}", queue.parking), e)
                    })?;
                    hidden_headers_refusal(hidden, &queue.parking, why.as_deref())?;
                }
                let mut options = ReplayOptions::default().with_dry_run(dry_run);
                if let Some(rate) = rate {
                    options = options.with_rate(rate);
                }
                Ok(lot.replay_picked(&all, options, pick, progress).await)
            }
            Action::Purge => Ok(lot.purge_picked(&all, pick, progress).await),
        }
    };
    let result = watched(run, &moved, app.walk_timeout, &queue.parking).await?;
    result.map_err(|e| {
        let report = e.report();
        if let Ok(mut p) = job.progress.lock() {
            p.report = report;
        }
        CliError::failure_from(walk_error_text(action.name(), &report), e)
    })
}

#[cfg(test)]
mod tests {
    use retry_core::MessageParts;

    use super::*;

    fn message(body: &str) -> Message {
        Message::new(MessageParts {
            body: body.as_bytes().to_vec(),
            ..MessageParts::default()
        })
    }

    #[test]
    fn a_job_takes_each_selected_message_as_often_as_it_was_selected_and_stops_when_cancelled() {
        let (a, b, c) = (message("a"), message("b"), message("c"));
        let keys = vec![Key::of(&a), Key::of(&a), Key::of(&b)];
        let selection =
            Selection::new("q", "3 chosen messages".into(), keys, (None, 1, 0)).unwrap();
        let cancel = AtomicBool::new(false);
        let mut pick = picker(&selection, &cancel);
        let picks: Vec<Pick> = [&a, &c, &a, &a, &b, &b].iter().map(|m| pick(m)).collect();
        use Pick::{Leave, Take};
        assert_eq!(picks, [Take, Leave, Take, Leave, Take, Leave]);
        let selection = Selection::new("q", "1".into(), vec![Key::of(&c)], (None, 1, 0)).unwrap();
        let mut pick = picker(&selection, &cancel);
        cancel.store(true, Ordering::SeqCst);
        assert_eq!(pick(&c), Pick::Stop);
    }
}
