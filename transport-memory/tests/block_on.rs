//! `Broker::block_on`: one future run to completion on the virtual clock.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use transport_memory::Broker;

#[test]
fn time_moves_only_as_far_as_the_future_waits() {
    let broker = Broker::new();
    let start = broker.now();
    assert_eq!(broker.block_on(async { 7 }), 7);
    assert_eq!(broker.now(), start, "nothing waited, no time passed");
    let out = broker.block_on(async {
        let (short, long) = (
            broker.sleep(Duration::from_secs(5)),
            broker.sleep(Duration::from_secs(90)),
        );
        futures::future::join(short, long).await;
        broker.now()
    });
    assert_eq!(out, start + Duration::from_secs(90));
    assert_eq!(broker.now(), start + Duration::from_secs(90));
}

#[test]
#[should_panic(expected = "the future waits, and nothing is due on the virtual clock")]
fn a_future_waiting_on_nothing_is_a_stall() {
    Broker::new().block_on(std::future::pending::<()>());
}

/// Wakes itself on every poll and never finishes.
struct Spin;

impl Future for Spin {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[test]
#[should_panic(expected = "the future keeps waking itself")]
fn a_future_that_keeps_waking_itself_is_stopped() {
    Broker::new().block_on(Spin);
}
