//! `Shared`: what an [`Amqp10Transport`](crate::Amqp10Transport) and its subscriptions share.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::mpsc;

use crate::config::{Amqp10Config, Nodes};
use crate::publisher::Publisher;
use crate::receiver::{Ahead, Command};

/// What the transport and its subscriptions share.
pub(crate) struct Shared {
    pub(crate) config: Amqp10Config,
    pub(crate) nodes: Nodes,
    pub(crate) publisher: Publisher,
    /// Every link task started by a subscription, weakly: a subscription dropped without
    /// cancelling still ends its link at `close`.
    pub(crate) links: std::sync::Mutex<Vec<mpsc::WeakSender<Command>>>,
    /// The fetch link of each queue fetched from.
    pub(crate) fetchers: std::sync::Mutex<HashMap<String, mpsc::Sender<Command>>>,
    pub(crate) closed: AtomicBool,
    /// Consuming links opened ahead, by queue, for the next [`consume`] of that queue, each
    /// with a number that tells it from a later one of the same queue.
    ///
    /// [`consume`]: retry_core::Transport::consume
    pub(crate) ahead: std::sync::Mutex<HashMap<String, (u64, Ahead)>>,
    /// The number of the next link opened ahead.
    pub(crate) aheads: AtomicU64,
}

impl Shared {
    /// Keeps a weak handle on a new link task, for `close`; `false` once the transport is
    /// closed (checked under the lock `close` drains, so no link slips past it).
    #[must_use]
    pub(crate) fn register(&self, link: &mpsc::Sender<Command>) -> bool {
        let Ok(mut links) = self.links.lock() else {
            return false;
        };
        if self.is_closed() {
            return false;
        }
        links.retain(|l| l.strong_count() > 0);
        links.push(link.downgrade());
        true
    }

    /// Opens a consuming link on `queue` ahead of its [`consume`], unless one is open
    /// already. One not taken within the operation timeout is dropped, which closes its
    /// connection: a transport that verified a plan and then consumes nothing does not keep
    /// a consumer on the queue.
    ///
    /// [`consume`]: retry_core::Transport::consume
    pub(crate) fn open_ahead(self: &Arc<Self>, queue: &str) {
        let Ok(mut ahead) = self.ahead.lock() else {
            return;
        };
        if self.is_closed() || ahead.contains_key(queue) {
            return;
        }
        let number = self.aheads.fetch_add(1, Ordering::Relaxed);
        let link = crate::receiver::open_ahead(&self.nodes, &self.config, queue);
        ahead.insert(queue.to_owned(), (number, link));
        let shared = Arc::downgrade(self);
        let (queue, keep) = (queue.to_owned(), self.config.operation_timeout());
        tokio::spawn(async move {
            tokio::time::sleep(keep).await;
            let Some(shared) = shared.upgrade() else {
                return;
            };
            if let Ok(mut ahead) = shared.ahead.lock()
                && ahead.get(&queue).is_some_and(|(n, _)| *n == number)
            {
                ahead.remove(&queue);
            }
        });
    }

    /// The consuming link opened ahead for `queue`, if there is one.
    pub(crate) fn take_ahead(&self, queue: &str) -> Option<Ahead> {
        self.ahead.lock().ok()?.remove(queue).map(|(_, link)| link)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}
