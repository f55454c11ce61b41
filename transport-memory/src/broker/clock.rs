//! Sleeping on the virtual clock.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use retry_core::Timestamp;

use crate::broker::core::Shared;
use crate::broker::timers::TimerKey;

/// A future that completes when the broker's virtual clock reaches its deadline. Dropping it
/// cancels the timer.
#[must_use = "futures do nothing unless polled"]
pub struct Sleep {
    shared: Arc<Shared>,
    deadline: Timestamp,
    timer: Option<TimerKey>,
}

impl fmt::Debug for Sleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sleep")
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl Sleep {
    pub(crate) fn new(shared: Arc<Shared>, deadline: Timestamp) -> Self {
        Sleep {
            shared,
            deadline,
            timer: None,
        }
    }

    /// When it completes.
    pub fn deadline(&self) -> Timestamp {
        self.deadline
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.timer.is_none() && this.shared.now() >= this.deadline {
            return Poll::Ready(());
        }
        let mut state = this.shared.lock();
        if state.now() >= this.deadline {
            if let Some(key) = this.timer.take() {
                state.timers().disarm(&key);
            }
            return Poll::Ready(());
        }
        let timers = state.timers();
        let key = *this.timer.get_or_insert_with(|| timers.key(this.deadline));
        timers.arm(key, cx.waker().clone());
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(key) = self.timer.take() {
            self.shared.lock().timers().disarm(&key);
        }
    }
}
