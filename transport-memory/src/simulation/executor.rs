//! A single-threaded executor with a FIFO ready queue: tasks run in the order they were
//! woken, so the same script always interleaves the same way. [`Broker::block_on`] runs one
//! future the same way.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use crate::broker::Broker;

type Task = Pin<Box<dyn Future<Output = ()>>>;

/// Task ids are never reused, so a stale wake cannot poll the wrong task.
pub(crate) type TaskId = usize;

#[derive(Default)]
struct ReadyQueue {
    inner: Mutex<(VecDeque<TaskId>, Vec<bool>)>,
}

impl ReadyQueue {
    fn push(&self, id: TaskId) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (queue, queued) = &mut *inner;
        if queued.len() <= id {
            queued.resize(id + 1, false);
        }
        if !queued[id] {
            queued[id] = true;
            queue.push_back(id);
        }
    }

    fn pop(&self) -> Option<TaskId> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (queue, queued) = &mut *inner;
        let id = queue.pop_front()?;
        queued[id] = false;
        Some(id)
    }
}

struct TaskWaker {
    id: TaskId,
    ready: Arc<ReadyQueue>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.ready.push(self.id);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.push(self.id);
    }
}

#[derive(Default)]
pub(crate) struct Executor {
    tasks: Vec<Option<(Task, Waker)>>,
    ready: Arc<ReadyQueue>,
}

impl Executor {
    pub(crate) fn spawn(&mut self, future: impl Future<Output = ()> + 'static) -> TaskId {
        let id = self.tasks.len();
        let waker = Waker::from(Arc::new(TaskWaker {
            id,
            ready: self.ready.clone(),
        }));
        self.tasks.push(Some((Box::pin(future), waker)));
        self.ready.push(id);
        id
    }

    /// Drops a task's future, as a process dies mid-flight.
    pub(crate) fn cancel(&mut self, id: TaskId) {
        // Take it out before dropping: its destructors may wake other tasks.
        let task = self.tasks.get_mut(id).and_then(Option::take);
        drop(task);
    }

    pub(crate) fn is_live(&self, id: TaskId) -> bool {
        self.tasks.get(id).is_some_and(Option::is_some)
    }

    /// Polls the next woken task; `false` when none is ready.
    pub(crate) fn poll_next(&mut self) -> bool {
        loop {
            let Some(id) = self.ready.pop() else {
                return false;
            };
            let Some(Some((task, waker))) = self.tasks.get_mut(id) else {
                continue;
            };
            let waker = waker.clone();
            let mut cx = Context::from_waker(&waker);
            if let Poll::Ready(()) = task.as_mut().poll(&mut cx) {
                self.tasks[id] = None;
            }
            return true;
        }
    }
}

/// How many times [`Broker::block_on`] may move the clock for one future: far more than any
/// scenario needs, so only a runaway loop reaches it.
const MAX_STEPS: u64 = 20_000_000;

/// How many polls in a row [`Broker::block_on`] allows without the clock moving: a future
/// that keeps waking itself without waiting on anything is a bug.
const MAX_SPINS: u64 = 1_000_000;

impl Broker {
    /// Runs `future` to completion on the broker's virtual clock: polls it until it stops
    /// waking itself, then moves the clock to the next deadline (a sleep ending, a message
    /// expiring, a consumer timeout) and polls it again. A [`Simulation`] does the same for
    /// many futures; this is for one, such as a test driving a consumer or a transport by
    /// hand.
    ///
    /// ```
    /// use std::time::Duration;
    /// use transport_memory::Broker;
    ///
    /// let broker = Broker::new();
    /// let start = broker.now();
    /// // An hour's sleep takes no time: the clock jumps to its deadline.
    /// broker.block_on(broker.sleep(Duration::from_secs(3600)));
    /// assert_eq!(broker.now(), start + Duration::from_secs(3600));
    /// ```
    ///
    /// The crate docs run a whole consumer this way.
    ///
    /// # Panics
    ///
    /// If the future waits while nothing is due on the clock (it could never finish), if it
    /// keeps waking itself a million times without the clock moving, or if the clock moves
    /// twenty million times and it is still not done.
    ///
    /// [`Simulation`]: crate::Simulation
    pub fn block_on<F: Future>(&self, future: F) -> F::Output {
        // The executor's waker, for one task: a wake queues it, a poll takes it off.
        let ready = Arc::new(ReadyQueue::default());
        let waker = Waker::from(Arc::new(TaskWaker {
            id: 0,
            ready: ready.clone(),
        }));
        let mut cx = Context::from_waker(&waker);
        let mut future = pin!(future);
        ready.push(0);
        for _ in 0..MAX_STEPS {
            let mut spins = 0;
            while ready.pop().is_some() {
                if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
                    return out;
                }
                spins += 1;
                assert!(spins < MAX_SPINS, "the future keeps waking itself");
            }
            if self.step().is_none() {
                panic!(
                    "stalled at {:?}: the future waits, and nothing is due on the virtual clock",
                    self.now()
                );
            }
        }
        panic!("the virtual clock moved {MAX_STEPS} times and the future is not done");
    }
}
