//! After a chaos run: what became of every message, from the journal and from what was
//! left in each queue of the plan.
//!
//! * A message whose script succeeds ([`Class::healthy`]) must have been handled (a `ran`
//!   line with `outcome=ok`), and never parked or charged a crash.
//! * Any other must be parked with the reason its script gives (the parking queue, drained
//!   at the end, is the evidence).
//! * A message neither handled nor parked is **stuck** if a copy is still in a queue, and
//!   **lost** if not: for each, the report prints its whole journal and the faults around it.
//! * A crash charged to a message that is not poison is explained only when the process
//!   that held it alone (its previous isolation delivery) was SIGKILLed by the driver while
//!   holding it: the engine cannot tell that from a crash it caused. A charge after the
//!   holder lost its connection and lived on, made by another process, is blamed across
//!   processes (excuses are per process). Every other charge is a wrong blame, named with
//!   its signature: no process held it (a transfer that arrived after its fetch gave up),
//!   the holder aborted on another message (it did not run alone), or the holder lived on
//!   and charged it itself (its excuse was lost).
//! * Suspects run alone: in no process does a handler run beside an isolation run.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use super::journal::Entry;
use super::script::Class;

/// A message taken out of a queue at the end of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drained {
    /// Its message id.
    pub id: String,
    /// `x-retry-reason`, on a parked message.
    pub reason: Option<String>,
    /// `x-retry-crashes`.
    pub crashes: u32,
}

/// What the driver knows that the journal does not say by itself.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    /// Every id published, in order.
    pub ids: Vec<String>,
    /// The policy's crash limit.
    pub crash_limit: u32,
    /// What was left in each queue, by its name after the work queue's (`""` for the work
    /// queue itself, `.parking`, `.suspect`, ...).
    pub drained: BTreeMap<String, Vec<Drained>>,
}

/// A poison message's record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoisonRecord {
    /// Its id.
    pub id: String,
    /// Handler runs alone (each aborted its process).
    pub solo_runs: usize,
    /// Handler runs beside others (each aborted its process too).
    pub work_runs: usize,
    /// Copies found parked, and the crashes each carried.
    pub parked_crashes: Vec<u32>,
    /// Crashes charged to it by an injected SIGKILL of the process holding it alone
    /// rather than by its own abort.
    pub kill_charges: usize,
}

/// What became of a run's messages.
#[derive(Clone, Debug, Default)]
pub struct Reconciled {
    /// Messages published.
    pub messages: usize,
    /// Distinct messages handled.
    pub handled: usize,
    /// Distinct messages parked.
    pub parked: usize,
    /// Messages neither handled nor parked and in no queue.
    pub lost: Vec<String>,
    /// Messages neither handled nor parked, with a copy left in a queue (which one).
    pub stuck: Vec<(String, String)>,
    /// Messages handled more than once, and the extra successful runs.
    pub duplicates: (usize, usize),
    /// Extra parked copies.
    pub parked_duplicates: usize,
    /// Healthy messages parked.
    pub healthy_parked: Vec<String>,
    /// Messages parked with another reason than their script's, or handled when their
    /// script never succeeds.
    pub wrong_end: Vec<String>,
    /// Crashes charged to messages that are not poison, explained by an injected SIGKILL.
    pub charged_by_kill: Vec<String>,
    /// Crashes charged to messages that are not poison, and not explained: wrong blame.
    pub wrongly_blamed: Vec<String>,
    /// Crashes charged to messages (poison or not) after the process running them alone
    /// lost its connection and lived on, by another process that had no excuse for them.
    pub blamed_across_processes: Vec<String>,
    /// Crashes charged to poison messages that no solo run of theirs (or injected kill)
    /// explains.
    pub poison_unexplained: Vec<String>,
    /// Handlers that ran beside an isolation run, per process.
    pub alone_violations: Vec<String>,
    /// Every poison message.
    pub poison: Vec<PoisonRecord>,
    /// Copies left in each queue at the end (parking included).
    pub left: BTreeMap<String, usize>,
    /// Journal lines that did not parse.
    pub bad_lines: usize,
    /// The journal excerpts of every problem above, ready to print.
    pub details: String,
}

