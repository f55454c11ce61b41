//! Publisher confirms as a client library hands them over, for the fault that reports a
//! return against the wrong publish.
//!
//! A real client gets a broker's answers as frames: a `basic.return` before the ack of an
//! unroutable publish, and acks that may cover several publishes at once. lapin 4.12 then
//! completes the confirms of one ack in any order and hands each waiting return to
//! whichever confirm completes first. With
//! [`FaultRates::misattribute_returns`](crate::FaultRates::misattribute_returns) on, this
//! connection's publishes are answered that way: the publishes of one executor round form
//! a batch, acked together, and a misattributed batch hands its returns to the first
//! confirms it completes, in a seeded order. The transport then pairs each return with its
//! publish by the stamp it carries ([`retry_core::ReturnMatcher`]), as the AMQP 0-9-1
//! transport does.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use retry_core::{Answer, Confirm, PublishResult, ReturnMatcher, TransportError, splitmix64};

/// One publish's raw answer from the broker, before the client hands it over.
#[derive(Debug)]
struct Raw {
    stamp: u64,
    answer: Answer,
    /// Whether the broker returned it as unroutable.
    returned: bool,
}

/// The confirms of one connection: the batch of this executor round, and the matcher that
/// pairs returns with publishes.
#[derive(Debug, Default)]
pub(crate) struct Confirms {
    matcher: ReturnMatcher,
    batch: Vec<Raw>,
    verdicts: HashMap<u64, Confirm>,
    wakers: HashMap<u64, Waker>,
}

/// A connection's confirms, shared by its publishes.
pub(crate) type SharedConfirms = Arc<Mutex<Confirms>>;

pub(crate) fn lock(c: &SharedConfirms) -> MutexGuard<'_, Confirms> {
    c.lock().unwrap_or_else(|e| e.into_inner())
}

impl Confirms {
    /// Registers a publish about to be sent; its stamp goes into its headers.
    pub(crate) fn register(&mut self) -> u64 {
        self.matcher.register()
    }

    /// The broker's answer to publish `stamp`, to be handed over with its batch.
    pub(crate) fn answered(&mut self, stamp: u64, result: &PublishResult) {
        let (answer, returned) = match result {
            PublishResult::Confirmed => (Answer::Ack, false),
            PublishResult::Refused => (Answer::Nack, false),
            // RabbitMQ acks an unroutable publish after returning it.
            PublishResult::Returned => (Answer::Ack, true),
            PublishResult::Failed(_) => (Answer::Failed, false),
        };
        self.batch.push(Raw {
            stamp,
            answer,
            returned,
        });
    }

    /// Hands over the batch, as one `multiple` ack: in publish order, or, with `shuffle`,
    /// in that seeded order with each return going to the first confirm completed. Returns
    /// how many returns went to another publish's confirm.
    pub(crate) fn hand_over(&mut self, shuffle: Option<u64>) -> usize {
        let mut batch = std::mem::take(&mut self.batch);
        let Some(seed) = shuffle else {
            for raw in batch {
                let own = raw.returned.then_some(Some(raw.stamp));
                self.matcher.answer(raw.stamp, raw.answer, own);
            }
            self.collect();
            return 0;
        };
        let mut waiting: VecDeque<u64> = batch
            .iter()
            .filter(|r| r.returned)
            .map(|r| r.stamp)
            .collect();
        batch.sort_by_key(|r| splitmix64(seed ^ r.stamp));
        let mut misattributed = 0;
        for raw in batch {
            let carried = waiting.pop_front();
            misattributed += usize::from(carried.is_some_and(|c| c != raw.stamp));
            self.matcher
                .answer(raw.stamp, raw.answer, carried.map(Some));
        }
        self.collect();
        misattributed
    }

    /// Whether a batch is waiting to be handed over.
    pub(crate) fn pending(&self) -> bool {
        !self.batch.is_empty()
    }

    fn collect(&mut self) {
        while let Some((stamp, confirm)) = self.matcher.poll_verdict() {
            self.verdicts.insert(stamp, confirm);
            if let Some(w) = self.wakers.remove(&stamp) {
                w.wake();
            }
        }
    }

    /// The verdict on publish `stamp`, once given.
    pub(crate) fn poll_verdict(&mut self, stamp: u64, cx: &mut Context<'_>) -> Poll<Confirm> {
        match self.verdicts.remove(&stamp) {
            Some(c) => Poll::Ready(c),
            None => {
                self.wakers.insert(stamp, cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// The [`PublishResult`] of a verdict.
pub(crate) fn result_of(confirm: Confirm) -> PublishResult {
    match confirm {
        Confirm::Ack => PublishResult::Confirmed,
        Confirm::Nack => PublishResult::Refused,
        Confirm::Returned => PublishResult::Returned,
        Confirm::Failed => PublishResult::Failed(TransportError::Timeout {
            operation: "publisher confirm",
            after: std::time::Duration::ZERO,
        }),
    }
}

/// Yields once to the executor, so that publishes made in the same round join the batch.
pub(crate) struct YieldOnce(bool);

impl YieldOnce {
    pub(crate) fn new() -> Self {
        YieldOnce(false)
    }
}

impl Future for YieldOnce {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            return Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
