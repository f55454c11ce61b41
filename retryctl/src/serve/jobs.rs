//! Replays and purges started from the console: each runs on a thread of its own, through
//! [`ParkingLot`], and its progress and result (the same [`ParkingReport`] the CLI prints)
//! are kept for its page.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use retry_core::{ParkedFilter, ParkingLot, ParkingReport, ReplayOptions, Timestamp};

use super::{App, Queue, on_transport};
use crate::error::CliError;
use crate::parked::{Inspect, count_hidden_headers, hidden_headers_refusal, walk_error_text};

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
    /// When it started.
    pub started: Timestamp,
    /// How it stands.
    pub progress: Mutex<Progress>,
}

impl Job {
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

    fn add(&self, queue: &str, action: Action, selection: String) -> Arc<Job> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let id = jobs.last().map_or(1, |j| j.id + 1);
        let job = Arc::new(Job {
            id,
            queue: queue.to_owned(),
            action,
            selection,
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

/// Starts `action` on the messages of `queue` that `filter` matches, and returns its job;
/// the index is walked again when it ends (but for a dry run).
pub fn start(
    app: &Arc<App>,
    queue: &Arc<Queue>,
    action: Action,
    filter: ParkedFilter,
    selection: String,
) -> Arc<Job> {
    let job = app.jobs.add(&queue.name, action, selection);
    let (app, queue, running) = (Arc::clone(app), Arc::clone(queue), Arc::clone(&job));
    std::thread::Builder::new()
        .name(format!("{} {}", action.name(), queue.name))
        .spawn(move || {
            let result = {
                let _busy = queue.busy.lock().unwrap_or_else(|e| e.into_inner());
                on_transport!(&app, |transport| act(
                    &transport, &queue, action, &filter, &running
                ))
            };
            let mut progress = running.progress.lock().unwrap_or_else(|e| e.into_inner());
            progress.done = true;
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

async fn act<T: Inspect>(
    transport: &Arc<T>,
    queue: &Queue,
    action: Action,
    filter: &ParkedFilter,
    job: &Job,
) -> Result<ParkingReport, CliError> {
    let lot = ParkingLot::with_queues(
        Arc::clone(transport),
        queue.name.as_str(),
        queue.parking.as_str(),
    );
    let progress = |r: &ParkingReport| {
        if let Ok(mut p) = job.progress.lock() {
            p.report = *r;
        }
    };
    let result = match action {
        Action::Replay { rate, dry_run } => {
            if T::MAY_HIDE_HEADERS {
                let hidden = count_hidden_headers::<T>(&lot, filter).await.map_err(|e| {
                    CliError::failure_from(format!("cannot read {}", queue.parking), e)
                })?;
                hidden_headers_refusal(hidden, &queue.parking)?;
            }
            let mut options = ReplayOptions::default().with_dry_run(dry_run);
            if let Some(rate) = rate {
                options = options.with_rate(rate);
            }
            lot.replay(filter, options, progress).await
        }
        Action::Purge => lot.purge(filter, progress).await,
    };
    result.map_err(|e| {
        let report = e.report();
        if let Ok(mut p) = job.progress.lock() {
            p.report = report;
        }
        CliError::failure_from(walk_error_text(action.name(), &report), e)
    })
}