impl Reconciled {
    /// Everything that breaks the rules, one line each; empty when the run is clean. A
    /// crash charged by an injected SIGKILL of the process running the message alone is
    /// not among them: by design it cannot be told from a crash the message caused
    /// ([`charged_by_kill`](Self::charged_by_kill) lists them).
    pub fn problems(&self, crash_limit: u32) -> Vec<String> {
        let mut out = Vec::new();
        if !self.lost.is_empty() {
            out.push(format!("{} lost: {:?}", self.lost.len(), self.lost));
        }
        if !self.stuck.is_empty() {
            out.push(format!(
                "{} stuck in a queue: {:?}",
                self.stuck.len(),
                self.stuck
            ));
        }
        if !self.healthy_parked.is_empty() {
            out.push(format!(
                "healthy messages parked: {:?}",
                self.healthy_parked
            ));
        }
        if !self.wrong_end.is_empty() {
            out.push(format!("wrong ends: {:?}", self.wrong_end));
        }
        if !self.wrongly_blamed.is_empty() {
            out.push(format!("wrongly blamed: {:?}", self.wrongly_blamed));
        }
        if !self.blamed_across_processes.is_empty() {
            out.push(format!(
                "blamed across processes (a connection lost during a solo run, excused only by the process that saw it): {:?}",
                self.blamed_across_processes
            ));
        }
        if !self.poison_unexplained.is_empty() {
            out.push(format!(
                "poison charged crashes no solo run caused: {:?}",
                self.poison_unexplained
            ));
        }
        if !self.alone_violations.is_empty() {
            out.push(format!(
                "suspects that did not run alone: {:?}",
                self.alone_violations
            ));
        }
        for p in &self.poison {
            let copies = p.parked_crashes.len();
            if copies == 0 {
                continue; // counted as lost or stuck
            }
            let expected = copies * (crash_limit as usize + 1);
            if p.parked_crashes.iter().any(|c| *c != crash_limit + 1)
                || p.solo_runs + p.kill_charges != expected
            {
                out.push(format!(
                    "{}: parked {copies} time(s) with crashes {:?} after {} solo runs and {} injected kills (expected {expected} in all)",
                    p.id, p.parked_crashes, p.solo_runs, p.kill_charges
                ));
            }
        }
        out
    }
}

/// Lines of the run by message id, and the driver's and processes' own lines.
struct Index<'a> {
    entries: &'a [Entry],
    by_id: HashMap<&'a str, Vec<usize>>,
}

impl<'a> Index<'a> {
    fn new(entries: &'a [Entry]) -> Self {
        let mut by_id: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, e) in entries.iter().enumerate() {
            if e.id != "-" {
                by_id.entry(e.id.as_str()).or_default().push(i);
            }
        }
        Index { entries, by_id }
    }

    fn of(&self, id: &str) -> impl Iterator<Item = (usize, &'a Entry)> + '_ {
        self.by_id
            .get(id)
            .into_iter()
            .flatten()
            .map(|&i| (i, &self.entries[i]))
    }

    /// The message's journal, with the faults injected and the starts, ends and errors of
    /// the processes that touched it, from its first line to 3 s after its last.
    fn excerpt(&self, id: &str) -> String {
        let lines: Vec<usize> = self.by_id.get(id).cloned().unwrap_or_default();
        // The window opens when the consumers first touch it, not when it was sent.
        let touched: Vec<usize> = lines
            .iter()
            .copied()
            .filter(|&i| self.entries[i].kind != "sent")
            .collect();
        let (Some(&first), Some(&last)) = (touched.first(), touched.last()) else {
            return format!("  (no consumer touched {id})\n");
        };
        let (from, to) = (self.entries[first].at, self.entries[last].at + 3_000);
        let pids: BTreeSet<u32> = lines.iter().map(|&i| self.entries[i].pid).collect();
        let mut out = String::new();
        // Errors repeat every poll while a broker is away: the first two of each kind per
        // process are enough.
        let mut repeats: HashMap<(u32, &str), usize> = HashMap::new();
        for e in self.entries {
            let fault = matches!(
                e.kind.as_str(),
                "kill" | "close" | "stop-app" | "start-app" | "exited" | "spawn" | "shutdown"
            );
            let process = pids.contains(&e.pid)
                && matches!(
                    e.kind.as_str(),
                    "start"
                        | "connected"
                        | "consume"
                        | "exit"
                        | "recv-err"
                        | "fetch-err"
                        | "flush-err"
                        | "ready-err"
                );
            let mut shown = e.id == id || (e.at >= from && e.at <= to && (fault || process));
            if shown && e.kind.ends_with("-err") {
                let n = repeats.entry((e.pid, e.kind.as_str())).or_default();
                *n += 1;
                shown = *n <= 2;
            }
            if shown {
                let _ = writeln!(out, "  {e}");
            }
        }
        out
    }
}

