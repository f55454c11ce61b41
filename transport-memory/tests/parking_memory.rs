//! A parking queue of 100,000 messages replayed by filter holds one message at a time.
//!
//! The transport under the lot copies each message it hands out (the broker model would
//! otherwise share it with its own store) and counts the deliveries in the lot's hands. The
//! process's heap is sampled after every message, beside a baseline in the same run: a
//! bare walk that reads every message and leaves it, which costs what the broker model
//! spends on holding 100,000 unacknowledged deliveries. A lot that kept the messages it read
//! would hold one 4 KiB copy of each on top. The counting allocator sees every thread of the
//! process, so this test runs without the libtest harness.

use std::alloc::System;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use retry_core::headers;
use retry_core::{
    Capabilities, DeadLetterReason, Delivery, Message, ParkedFilter, ParkedReason, ParkingLot,
    ParkingReport, Publish, PublishResult, QueueWalk, ReplayOptions, RetryPolicy, Settlement,
    TopologyPlan, Transport, TransportError,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use transport_memory::{Broker, DeliveryTag, MemorySubscription, MemoryTransport, Outgoing};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const MESSAGES: usize = 100_000;
const BODY: usize = 4096;

fn main() {
    a_replay_by_filter_holds_one_message_at_a_time();
    println!("a_replay_by_filter_holds_one_message_at_a_time ... ok");
}

/// Bytes on the heap now.
fn heap() -> isize {
    let s = INSTRUMENTED_SYSTEM.stats();
    s.bytes_allocated as isize - s.bytes_deallocated as isize + s.bytes_reallocated
}

/// Deliveries handed to the lot and not yet left or acknowledged, and the most at once.
#[derive(Default)]
struct InHand {
    now: AtomicUsize,
    peak: AtomicUsize,
}

/// The memory transport, with walks that copy and count what they hand out.
struct Counting {
    inner: MemoryTransport,
    in_hand: Arc<InHand>,
}

struct CountingWalk<'a> {
    inner: Box<dyn QueueWalk<DeliveryTag> + 'a>,
    in_hand: Arc<InHand>,
}

#[async_trait]
impl QueueWalk<DeliveryTag> for CountingWalk<'_> {
    async fn next(&mut self) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        let Some(mut delivery) = self.inner.next().await? else {
            return Ok(None);
        };
        // A copy of its own, which only the lot can keep alive.
        delivery.message = Message::new(delivery.message.parts().clone());
        let now = self.in_hand.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.in_hand.peak.fetch_max(now, Ordering::SeqCst);
        Ok(Some(delivery))
    }

    fn leave(&mut self, tag: DeliveryTag) {
        self.in_hand.now.fetch_sub(1, Ordering::SeqCst);
        self.inner.leave(tag);
    }

    async fn ack(&mut self, tag: DeliveryTag) -> Result<(), TransportError> {
        self.in_hand.now.fetch_sub(1, Ordering::SeqCst);
        self.inner.ack(tag).await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        self.inner.end().await
    }
}

#[async_trait]
impl Transport for Counting {
    type Tag = DeliveryTag;
    type Subscription = MemorySubscription;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.provision(plan).await
    }
    async fn consume(&self, q: &str, prefetch: u16) -> Result<MemorySubscription, TransportError> {
        self.inner.consume(q, prefetch).await
    }
    async fn fetch(&self, q: &str) -> Result<Option<Delivery<DeliveryTag>>, TransportError> {
        self.inner.fetch(q).await
    }
    async fn ready(&self, q: &str, poll: Duration) -> Result<(), TransportError> {
        self.inner.ready(q, poll).await
    }
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        self.inner.publish(original, publish).await
    }
    async fn settle(&self, tag: &DeliveryTag, s: Settlement) -> Result<(), TransportError> {
        self.inner.settle(tag, s).await
    }
    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<DeliveryTag> + 'a>, TransportError> {
        Ok(Box::new(CountingWalk {
            inner: self.inner.walk(queue).await?,
            in_hand: Arc::clone(&self.in_hand),
        }))
    }
}

fn a_replay_by_filter_holds_one_message_at_a_time() {
    // Without the event trace, which records every delivery and requeue by design.
    let broker = Broker::builder().with_trace(false).build();
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .unwrap();
    let plan = TopologyPlan::new("big", &policy).unwrap();
    broker.provision(&plan).unwrap();
    // One in ten was parked for a bug since fixed.
    for i in 0..MESSAGES {
        let reason = if i % 10 == 0 {
            "permanent"
        } else {
            "attempts-exhausted"
        };
        broker
            .publish(
                Outgoing::to_queue(plan.parking_queue(), vec![b'x'; BODY])
                    .with_message_id(format!("m{i:06}"))
                    .with_header(headers::REASON, reason)
                    .with_header(headers::ATTEMPTS, 3i64),
            )
            .unwrap();
    }
    let in_hand = Arc::new(InHand::default());
    let transport = Counting {
        inner: broker.connect(),
        in_hand: Arc::clone(&in_hand),
    };

    // The baseline: a walk that reads every message and leaves it.
    let before = heap();
    let bare = broker.block_on(async {
        let mut walk = transport.walk(plan.parking_queue()).await.unwrap();
        let mut peak = 0isize;
        while let Some(delivery) = walk.next().await.unwrap() {
            walk.leave(delivery.tag);
            peak = peak.max(heap() - before);
        }
        walk.end().await.unwrap();
        peak
    });

    let lot = ParkingLot::new(transport, &plan);
    let filter = ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::Permanent));
    let mut peak = 0isize;
    let report = broker
        .block_on(
            lot.replay(&filter, ReplayOptions::default(), |_: &ParkingReport| {
                peak = peak.max(heap() - before);
            }),
        )
        .unwrap();
    // What stays: the 10,000 copies in the work queue.
    let copies = heap() - before;

    assert_eq!(
        (report.seen, report.replayed, report.left),
        (
            MESSAGES as u64,
            MESSAGES as u64 / 10,
            MESSAGES as u64 * 9 / 10
        ),
        "{report:?}"
    );
    assert_eq!(
        in_hand.peak.load(Ordering::SeqCst),
        1,
        "messages in hand at once"
    );
    assert_eq!(in_hand.now.load(Ordering::SeqCst), 0);
    let stats = broker.stats(plan.parking_queue()).unwrap();
    assert_eq!((stats.ready, stats.unacked), (90_000, 0));
    assert_eq!(broker.stats(plan.work_queue()).unwrap().ready, 10_000);

    let bodies = (MESSAGES * BODY) as isize;
    println!(
        "heap over the run: bare walk peak +{:.1} MB; replay peak +{:.1} MB, of which {:.1} MB \
         are the copies left in the work queue; the parked bodies are {:.1} MB",
        bare as f64 / 1e6,
        peak as f64 / 1e6,
        copies as f64 / 1e6,
        bodies as f64 / 1e6
    );
    // The copies: 10,000 bodies and their bookkeeping, no more.
    let replayed = (MESSAGES / 10 * (BODY + 1024)) as isize;
    assert!(copies < replayed, "+{copies} bytes left behind");
    // Holding the 90,000 messages left would add 369 MB of bodies.
    let slack = 4 << 20;
    assert!(
        peak <= bare + copies + slack,
        "replay peak +{peak} bytes, bare walk +{bare}, copies +{copies}"
    );
}
