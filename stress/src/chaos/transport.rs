//! A transport decorator that writes what the [`Consumer`](retry_core::Consumer) does not
//! report by itself into the chaos journal: every delivery as it arrives (with the broker's
//! redelivered flag and counts), every publish of a clone and the broker's answer, every
//! settlement and its result, and every failed receive, fetch or watch. Each delivery's tag
//! carries its message id and lane (a [`DeliveryNote`]), so a settlement names its message.
//! Everything else is forwarded by `transport_kit::forward`.

use std::sync::Arc;
use std::time::Duration;

use retry_core::{
    Delivery, Message, Publish, PublishResult, QueueWalk, Settlement, Subscription, TopologyPlan,
    Transport, TransportError,
};
use transport_kit::forward::{Decorate, Decorated};

use super::journal::JournalWriter;

/// The message id of `message`, `?` without one.
pub fn message_id(message: &Message) -> &str {
    message.properties().message_id.as_deref().unwrap_or("?")
}

/// What a [`Journaled`] transport notes about each delivery, carried by its tag until it is
/// settled: the message id and the lane it came from.
#[derive(Clone, Debug, Default)]
pub struct DeliveryNote {
    id: Arc<str>,
    lane: &'static str,
}

/// Which queues are which, to name each delivery's lane.
#[derive(Clone, Debug)]
struct Lanes {
    work: String,
    isolation: String,
}

impl Lanes {
    fn of(&self, queue: &str) -> &'static str {
        if queue == self.work {
            "work"
        } else if queue == self.isolation {
            "isolation"
        } else {
            "other"
        }
    }
}

/// The journaling decorator, as the module says.
#[derive(Debug)]
pub struct Journaled {
    journal: Arc<JournalWriter>,
    lanes: Lanes,
}

impl Journaled {
    /// `inner`, whose consumer runs `plan`, journaling into `journal`;
    /// [`Decorated::inner`] is `inner` again.
    pub fn new<T: Transport>(
        inner: T,
        plan: &TopologyPlan,
        journal: Arc<JournalWriter>,
    ) -> Decorated<T, Journaled> {
        let lanes = Lanes {
            work: plan.work_queue().to_owned(),
            isolation: plan.isolation_queue().to_owned(),
        };
        Decorated::new(inner, Journaled { journal, lanes })
    }
}

/// An error and its sources, on one line.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

fn settlement_word(s: Settlement) -> &'static str {
    match s {
        Settlement::Ack => "ack",
        Settlement::Requeue => "requeue",
        Settlement::Reject => "reject",
    }
}

impl<T: Transport> Decorate<T> for Journaled {
    type Mark = DeliveryNote;

    fn delivered(&self, queue: &str, delivery: &Delivery<T::Tag>) -> DeliveryNote {
        let (lane, facts) = (self.lanes.of(queue), &delivery.facts);
        let id: Arc<str> = Arc::from(message_id(&delivery.message));
        self.journal.line(
            "recv",
            &id,
            format_args!(
                "lane={lane} redelivered={} dc={} xdc={} attempts={} crashes={} evidence={}",
                facts.redelivered,
                facts.delivery_count,
                facts.x_delivery_count,
                facts.attempts,
                facts.crashes,
                facts.crash_evidence(),
            ),
        );
        DeliveryNote { id, lane }
    }

    async fn consume(
        &self,
        inner: &T,
        queue: &str,
        prefetch: u16,
    ) -> Result<T::Subscription, TransportError> {
        let lane = self.lanes.of(queue);
        let result = inner.consume(queue, prefetch).await;
        match &result {
            Ok(_) => self
                .journal
                .line("consume", "-", format_args!("lane={lane} result=ok")),
            Err(e) => {
                self.journal
                    .line("consume", "-", format_args!("lane={lane} err={}", chain(e)))
            }
        }
        result
    }

    async fn fetch(
        &self,
        inner: &T,
        queue: &str,
    ) -> Result<Option<Delivery<T::Tag>>, TransportError> {
        let lane = self.lanes.of(queue);
        let result = inner.fetch(queue).await;
        match &result {
            Ok(Some(_)) => {}
            Ok(None) => self
                .journal
                .line("fetch-none", "-", format_args!("lane={lane}")),
            Err(e) => self.journal.line(
                "fetch-err",
                "-",
                format_args!("lane={lane} err={}", chain(e)),
            ),
        }
        result
    }

    async fn ready(&self, inner: &T, queue: &str, poll: Duration) -> Result<(), TransportError> {
        let result = inner.ready(queue, poll).await;
        if let Err(e) = &result {
            self.journal.line(
                "ready-err",
                "-",
                format_args!("lane={} err={}", self.lanes.of(queue), chain(e)),
            );
        }
        result
    }

    async fn publish(&self, inner: &T, original: &Message, publish: &Publish) -> PublishResult {
        let id = message_id(original);
        let to = &publish.route.routing_key;
        let h = &publish.headers;
        self.journal.line(
            "publish",
            id,
            format_args!(
                "to={to} attempts={} crashes={} reason={}",
                h.attempts,
                h.crashes,
                h.reason.map_or("-", |r| r.as_str()),
            ),
        );
        let result = inner.publish(original, publish).await;
        match &result {
            PublishResult::Confirmed => {
                self.journal
                    .line("published", id, format_args!("to={to} result=confirmed"))
            }
            PublishResult::Refused => {
                self.journal
                    .line("published", id, format_args!("to={to} result=refused"))
            }
            PublishResult::Returned => {
                self.journal
                    .line("published", id, format_args!("to={to} result=returned"))
            }
            PublishResult::Failed(e) => self.journal.line(
                "published",
                id,
                format_args!("to={to} result=failed err={}", chain(e)),
            ),
        }
        result
    }

    async fn settle(
        &self,
        inner: &T,
        tag: &T::Tag,
        note: &DeliveryNote,
        settlement: Settlement,
    ) -> Result<(), TransportError> {
        let how = settlement_word(settlement);
        self.journal.line(
            "settle",
            &note.id,
            format_args!("lane={} how={how}", note.lane),
        );
        let result = inner.settle(tag, settlement).await;
        match &result {
            Ok(()) => self
                .journal
                .line("settled", &note.id, format_args!("how={how} result=ok")),
            Err(e) => self.journal.line(
                "settled",
                &note.id,
                format_args!("how={how} result=err err={}", chain(e)),
            ),
        }
        result
    }

    async fn recv(
        &self,
        queue: &str,
        subscription: &T::Subscription,
    ) -> Result<Option<Delivery<T::Tag>>, TransportError> {
        let lane = self.lanes.of(queue);
        let result = subscription.recv().await;
        match &result {
            Ok(Some(_)) => {}
            Ok(None) => self
                .journal
                .line("recv-end", "-", format_args!("lane={lane}")),
            Err(e) => self.journal.line(
                "recv-err",
                "-",
                format_args!("lane={lane} err={}", chain(e)),
            ),
        }
        result
    }

    async fn flush(
        &self,
        _queue: &str,
        subscription: &T::Subscription,
    ) -> Result<(), TransportError> {
        let result = subscription.flush().await;
        if let Err(e) = &result {
            self.journal
                .line("flush-err", "-", format_args!("err={}", chain(e)));
        }
        result
    }

    async fn walk_ack(
        &self,
        _queue: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
        tag: T::Tag,
        note: DeliveryNote,
    ) -> Result<(), TransportError> {
        let result = walk.ack(tag).await;
        self.journal.line(
            "settled",
            &note.id,
            format_args!(
                "how=walk-ack result={}",
                if result.is_ok() { "ok" } else { "err" }
            ),
        );
        result
    }
}