/// Why a crash was charged to a message.
#[derive(Debug)]
enum Charge {
    /// The process that held it alone died: the driver SIGKILLed it, or, for a poison
    /// message, it aborted running it.
    Explained(String),
    /// The driver SIGKILLed the process that held it alone before it ran it: a crash the
    /// message's own code did not cause, which a poison message's count of solo runs does
    /// not include.
    ExplainedByKill(String),
    /// The process that held it alone lost its connection and lived on, and the broker
    /// redelivered the message to another process, which could not know why: excuses are
    /// kept per process (`docs/limitations.md`: "Excuses do not cross processes").
    AcrossProcesses(String),
    /// Nothing explains it.
    Wrong(String),
}

/// Which process held a message's isolation delivery when a crash was charged for it, and
/// what became of that process.
fn explain_charge(index: &Index<'_>, id: &str, charged_at: usize, poison: bool) -> Charge {
    use Charge::{AcrossProcesses, Explained, ExplainedByKill, Wrong};
    // The delivery that was charged: the last isolation recv before the terminal.
    let recvs: Vec<(usize, &Entry)> = index
        .of(id)
        .filter(|(i, e)| *i < charged_at && e.kind == "recv" && e.is("lane", "isolation"))
        .collect();
    let Some(&(charged_recv, _)) = recvs.last() else {
        return Wrong("no isolation delivery before the charge".into());
    };
    // The one before it: the delivery held when the crash happened.
    let Some(&(held_at, held)) =
        recvs
            .iter()
            .rev()
            .find(|(i, _)| *i < charged_recv)
            .filter(|(i, _)| {
                // Nothing settled it in between (that would make it a different copy).
                !index.of(id).any(|(j, e)| {
                    j > *i && j < charged_recv && e.kind == "terminal" && !e.is("t", "requeued")
                })
            })
    else {
        // What fetched it, then? Every fetch of the isolation queue that found nothing or
        // failed since it was last put there.
        let since = index
            .of(id)
            .filter(|(i, e)| *i < charged_recv && e.kind == "terminal")
            .map(|(i, _)| i)
            .last()
            .unwrap_or(0);
        let fetches: Vec<String> = index.entries[since..charged_recv]
            .iter()
            .filter(|e| {
                (e.kind == "fetch-none" || e.kind == "fetch-err") && e.is("lane", "isolation")
            })
            .map(|e| format!("{} {}@{}", e.kind, e.pid, e.at))
            .collect();
        // A process SIGKILLed with a fetch under way held it without a line to say so.
        if let Some(kill) = index.entries[since..charged_recv]
            .iter()
            .find(|e| e.kind == "kill")
        {
            return ExplainedByKill(format!(
                "no line shows who held it, and the driver SIGKILLed process {} at {} meanwhile (a fetch under way?)",
                kill.get("pid").unwrap_or("?"),
                kill.at
            ));
        }
        return Wrong(format!(
            "no process held it alone before: it came back redelivered from the isolation queue without reaching a handler; fetches since it was put there: {fetches:?}"
        ));
    };
    let holder = held.pid.to_string();
    let settled_at = index
        .of(id)
        .find(|(j, e)| {
            *j > held_at && *j < charged_recv && e.pid == held.pid && e.kind == "settled"
        })
        .map(|(j, _)| j);
    let killed = (held_at..charged_recv).find(|&j| {
        let e = &index.entries[j];
        e.kind == "kill" && e.get("pid") == Some(holder.as_str())
    });
    let charged = &index.entries[charged_recv];
    // The driver notices an exit within a poll: an end logged a little after the charge
    // still came first.
    let ended = index.entries[held_at..]
        .iter()
        .take_while(|e| e.at <= charged.at + 1_000)
        .find(|e| e.kind == "exited" && e.get("pid") == Some(holder.as_str()));
    let dropped = index.entries[held_at..charged_recv].iter().any(|e| {
        (e.kind == "close" && e.get("pid") == Some(holder.as_str()))
            || (e.pid == held.pid && e.kind.ends_with("-err"))
            || e.kind == "stop-app"
    });
    // A kill that lands while the holder runs it (a poison, about to abort) ends the same
    // solo run the journal counts: it is that run's crash, not one more.
    let ran = index
        .of(id)
        .any(|(j, e)| j > held_at && j < charged_recv && e.pid == held.pid && e.kind == "run");
    let by_kill = |k: usize| {
        let why = format!(
            "process {holder} held it alone and was SIGKILLed by the driver at {}{}",
            index.entries[k].at,
            if ran { ", running it" } else { "" }
        );
        if ran {
            Explained(why)
        } else {
            ExplainedByKill(why)
        }
    };
    match (killed, settled_at) {
        (Some(k), None) => by_kill(k),
        (Some(k), Some(s)) if s > k => by_kill(k),
        _ => match ended {
            Some(end)
                if poison
                    && end.is("status", "signal:6")
                    && index.of(id).any(|(j, e)| {
                        j > held_at && j < charged_recv && e.pid == held.pid && e.kind == "run"
                    }) =>
            {
                Explained(format!("process {holder} aborted running it alone"))
            }
            Some(end) => Wrong(format!(
                "process {holder} held it (settled before the charge: {}) and ended {}, not by an injected kill",
                settled_at.is_some(),
                end.fields
            )),
            None if dropped && charged.pid != held.pid => AcrossProcesses(format!(
                "process {holder} held it alone, lost its connection and lived on; the broker redelivered it to process {}, which has no excuse for it",
                charged.pid
            )),
            None => Wrong(format!(
                "process {holder} held it (settled before the charge: {}, connection lost: {dropped}) and lived on: the excuse was lost",
                settled_at.is_some()
            )),
        },
    }
}

