//! A single-threaded executor with a FIFO ready queue: tasks run in the order they were
//! woken, so the same script always interleaves the same way.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

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
