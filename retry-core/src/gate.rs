//! `SoloGate`: "alone" for every consumer of one process, not just for one consumer.
//!
//! A crash takes down the whole process, with every consumer in it. A suspect that runs
//! alone in its own consumer while another consumer of the same process runs work is not
//! alone: if that work crashes the process, the suspect comes back redelivered from the
//! isolation queue and is charged a crash it did not cause. So the consumers of a process
//! share a gate. One that has suspects asks for it; every other one stops starting work,
//! lets what it holds finish and settle, and says it is quiet; once all are quiet, the one
//! asking runs its suspects, and when it is done the others resume (or the next one asking
//! takes its turn, first come first served).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::task::{Context, Poll, Waker};

use crate::Excuses;

/// The gate that consumers sharing one failure domain (a process) pass through to run
/// suspects alone; see [`ConsumerBuilder::with_solo_gate`](crate::ConsumerBuilder::with_solo_gate).
///
/// A consumer uses its transport's gate ([`Transport::solo_gate`](crate::Transport::solo_gate))
/// unless told otherwise: for a broker client that is [`SoloGate::process`], the gate of the
/// whole process; the in-memory broker has a gate of its own, shared by its consumers. Give
/// consumers a gate of their own ([`SoloGate::new`]) only when they cannot take each other
/// down: a simulated process in a test, or consumers in separate processes driven from one
/// test binary.
///
/// ```
/// use retry_core::SoloGate;
///
/// // Two simulated processes in one test: each with its own gate.
/// let (first, second) = (SoloGate::new(), SoloGate::new());
/// assert!(!first.same_as(&second));
/// assert!(SoloGate::process().same_as(&SoloGate::process()));
/// ```
#[derive(Clone, Debug, Default)]
pub struct SoloGate {
    state: Arc<Mutex<State>>,
    /// How many members ask for the gate or hold it (`State::queue`'s length), written
    /// under the lock: a consumer checks on every turn whether another one asks, and almost
    /// always none does, which this answers without taking the lock.
    asking: Arc<AtomicUsize>,
    excuses: Excuses,
}

#[derive(Debug, Default)]
struct State {
    members: Vec<Member>,
    next_id: u64,
    /// Members asking to run suspects alone, first come first served.
    queue: Vec<u64>,
    /// The member running suspects now.
    holder: Option<u64>,
    /// Bumped on every change; a member waits for it to move.
    version: u64,
}

#[derive(Debug)]
struct Member {
    id: u64,
    /// Starts no work and holds nothing: it cannot take the process down by itself.
    quiet: bool,
    waker: Option<Waker>,
}

impl SoloGate {
    /// A gate of its own, shared only by the consumers given it.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gate of this process: every consumer of a broker client that is not given another
    /// shares it.
    pub fn process() -> Self {
        static PROCESS: OnceLock<SoloGate> = OnceLock::new();
        PROCESS.get_or_init(SoloGate::new).clone()
    }

    /// Whether `other` is the same gate.
    pub fn same_as(&self, other: &SoloGate) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// Consumers passing through the gate now.
    pub fn members(&self) -> usize {
        self.lock().members.len()
    }

    /// The excuses of the consumers passing through the gate, which share them: any of
    /// them may fetch a suspect another one put back.
    pub fn excuses(&self) -> &Excuses {
        &self.excuses
    }

    /// Joins the gate as a quiet member.
    pub(super) fn join(&self) -> GateMember {
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        s.members.push(Member {
            id,
            quiet: true,
            waker: None,
        });
        s.changed();
        GateMember {
            gate: self.clone(),
            id,
            seen: u64::MAX,
            quiet: AtomicBool::new(true),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl State {
    /// Records a change and wakes every member, so each looks again.
    fn changed(&mut self) {
        self.version = self.version.wrapping_add(1);
        for m in &mut self.members {
            if let Some(w) = m.waker.take() {
                w.wake();
            }
        }
    }

    fn member(&mut self, id: u64) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.id == id)
    }
}

/// One consumer's place at a [`SoloGate`]; it leaves the gate when dropped.
#[derive(Debug)]
pub(super) struct GateMember {
    gate: SoloGate,
    id: u64,
    /// The gate's version when this member last looked.
    seen: u64,
    /// What this member last said of itself (`Member::quiet`, which only it writes): a
    /// consumer says it on every turn, and the lock is taken only when it changes.
    quiet: AtomicBool,
}

impl GateMember {
    /// Asks to run suspects alone (a no-op when already asking).
    pub(super) fn request(&self) {
        let mut s = self.gate.lock();
        if !s.queue.contains(&self.id) {
            s.queue.push(self.id);
            self.gate.asking.store(s.queue.len(), Ordering::Release);
            s.changed();
        }
    }

    /// Says whether this member is quiet: it starts no work and holds nothing.
    pub(super) fn set_quiet(&self, quiet: bool) {
        if self.quiet.load(Ordering::Relaxed) == quiet {
            return;
        }
        let mut s = self.gate.lock();
        let Some(m) = s.member(self.id) else { return };
        self.quiet.store(quiet, Ordering::Relaxed);
        if m.quiet != quiet {
            m.quiet = quiet;
            s.changed();
        }
    }

