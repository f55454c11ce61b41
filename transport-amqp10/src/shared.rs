//! `Shared`: what an [`Amqp10Transport`](crate::Amqp10Transport) and its subscriptions share.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc;

use crate::config::{Amqp10Config, Nodes};
use crate::publisher::Publisher;
use crate::receiver::Command;

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

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }
}
