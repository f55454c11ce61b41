//! `AmqpTag`: what settles one delivery, from a subscription or from a fetch.

use std::sync::Arc;
use std::time::Duration;

use lapin::Acker;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use retry_core::{Settlement, TransportError};

use crate::acks::{Acks, Refusal, within};

/// Settles one delivery: where it came from and its delivery tag there.
///
/// A delivery from a subscription is acknowledged through that subscription's batcher,
/// for the channel incarnation (epoch) it came on; one from a fetch is settled at once
/// through its own acker. After a reconnection, neither settles on the new channel: the
/// broker has already put the delivery back.
#[derive(Clone)]
pub struct AmqpTag {
    settler: Settler,
    delivery_tag: u64,
}

#[derive(Clone)]
enum Settler {
    Batched {
        acks: Arc<Acks>,
        epoch: u64,
    },
    /// Settled at once, each write within the timeout.
    Direct(Acker, Duration),
}

impl AmqpTag {
    pub(crate) fn batched(acks: Arc<Acks>, epoch: u64, delivery_tag: u64) -> Self {
        AmqpTag {
            settler: Settler::Batched { acks, epoch },
            delivery_tag,
        }
    }

    pub(crate) fn fetched(acker: Acker, delivery_tag: u64, timeout: Duration) -> Self {
        AmqpTag {
            settler: Settler::Direct(acker, timeout),
            delivery_tag,
        }
    }

    /// The broker's delivery tag.
    pub fn delivery_tag(&self) -> u64 {
        self.delivery_tag
    }

    /// Settles the delivery: through the batcher, or at once for a fetched one.
    pub(crate) async fn settle(&self, settlement: Settlement) -> Result<(), TransportError> {
        let sent = match &self.settler {
            Settler::Batched { acks, epoch } => match settlement {
                Settlement::Ack => acks.done(*epoch, self.delivery_tag).await,
                Settlement::Requeue => {
                    acks.refuse(*epoch, self.delivery_tag, Refusal::Requeue)
                        .await?
                }
                Settlement::Reject => {
                    acks.refuse(*epoch, self.delivery_tag, Refusal::Reject)
                        .await?
                }
            },
            Settler::Direct(acker, timeout) => match settlement {
                Settlement::Ack => {
                    within(*timeout, "basic.ack", acker.ack(BasicAckOptions::default())).await?
                }
                Settlement::Requeue => {
                    let requeue = BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    };
                    within(*timeout, "basic.nack (requeue)", acker.nack(requeue)).await?
                }
                Settlement::Reject => {
                    let reject = BasicRejectOptions { requeue: false };
                    within(*timeout, "basic.reject", acker.reject(reject)).await?
                }
            },
        };
        if !sent {
            // The delivery belongs to a channel that has since been recovered or closed: the
            // broker has it back and will redeliver it. Never settle it on the new channel.
            return Err(TransportError::connection_lost(format!(
                "delivery {} was on a channel that is gone; the broker has it back",
                self.delivery_tag
            )));
        }
        Ok(())
    }
}

impl std::fmt::Debug for AmqpTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("AmqpTag");
        d.field("delivery_tag", &self.delivery_tag);
        match &self.settler {
            Settler::Batched { epoch, .. } => d.field("epoch", epoch),
            Settler::Direct(..) => d.field("fetched", &true),
        };
        d.finish()
    }
}
