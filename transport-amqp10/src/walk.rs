//! `LinkWalk`: the AMQP 1.0 transport's walk of a queue, on a fetch link of its own.

use async_trait::async_trait;
use retry_core::{Delivery, QueueWalk, Settlement, TransportError};
use tokio::sync::mpsc;

use crate::config::{Amqp10Config, Nodes};
use crate::fetch::{self, Purpose};
use crate::receiver::{self, Amqp10Tag, Command};

/// A walk of one queue with a fetch link task of its own, on its own connection.
///
/// A delivery left stays unsettled on the link; the walk keeps nothing of it. Ending the
/// walk closes the link's connection, and the broker puts back everything it still held, at
/// once. Dropping the walk drops the task's last sender, which closes it the same way.
pub(crate) struct LinkWalk {
    link: Option<mpsc::Sender<Command>>,
    config: Amqp10Config,
}

impl LinkWalk {
    /// A walk of `queue`; nothing is opened until the first read.
    pub(crate) fn open(nodes: &Nodes, config: &Amqp10Config, queue: &str) -> Self {
        LinkWalk {
            link: Some(fetch::spawn(nodes, config, queue, Purpose::Walk)),
            config: config.clone(),
        }
    }
}

#[async_trait]
impl QueueWalk<Amqp10Tag> for LinkWalk {
    async fn next(&mut self) -> Result<Option<Delivery<Amqp10Tag>>, TransportError> {
        let Some(link) = &self.link else {
            return Err(TransportError::Closed);
        };
        fetch::ask(link, &self.config).await
    }

    fn leave(&mut self, tag: Amqp10Tag) {
        // Unsettled on the link until it closes.
        drop(tag);
    }

    async fn ack(&mut self, tag: Amqp10Tag) -> Result<(), TransportError> {
        receiver::settle(&tag, Settlement::Ack, self.config.operation_timeout()).await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        if let Some(link) = self.link.take() {
            fetch::close(&link, fetch::answer_within(&self.config)).await;
        }
        Ok(())
    }
}
