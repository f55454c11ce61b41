//! The broker's queues: the table of them by name, the order messages enter them in, and
//! which ones need a look.

use std::collections::VecDeque;
use std::sync::Arc;

use retry_core::Timestamp;

use crate::broker::error::BrokerError;
use crate::broker::hash::FastMap;
use crate::broker::queue::{Queue, QueueOptions};

/// Index of a queue in the broker's table.
pub(crate) type QueueIndex = usize;

/// Every declared queue, by index and by name.
#[derive(Debug, Default)]
pub(crate) struct Queues {
    queues: Vec<Queue>,
    index: FastMap<Arc<str>, QueueIndex>,
    /// The position the next message entering a queue takes.
    next_seq: u64,
    /// Queues whose head may be deliverable or expired.
    dirty: VecDeque<QueueIndex>,
}

impl Queues {
    /// Declares a queue; `Ok(true)` when it is new, `Ok(false)` when it exists with the same
    /// arguments.
    pub(crate) fn declare(
        &mut self,
        name: &str,
        options: QueueOptions,
    ) -> Result<bool, BrokerError> {
        if name.is_empty() {
            return Err(BrokerError::InvalidArgument {
                argument: "queue".to_owned(),
                reason: "server-named queues are not modelled; give the queue a name".to_owned(),
            });
        }
        if let Some(&i) = self.index.get(name) {
            if let Some((argument, existing, wanted)) =
                self.queues[i].options().difference(&options)
            {
                return Err(BrokerError::Inequivalent {
                    object: format!("queue '{name}'"),
                    argument,
                    existing,
                    wanted,
                });
            }
            return Ok(false);
        }
        if name.starts_with("amq.") {
            return Err(BrokerError::AccessRefused(format!(
                "queue name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        let name: Arc<str> = Arc::from(name);
        self.index.insert(name.clone(), self.queues.len());
        self.queues.push(Queue::new(name, options));
        Ok(true)
    }

    /// The queue named `name`, if there is one.
    pub(crate) fn find(&self, name: &str) -> Option<QueueIndex> {
        self.index.get(name).copied()
    }

    /// The queue named `name`; a missing one is RabbitMQ's `NOT_FOUND`.
    pub(crate) fn index_of(&self, name: &str) -> Result<QueueIndex, BrokerError> {
        self.find(name)
            .ok_or_else(|| BrokerError::QueueNotFound(name.to_owned()))
    }

    pub(crate) fn get(&self, q: QueueIndex) -> &Queue {
        &self.queues[q]
    }

    pub(crate) fn get_mut(&mut self, q: QueueIndex) -> &mut Queue {
        &mut self.queues[q]
    }

    pub(crate) fn len(&self) -> usize {
        self.queues.len()
    }

    /// The queues in declaration order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Queue> {
        self.queues.iter()
    }

    /// The position of a message entering a queue now.
    pub(crate) fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Removes a consumer from every queue it consumes.
    pub(crate) fn remove_consumer(&mut self, conn: usize, consumer: usize) {
        for queue in &mut self.queues {
            queue.remove_consumer(conn, consumer);
        }
    }

    /// The earliest time a queue head expires.
    pub(crate) fn next_expiry(&self) -> Option<Timestamp> {
        self.queues.iter().filter_map(Queue::head_expiry).min()
    }

    /// Queue `q` needs a look: its head may be deliverable or expired.
    pub(crate) fn mark(&mut self, q: QueueIndex) {
        self.dirty.push_back(q);
    }

    /// Marks every queue whose head has expired by `now`.
    pub(crate) fn mark_expired(&mut self, now: Timestamp) {
        for q in 0..self.queues.len() {
            if self.queues[q].head_expiry().is_some_and(|e| e <= now) {
                self.dirty.push_back(q);
            }
        }
    }

    /// The next queue that needs a look.
    pub(crate) fn next_marked(&mut self) -> Option<QueueIndex> {
        self.dirty.pop_front()
    }
}