/// Reconciles a run: see the module docs.
pub fn reconcile(entries: &[Entry], bad_lines: usize, facts: &RunFacts) -> Reconciled {
    let index = Index::new(entries);
    let mut out = Reconciled {
        messages: facts.ids.len(),
        bad_lines,
        ..Reconciled::default()
    };
    let mut parked: HashMap<&str, Vec<&Drained>> = HashMap::new();
    let mut elsewhere: HashMap<&str, Vec<&str>> = HashMap::new();
    for (queue, messages) in &facts.drained {
        out.left.insert(queue.clone(), messages.len());
        for m in messages {
            if queue == ".parking" {
                parked.entry(m.id.as_str()).or_default().push(m);
            } else {
                elsewhere
                    .entry(m.id.as_str())
                    .or_default()
                    .push(queue.as_str());
            }
        }
    }
    let mut details = String::new();
    let mut detail = |title: String, id: &str| {
        let _ = writeln!(details, "--- {title}\n{}", index.excerpt(id));
    };

    for id in &facts.ids {
        let class = Class::of(id).expect("a chaos id names its class");
        let handled_runs = index
            .of(id)
            .filter(|(_, e)| e.kind == "ran" && e.is("outcome", "ok"))
            .count();
        let copies = parked.get(id.as_str()).map_or(&[][..], Vec::as_slice);
        if handled_runs > 0 {
            out.handled += 1;
            if handled_runs > 1 {
                out.duplicates.0 += 1;
                out.duplicates.1 += handled_runs - 1;
            }
        }
        if !copies.is_empty() {
            out.parked += 1;
            out.parked_duplicates += copies.len() - 1;
        }
        if handled_runs == 0 && copies.is_empty() {
            match elsewhere.get(id.as_str()) {
                Some(queues) => {
                    out.stuck.push((id.clone(), queues.join(",")));
                    detail(format!("STUCK {id} (in {queues:?})"), id);
                }
                None => {
                    out.lost.push(id.clone());
                    detail(
                        format!("LOSS {id}: never handled, never parked, in no queue"),
                        id,
                    );
                }
            }
        }
        match class.parked_reason() {
            None if !copies.is_empty() => {
                out.healthy_parked.push(id.clone());
                detail(format!("HEALTHY PARKED {id}: {copies:?}"), id);
            }
            Some(reason) => {
                let wrong: Vec<&&Drained> = copies
                    .iter()
                    .filter(|c| c.reason.as_deref() != Some(reason.as_str()))
                    .collect();
                if !wrong.is_empty() || handled_runs > 0 {
                    out.wrong_end.push(id.clone());
                    detail(
                        format!(
                            "WRONG END {id}: expected parked {reason}, got {copies:?}, handled {handled_runs} times"
                        ),
                        id,
                    );
                }
            }
            None => {}
        }
        let poison = class == Class::Poison;
        let mut poison_kill_charges = 0;
        // Crashes charged: each must be explained by the process that held it alone.
        let charges: Vec<usize> = index
            .of(id)
            .filter(|(_, e)| {
                e.kind == "terminal" && (e.is("t", "diverted") || e.is("reason", "crash-loop"))
            })
            .map(|(i, _)| i)
            .collect();
        for at in charges {
            match explain_charge(&index, id, at, poison) {
                Charge::Explained(_) if poison => {}
                Charge::ExplainedByKill(_) if poison => poison_kill_charges += 1,
                Charge::Explained(why) | Charge::ExplainedByKill(why) => {
                    out.charged_by_kill.push(id.clone());
                    detail(format!("CHARGED BY AN INJECTED KILL {id}: {why}"), id);
                }
                Charge::AcrossProcesses(why) => {
                    out.blamed_across_processes.push(id.clone());
                    detail(format!("BLAMED ACROSS PROCESSES {id}: {why}"), id);
                }
                Charge::Wrong(why) if poison => {
                    out.poison_unexplained.push(id.clone());
                    detail(
                        format!("POISON CHARGED A CRASH IT DID NOT CAUSE {id}: {why}"),
                        id,
                    );
                }
                Charge::Wrong(why) => {
                    out.wrongly_blamed.push(id.clone());
                    detail(format!("WRONGLY BLAMED {id}: {why}"), id);
                }
            }
        }
        if poison {
            let runs = |lane: &str| {
                index
                    .of(id)
                    .filter(|(_, e)| e.kind == "run" && e.is("lane", lane))
                    .count()
            };
            out.poison.push(PoisonRecord {
                id: id.clone(),
                solo_runs: runs("isolation"),
                work_runs: runs("work"),
                parked_crashes: copies.iter().map(|c| c.crashes).collect(),
                kill_charges: poison_kill_charges,
            });
        }
    }

    // Suspects run alone, per process.
    let mut running: HashMap<u32, BTreeMap<String, String>> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        match e.kind.as_str() {
            "run" => {
                let set = running.entry(e.pid).or_default();
                let lane = e.get("lane").unwrap_or("?").to_owned();
                let solo_running: Vec<&String> = set
                    .iter()
                    .filter(|(_, l)| *l == "isolation")
                    .map(|(id, _)| id)
                    .collect();
                if (lane == "isolation" && !set.is_empty()) || !solo_running.is_empty() {
                    let others: Vec<String> =
                        set.iter().map(|(id, l)| format!("{id}@{l}")).collect();
                    let what = format!(
                        "process {}: {} ({lane}) started at line {i} beside {others:?}",
                        e.pid, e.id
                    );
                    let _ = writeln!(details, "--- NOT ALONE: {what}");
                    out.alone_violations.push(what);
                }
                set.insert(e.id.clone(), lane);
            }
            "ran" => {
                if let Some(set) = running.get_mut(&e.pid) {
                    set.remove(&e.id);
                }
            }
            // A process starts with nothing running, whatever an earlier process with the
            // same pid (a long run wraps the pids) was running when it died.
            "start" => {
                running.remove(&e.pid);
            }
            _ => {}
        }
    }
    out.details = details;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: u32, kind: &str, id: &str, fields: &str) -> Entry {
        Entry {
            at: 0,
            pid,
            kind: kind.into(),
            id: id.into(),
            fields: fields.into(),
        }
    }

    fn facts(ids: &[&str], parked: &[(&str, &str, u32)]) -> RunFacts {
        let mut drained = BTreeMap::new();
        drained.insert(
            ".parking".to_owned(),
            parked
                .iter()
                .map(|(id, reason, crashes)| Drained {
                    id: (*id).to_owned(),
                    reason: Some((*reason).to_owned()),
                    crashes: *crashes,
                })
                .collect(),
        );
        RunFacts {
            ids: ids.iter().map(|s| (*s).to_owned()).collect(),
            crash_limit: 1,
            drained,
        }
    }

    #[test]
    fn a_message_neither_handled_nor_parked_is_lost_with_its_journal() {
        let entries = vec![
            entry(1, "recv", "m00000-ok", "lane=work redelivered=false"),
            entry(1, "run", "m00000-ok", "attempt=1 lane=work does=succeed"),
            entry(1, "ran", "m00000-ok", "attempt=1 outcome=ok"),
            entry(1, "recv", "m00001-ok", "lane=work redelivered=true"),
            entry(1, "publish", "m00001-ok", "to=q.suspect"),
            entry(1, "published", "m00001-ok", "to=q.suspect result=confirmed"),
            entry(1, "terminal", "m00001-ok", "lane=work t=isolated"),
            entry(1, "recv", "m00002-perm", "lane=work"),
        ];
        let r = reconcile(
            &entries,
            0,
            &facts(
                &["m00000-ok", "m00001-ok", "m00002-perm"],
                &[("m00002-perm", "permanent", 0)],
            ),
        );
        assert_eq!(r.lost, ["m00001-ok"]);
        assert_eq!((r.handled, r.parked), (1, 1));
        assert!(r.details.contains("result=confirmed"), "{}", r.details);
        assert_eq!(r.problems(1).len(), 1);
    }

    #[test]
    fn a_crash_charged_after_a_poison_abort_beside_it_is_a_wrong_blame() {
        let ok = "m00000-ok";
        let entries = vec![
            entry(1, "recv", ok, "lane=isolation redelivered=false"),
            entry(1, "run", ok, "attempt=1 lane=isolation does=succeed"),
            entry(1, "run", "m00001-poison", "attempt=1 lane=work does=abort"),
            entry(9, "exited", "-", "pid=1 status=signal:6"),
            entry(2, "recv", ok, "lane=isolation redelivered=true evidence=1"),
            entry(2, "terminal", ok, "lane=isolation t=diverted crashes=1"),
            entry(2, "recv", ok, "lane=isolation redelivered=false"),
            entry(2, "run", ok, "attempt=1 lane=isolation does=succeed"),
            entry(2, "ran", ok, "attempt=1 outcome=ok"),
        ];
        let r = reconcile(
            &entries,
            0,
            &facts(
                &[ok, "m00001-poison"],
                &[("m00001-poison", "crash-loop", 2)],
            ),
        );
        assert_eq!(r.wrongly_blamed, [ok]);
        assert_eq!(r.alone_violations.len(), 1, "{:?}", r.alone_violations);
        assert!(r.charged_by_kill.is_empty());
    }

    /// Seed 29 once: the driver SIGKILLed the process that had just started running a poison
    /// alone, before the poison's own abort. That is one solo run and one crash, not a
    /// solo run and a kill charge beside it.
    #[test]
    fn a_kill_that_lands_on_a_poisons_solo_run_is_that_runs_crash() {
        let p = "m00001-poison";
        let solo = |pid| {
            [
                entry(pid, "recv", p, "lane=isolation redelivered=false"),
                entry(pid, "run", p, "attempt=1 lane=isolation does=abort"),
            ]
        };
        let charge = |pid, crashes: u32| {
            let t = if crashes == 2 {
                "t=parked reason=crash-loop".to_owned()
            } else {
                format!("t=diverted crashes={crashes}")
            };
            [
                entry(pid, "recv", p, "lane=isolation redelivered=true evidence=1"),
                entry(pid, "terminal", p, &format!("lane=isolation {t}")),
            ]
        };
        let mut entries = Vec::new();
        entries.extend(solo(1));
        entries.push(entry(9, "kill", "-", "pid=1 holding-suspect=false"));
        entries.push(entry(9, "exited", "-", "pid=1 status=signal:9"));
        entries.extend(charge(2, 1));
        entries.extend(solo(2));
        entries.push(entry(9, "exited", "-", "pid=2 status=signal:6"));
        entries.extend(charge(3, 2));
        let r = reconcile(&entries, 0, &facts(&[p], &[(p, "crash-loop", 2)]));
        assert_eq!(r.poison.len(), 1, "{:?}", r.poison);
        assert_eq!(
            (r.poison[0].solo_runs, r.poison[0].kill_charges),
            (2, 0),
            "{:?}",
            r.poison
        );
        assert!(r.problems(1).is_empty(), "{:?}", r.problems(1));
    }

    #[test]
    fn a_pid_used_again_by_a_new_process_starts_with_nothing_running() {
        let entries = vec![
            entry(1, "start", "-", "protocol=amqp091 prefetch=20"),
            entry(1, "run", "m00000-ok", "attempt=1 lane=work does=succeed"),
            entry(9, "kill", "-", "pid=1"),
            entry(9, "exited", "-", "pid=1 status=signal:9"),
            entry(1, "start", "-", "protocol=amqp091 prefetch=20"),
            entry(
                1,
                "run",
                "m00001-ok",
                "attempt=1 lane=isolation does=succeed",
            ),
            entry(1, "ran", "m00001-ok", "attempt=1 outcome=ok"),
        ];
        let r = reconcile(&entries, 0, &facts(&["m00000-ok", "m00001-ok"], &[]));
        assert!(r.alone_violations.is_empty(), "{:?}", r.alone_violations);
        // Within one process's life the same runs are a violation.
        let mut one_life = entries.clone();
        one_life.remove(4);
        let r = reconcile(&one_life, 0, &facts(&["m00000-ok", "m00001-ok"], &[]));
        assert_eq!(r.alone_violations.len(), 1, "{:?}", r.alone_violations);
    }

    #[test]
    fn a_crash_charged_by_another_process_after_a_connection_drop_is_blamed_across_processes() {
        let ok = "m00000-always";
        let entries = vec![
            entry(1, "recv", ok, "lane=isolation redelivered=false"),
            entry(1, "run", ok, "attempt=2 lane=isolation does=fail"),
            entry(1, "ran", ok, "attempt=2 outcome=transient"),
            entry(1, "publish", ok, "to=q.retry.600ms"),
            entry(9, "close", "-", "pid=1 ports=4 closed=1 killed=0"),
            entry(
                1,
                "published",
                ok,
                "to=q.retry.600ms result=failed err=reconnecting",
            ),
            entry(2, "recv", ok, "lane=isolation redelivered=true evidence=1"),
            entry(2, "terminal", ok, "lane=isolation t=diverted crashes=1"),
            entry(1, "settled", ok, "how=ack result=err err=gone"),
        ];
        let r = reconcile(&entries, 0, &facts(&[ok], &[(ok, "attempts-exhausted", 1)]));
        assert_eq!(r.blamed_across_processes, [ok]);
        assert!(r.wrongly_blamed.is_empty());
        // The same, charged by the process that held it: its own excuse was lost.
        let mut same = entries.clone();
        same[6].pid = 1;
        same[7].pid = 1;
        let r = reconcile(&same, 0, &facts(&[ok], &[(ok, "attempts-exhausted", 1)]));
        assert_eq!(r.wrongly_blamed, [ok]);
    }

    #[test]
    fn a_crash_charged_after_an_injected_kill_of_its_solo_run_is_explained() {
        let ok = "m00000-ok";
        let entries = vec![
            entry(1, "recv", ok, "lane=isolation redelivered=false"),
            entry(1, "run", ok, "attempt=1 lane=isolation does=succeed"),
            entry(9, "kill", "-", "pid=1"),
            entry(9, "exited", "-", "pid=1 status=signal:9"),
            entry(2, "recv", ok, "lane=isolation redelivered=true evidence=1"),
            entry(2, "terminal", ok, "lane=isolation t=diverted crashes=1"),
            entry(2, "recv", ok, "lane=isolation redelivered=false"),
            entry(2, "run", ok, "attempt=1 lane=isolation does=succeed"),
            entry(2, "ran", ok, "attempt=1 outcome=ok"),
        ];
        let r = reconcile(&entries, 0, &facts(&[ok], &[]));
        assert_eq!(r.charged_by_kill, [ok]);
        assert!(r.wrongly_blamed.is_empty());
    }
}
