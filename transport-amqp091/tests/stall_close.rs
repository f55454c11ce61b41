//! A broker that closes the connection and resets the socket before the client's `close-ok`
//! goes out, as a RabbitMQ node does when it shuts down: lapin's own recovery stalls on the
//! `close-ok` it cannot send, and the transport must notice and open a new connection.
//!
//! A proxy on loopback stands between the transport and the broker and, on demand, sends the
//! client a `connection.close` (320, `CONNECTION_FORCED`) and resets its socket at once.
//! lapin keeps the IO thread of each stalled recovery (a known limitation, `docs/limitations.md`), so this
//! test has a binary of its own: the thread counts of `stall.rs` stay exact.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use retry_core::{Subscription, Transport};
use test_brokers::{LogRecorder, print_uncaptured};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// `connection.close` with reply code 320, as a method frame on channel 0.
fn connection_close() -> Vec<u8> {
    let text = b"CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'";
    let mut payload = vec![0, 10, 0, 50];
    payload.extend(320u16.to_be_bytes());
    payload.push(text.len() as u8);
    payload.extend(text);
    payload.extend([0, 0, 0, 0]);
    let mut frame = vec![1, 0, 0];
    frame.extend((payload.len() as u32).to_be_bytes());
    frame.extend(payload);
    frame.push(0xCE);
    frame
}

/// Forwards every connection to `upstream`; when `cut` is notified, each connection open
/// then gets a `connection.close` and a reset instead of what the broker sends next.
async fn proxy(upstream: &str, cut: Arc<Notify>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let upstream = upstream.to_owned();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            let cut = Arc::clone(&cut);
            tokio::spawn(async move {
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    _ = cut.notified() => {
                        let _ = client.write_all(&connection_close()).await;
                        let _ = client.set_zero_linger();
                    }
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_recovery_that_stalls_on_a_close_it_cannot_answer_is_rebuilt_and_consuming_resumes() {
    let Some(config) = broker("stall").await else {
        return;
    };
    let authority = authority(&amqp_url());
    let cut = Arc::new(Notify::new());
    let port = proxy(&authority, Arc::clone(&cut)).await;
    let name = config.connection_name().unwrap().to_owned();
    let through_proxy = AmqpConfig::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"))
        .with_connection_name(name);
    let q = unique("stall");
    let plan = classic_plan(&q);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = AmqpTransport::connect(through_proxy).await.unwrap();
    t.provision(&plan).await.unwrap();
    let sub = t.consume(&q, 10).await.unwrap();
    let (_conn, ch) = raw().await;
    publish(&ch, &q, b"before", "before").await;
    let before = tokio::time::timeout(Duration::from_secs(10), sub.recv())
        .await
        .expect("a delivery before the cut")
        .unwrap()
        .unwrap();
    t.settle(&before.tag, retry_core::Settlement::Ack)
        .await
        .unwrap();
    sub.flush().await.unwrap();

    // The broker "shuts down" while the client is busy (frames of its own waiting to go
    // out): close, then reset before the close-ok. Whether lapin reads the close before it
    // sees the reset is a race; about every other cut stalls its recovery. Consuming must
    // resume after every one.
    let logs = LogRecorder::up_to(tracing::Level::WARN);
    let _ = tracing::subscriber::set_global_default(logs.clone());
    let t = Arc::new(t);
    let io_threads_before = io_loop_threads();
    for round in 0..6 {
        let busy = tokio::spawn({
            let (t, suspect) = (Arc::clone(&t), plan.isolation_queue().to_owned());
            async move {
                loop {
                    let _ = t.fetch(&suspect).await;
                }
            }
        });
        // A delivery held across the cut: its tag must never be settled on the new channel.
        let held_id = format!("held-{round}");
        publish(&ch, &q, held_id.as_bytes(), &held_id).await;
        let held = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("the held delivery")
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let recoveries = t.recoveries();
        cut.notify_waiters();
        let id = format!("after-{round}");
        publish(&ch, &q, id.as_bytes(), &id).await;
        // Each is settled as soon as it is received, as a consumer does. A recovery that lapin
        // has half done (the consuming channel back, the connection not yet) can still be
        // rebuilt after a delivery: its settle is then refused, the broker has it back and
        // delivers it again.
        let mut acked: Vec<Vec<u8>> = Vec::new();
        while acked.len() < 2 {
            let delivery = tokio::time::timeout(Duration::from_secs(30), sub.recv())
                .await
                .unwrap_or_else(|_| panic!("consuming resumes after cut {round}"))
                .unwrap()
                .unwrap();
            let body = delivery.message.body().to_vec();
            assert!(
                body == id.as_bytes() || body == held_id.as_bytes(),
                "cut {round}: an unexpected delivery {:?}",
                String::from_utf8_lossy(&body)
            );
            if body == held_id.as_bytes() {
                // Its tags tell a requeue by the broker from a delivery handed out twice.
                assert!(
                    delivery.facts.redelivered,
                    "the broker put the held delivery back: cut {round}, again {:?} {:?}, \
                     first {:?} {:?}, acked {acked:?}, recoveries {recoveries} then {}",
                    delivery.tag,
                    delivery.facts,
                    held.tag,
                    held.facts,
                    t.recoveries()
                );
            }
            match t.settle(&delivery.tag, retry_core::Settlement::Ack).await {
                Ok(()) if !acked.contains(&body) => acked.push(body),
                Ok(()) => {}
                Err(retry_core::TransportError::Connection { .. }) => {}
                Err(e) => panic!("cut {round}: settling a fresh delivery: {e}"),
            }
        }
        busy.abort();
        assert!(
            t.settle(&held.tag, retry_core::Settlement::Ack)
                .await
                .is_err(),
            "a tag from before cut {round} is refused"
        );
        assert!(
            recoveries_reaching(&t, recoveries + 1).await > recoveries,
            "cut {round} was a recovery"
        );
    }
    let stalls = logs.containing("recovery made no attempt").len();
    print_uncaptured(&format!(
        "6 cuts, {stalls} of them stalled lapin's recovery and were rebuilt; lapin IO threads {io_threads_before} before, {} after\n",
        io_loop_threads()
    ));
    // The new connection serves the other channels too.
    sub.flush().await.unwrap();
    t.provision(&plan).await.unwrap();
    assert_eq!(ready_and_unacked_settled(&q).await, (0, 0));
    (*t).close().await.unwrap();
}
