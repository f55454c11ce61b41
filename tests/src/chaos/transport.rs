//! A transport that writes what the [`Consumer`](retry_core::Consumer) does not report by
//! itself into the chaos journal: every delivery as it arrives (with the broker's
//! redelivered flag and counts), every publish of a clone and the broker's answer, every
//! settlement and its result, and every failed receive, fetch or watch. Each delivery's tag
//! carries its message id and lane, so a settlement names its message.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use retry_core::{
    Capabilities, Delivery, Message, Publish, PublishResult, QueueWalk, Settlement, SoloGate,
    Subscription, Timestamp, TopologyPlan, Transport, TransportError,
};

use super::journal::JournalWriter;

/// The message id of `message`, `?` without one.
pub fn message_id(message: &Message) -> &str {
    message.properties().message_id.as_deref().unwrap_or("?")
}

/// A tag of the inner transport, with the message id and lane it settles.
#[derive(Clone, Debug)]
pub struct JournaledTag<Tag> {
    inner: Tag,
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

/// Wraps a transport, journaling as the module says.
#[derive(Debug)]
pub struct Journaled<T> {
    inner: T,
    journal: Arc<JournalWriter>,
    lanes: Lanes,
}

impl<T: Transport> Journaled<T> {
    /// Wraps `inner`, whose consumer runs `plan`, journaling into `journal`.
    pub fn new(inner: T, plan: &TopologyPlan, journal: Arc<JournalWriter>) -> Self {
        Journaled {
            inner,
            journal,
            lanes: Lanes {
                work: plan.work_queue().to_owned(),
                isolation: plan.isolation_queue().to_owned(),
            },
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

fn wrap<Tag>(
    journal: &JournalWriter,
    lane: &'static str,
    delivery: Delivery<Tag>,
) -> Delivery<JournaledTag<Tag>> {
    let Delivery {
        tag,
        message,
        facts,
    } = delivery;
    let id: Arc<str> = Arc::from(message_id(&message));
    journal.line(
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
    Delivery {
        tag: JournaledTag {
            inner: tag,
            id,
            lane,
        },
        message,
        facts,
    }
}

/// A subscription of a [`Journaled`] transport.
#[derive(Debug)]
pub struct JournaledSubscription<S> {
    inner: S,
    journal: Arc<JournalWriter>,
    lane: &'static str,
}

#[async_trait]
impl<S: Subscription> Subscription for JournaledSubscription<S> {
    type Tag = JournaledTag<S::Tag>;

    async fn recv(&self) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        match self.inner.recv().await {
            Ok(Some(d)) => Ok(Some(wrap(&self.journal, self.lane, d))),
            Ok(None) => {
                self.journal
                    .line("recv-end", "-", format_args!("lane={}", self.lane));
                Ok(None)
            }
            Err(e) => {
                self.journal.line(
                    "recv-err",
                    "-",
                    format_args!("lane={} err={}", self.lane, chain(&e)),
                );
                Err(e)
            }
        }
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.inner.cancel().await
    }

    async fn flush(&self) -> Result<(), TransportError> {
        let result = self.inner.flush().await;
        if let Err(e) = &result {
            self.journal
                .line("flush-err", "-", format_args!("err={}", chain(e)));
        }
        result
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

#[async_trait]
impl<T: Transport> Transport for Journaled<T> {
    type Tag = JournaledTag<T::Tag>;
    type Subscription = JournaledSubscription<T::Subscription>;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.provision(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.verify(plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError> {
        let lane = self.lanes.of(queue);
        match self.inner.consume(queue, prefetch).await {
            Ok(inner) => {
                self.journal
                    .line("consume", "-", format_args!("lane={lane} result=ok"));
                Ok(JournaledSubscription {
                    inner,
                    journal: Arc::clone(&self.journal),
                    lane,
                })
            }
            Err(e) => {
                self.journal.line(
                    "consume",
                    "-",
                    format_args!("lane={lane} err={}", chain(&e)),
                );
                Err(e)
            }
        }
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        let lane = self.lanes.of(queue);
        match self.inner.fetch(queue).await {
            Ok(None) => {
                self.journal
                    .line("fetch-none", "-", format_args!("lane={lane}"));
                Ok(None)
            }
            Ok(got) => Ok(got.map(|d| wrap(&self.journal, lane, d))),
            Err(e) => {
                self.journal.line(
                    "fetch-err",
                    "-",
                    format_args!("lane={lane} err={}", chain(&e)),
                );
                Err(e)
            }
        }
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        let result = self.inner.ready(queue, poll).await;
        if let Err(e) = &result {
            self.journal.line(
                "ready-err",
                "-",
                format_args!("lane={} err={}", self.lanes.of(queue), chain(e)),
            );
        }
        result
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
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
        let result = self.inner.publish(original, publish).await;
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

    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError> {
        let how = settlement_word(settlement);
        self.journal.line(
            "settle",
            &tag.id,
            format_args!("lane={} how={how}", tag.lane),
        );
        let result = self.inner.settle(&tag.inner, settlement).await;
        match &result {
            Ok(()) => self
                .journal
                .line("settled", &tag.id, format_args!("how={how} result=ok")),
            Err(e) => self.journal.line(
                "settled",
                &tag.id,
                format_args!("how={how} result=err err={}", chain(e)),
            ),
        }
        result
    }

    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<Self::Tag> + 'a>, TransportError> {
        Ok(Box::new(JournaledWalk {
            inner: self.inner.walk(queue).await?,
            journal: &self.journal,
            lane: self.lanes.of(queue),
        }))
    }

    fn now(&self) -> Timestamp {
        self.inner.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.inner.sleep(duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        self.inner.solo_gate()
    }
}

/// A walk of a [`Journaled`] transport: deliveries and acks are journaled.
struct JournaledWalk<'a, Tag> {
    inner: Box<dyn QueueWalk<Tag> + 'a>,
    journal: &'a JournalWriter,
    lane: &'static str,
}

#[async_trait]
impl<Tag: Send + 'static> QueueWalk<JournaledTag<Tag>> for JournaledWalk<'_, Tag> {
    async fn next(&mut self) -> Result<Option<Delivery<JournaledTag<Tag>>>, TransportError> {
        Ok(self
            .inner
            .next()
            .await?
            .map(|d| wrap(self.journal, self.lane, d)))
    }

    fn leave(&mut self, tag: JournaledTag<Tag>) {
        self.inner.leave(tag.inner);
    }

    async fn ack(&mut self, tag: JournaledTag<Tag>) -> Result<(), TransportError> {
        let result = self.inner.ack(tag.inner).await;
        self.journal.line(
            "settled",
            &tag.id,
            format_args!(
                "how=walk-ack result={}",
                if result.is_ok() { "ok" } else { "err" }
            ),
        );
        result
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        self.inner.end().await
    }
}
