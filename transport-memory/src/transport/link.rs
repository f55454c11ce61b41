//! Which connection a transport uses now, and the subscriptions to redo on a new one when
//! the transport recovers from a closed connection.

use std::sync::{Arc, Mutex, MutexGuard};

use retry_core::TransportError;

use crate::broker::core::State;
use crate::broker::trace::EventKind;

/// A view of which connection a transport is using, kept by whoever watches it from outside
/// (the simulation, to crash or disconnect the consumer that owns the transport).
#[derive(Clone, Debug)]
pub(crate) struct LinkHandle(Arc<Mutex<Link>>);

impl LinkHandle {
    pub(crate) fn new(link: &Arc<Mutex<Link>>) -> Self {
        LinkHandle(link.clone())
    }

    pub(crate) fn connection(&self) -> usize {
        lock_link(&self.0).id
    }
}

/// The connection currently in use, and the subscriptions to redo on a new one.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) id: usize,
    pub(crate) subscriptions: Vec<SubscriptionState>,
    pub(crate) recover: bool,
}

/// One subscription of a transport, as it was asked for and where it consumes now.
#[derive(Debug)]
pub(crate) struct SubscriptionState {
    pub(crate) queue: String,
    pub(crate) prefetch: u16,
    /// The connection and consumer index it consumes on now.
    pub(crate) connection: usize,
    pub(crate) consumer: usize,
    pub(crate) cancelled: bool,
    /// Whether the close of its connection was reported by a `recv` yet.
    pub(crate) close_reported: bool,
}

impl Link {
    pub(crate) fn new(id: usize) -> Self {
        Link {
            id,
            subscriptions: Vec::new(),
            recover: true,
        }
    }

    /// Reopens a closed connection and consumes again, as automatic recovery does.
    pub(crate) fn recover(&mut self, s: &mut State) -> Result<(), TransportError> {
        let old = self.id;
        self.id = s.open_connection();
        let description = Arc::from(format!("conn {old} recovered as conn {}", self.id));
        s.record(|| EventKind::Fault { description });
        for sub in self.subscriptions.iter_mut().filter(|sub| !sub.cancelled) {
            sub.consumer = s.consume(self.id, &sub.queue, sub.prefetch)?;
            sub.connection = self.id;
            sub.close_reported = false;
        }
        Ok(())
    }
}

pub(crate) fn lock_link(link: &Mutex<Link>) -> MutexGuard<'_, Link> {
    link.lock().unwrap_or_else(|e| e.into_inner())
}