    /// Whether another member is asking to run suspects alone, or running them: this one
    /// must stay quiet.
    pub(super) fn others_asking(&self) -> bool {
        if self.gate.asking.load(Ordering::Acquire) == 0 {
            return false;
        }
        let s = self.gate.lock();
        s.queue.iter().any(|&id| id != self.id)
    }

    /// Stops being quiet, to run work, unless another member asks for the gate or holds it.
    /// The look and the change are one step under the gate's lock: a member that looked and
    /// then said it was busy could let another one take the gate in between and run a
    /// suspect beside the work it starts.
    pub(super) fn try_resume(&self) -> bool {
        let mut s = self.gate.lock();
        if s.queue.iter().any(|&id| id != self.id) {
            return false;
        }
        let Some(m) = s.member(self.id) else {
            return false;
        };
        self.quiet.store(false, Ordering::Relaxed);
        if m.quiet {
            m.quiet = false;
            s.changed();
        }
        true
    }

    /// Takes the gate, if this member asked, comes first, and every other member is quiet.
    pub(super) fn try_enter(&self) -> bool {
        let mut s = self.gate.lock();
        if s.holder == Some(self.id) {
            return true;
        }
        let first = s.queue.first() == Some(&self.id);
        let others_quiet = s.members.iter().all(|m| m.id == self.id || m.quiet);
        if s.holder.is_none() && first && others_quiet {
            s.holder = Some(self.id);
            s.changed();
            return true;
        }
        false
    }

    /// Gives the gate back and stops asking.
    pub(super) fn leave(&self) {
        let mut s = self.gate.lock();
        let before = (s.holder, s.queue.len());
        if s.holder == Some(self.id) {
            s.holder = None;
        }
        s.queue.retain(|&id| id != self.id);
        self.gate.asking.store(s.queue.len(), Ordering::Release);
        if before != (s.holder, s.queue.len()) {
            s.changed();
        }
    }

    /// Whether the process has excused suspects that have not come back yet.
    pub(super) fn excuses_pending(&self) -> bool {
        !self.gate.excuses.is_empty()
    }

    /// Ready once the gate has changed since this member last looked; it then looks again.
    pub(super) fn poll_changed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.gate.lock();
        if s.version != self.seen {
            self.seen = s.version;
            return Poll::Ready(());
        }
        if let Some(m) = s.member(self.id) {
            m.waker = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl Drop for GateMember {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        s.members.retain(|m| m.id != self.id);
        s.queue.retain(|&id| id != self.id);
        self.gate.asking.store(s.queue.len(), Ordering::Release);
        if s.holder == Some(self.id) {
            s.holder = None;
        }
        s.changed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_to_ask_enters_once_every_other_member_is_quiet() {
        let gate = SoloGate::new();
        let (a, b) = (gate.join(), gate.join());
        b.set_quiet(false);
        a.request();
        assert!(b.others_asking());
        assert!(!a.others_asking());
        assert!(!a.try_enter(), "b still runs work");
        b.request();
        b.set_quiet(true);
        assert!(!b.try_enter(), "a asked first");
        assert!(a.try_enter());
        assert!(a.try_enter(), "holding it");
        a.set_quiet(true);
        a.leave();
        assert!(a.others_asking(), "b is still asking");
        assert!(b.try_enter());
        b.leave();
        assert!(!a.others_asking());
    }

    #[test]
    fn resuming_work_and_taking_the_gate_exclude_each_other() {
        let gate = SoloGate::new();
        let (a, b) = (gate.join(), gate.join());
        assert!(a.try_resume(), "nobody asks");
        b.request();
        assert!(!b.try_enter(), "a is busy from the moment it resumed");
        a.set_quiet(true);
        assert!(b.try_enter());
        assert!(!a.try_resume(), "b holds the gate");
        b.leave();
        assert!(a.try_resume());
    }

    #[test]
    fn a_member_that_goes_away_lets_the_others_through() {
        let gate = SoloGate::new();
        let a = gate.join();
        let b = gate.join();
        b.set_quiet(false);
        a.request();
        assert!(!a.try_enter());
        drop(b);
        assert!(a.try_enter());
        assert_eq!(gate.members(), 1);
        drop(a);
        assert_eq!(gate.members(), 0);
        let c = gate.join();
        c.request();
        assert!(c.try_enter(), "the holder's place was freed");
    }

    #[test]
    fn a_change_wakes_the_other_members() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::task::Wake;
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let gate = SoloGate::new();
        let mut a = gate.join();
        let b = gate.join();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(a.poll_changed(&mut cx).is_ready(), "first look");
        assert!(a.poll_changed(&mut cx).is_pending());
        b.request();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(a.poll_changed(&mut cx).is_ready());
        assert!(a.poll_changed(&mut cx).is_pending());
    }
}
