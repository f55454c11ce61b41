//! Connections that stop answering: a node that accepts TCP but never answers the
//! handshake, and a connection that stops taking writes. The transport must give up on what
//! is stuck, in time, try again, and leave no IO thread behind.
//!
//! The close-ok stall, whose IO thread lapin keeps, is in `stall_close.rs`: a binary of its
//! own, so that the threads counted here are this file's.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use retry_core::{Subscription, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// The tests of this file count the process's lapin IO threads: they run one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the holding proxy does with a connection it accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Accept {
    /// Forwards it to the broker.
    Forward,
    /// Takes it and never answers: a node that accepts TCP and stalls the handshake.
    Hold,
}

/// Forwards or holds each connection as `accept` says when it arrives; when `cut` is
/// notified, every forwarded connection is reset. Returns its port and how many it held.
async fn holding_proxy(
    upstream: String,
    accept: watch::Receiver<Accept>,
    cut: Arc<Notify>,
) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            if *accept.borrow() == Accept::Hold {
                counted.fetch_add(1, Ordering::SeqCst);
                // Reads what the client sends and answers nothing, until it closes.
                tokio::spawn(async move {
                    let mut sink = tokio::io::sink();
                    let _ = tokio::io::copy(&mut client, &mut sink).await;
                });
                continue;
            }
            let upstream = upstream.clone();
            let cut = Arc::clone(&cut);
            tokio::spawn(async move {
                let Ok(mut server) = TcpStream::connect(&upstream).await else {
                    return;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    _ = cut.notified() => {
                        let _ = client.set_zero_linger();
                    }
                }
            });
        }
    });
    (port, held)
}

/// On a one-node list, the node drops the connection and then accepts TCP but never answers
/// the handshake: lapin's recovery waits on it for good, and so did the connection that
/// replaces it. Every connection attempt has a timeout, the replacement is tried again until
/// the node answers, and the IO loops of the attempts given up on end.
#[tokio::test]
async fn a_node_that_accepts_tcp_but_never_answers_delays_the_rebuild_but_does_not_stop_it() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Some(config) = broker("stall-hold").await else {
        return;
    };
    // The other test's connections are closed; their IO threads end on their own time.
    let others = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(50),
        || std::future::ready(io_loop_threads()),
        |n| *n == 0,
    )
    .await;
    assert_eq!(others, 0, "lapin IO threads left by the other test");
    let authority = authority(&amqp_url());
    let (accept, accepting) = watch::channel(Accept::Forward);
    let cut = Arc::new(Notify::new());
    let (port, held) = holding_proxy(authority, accepting, Arc::clone(&cut)).await;
    let name = config.connection_name().unwrap().to_owned();
    let through_proxy = AmqpConfig::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"))
        .with_connection_name(name)
        .with_connect_timeout(Duration::from_secs(2))
        .with_reconnect_delay(Duration::from_millis(100), Duration::from_secs(1));
    let q = unique("stall-hold");
    let plan = classic_plan(&q);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = AmqpTransport::connect(through_proxy).await.unwrap();
    t.provision(&plan).await.unwrap();
    let sub = t.consume(&q, 10).await.unwrap();
    let (_conn, ch) = raw().await;
    let io_threads_before = io_loop_threads();

    for round in 0..3 {
        let recoveries = t.recoveries();
        // The node goes away and comes back holding every connection: lapin's recovery
        // attempt is held, and after the stall so is the first attempt to replace it.
        accept.send_replace(Accept::Hold);
        let held_before = held.load(Ordering::SeqCst);
        cut.notify_waiters();
        let two_held = poll_until(
            Duration::from_secs(60),
            Duration::from_millis(100),
            || std::future::ready(held.load(Ordering::SeqCst) - held_before),
            |n| *n >= 2,
        )
        .await;
        assert!(
            two_held >= 2,
            "round {round}: lapin's attempt and a rebuild reached the node ({two_held} held; {:?})",
            t.connection().status()
        );
        accept.send_replace(Accept::Forward);

        let id = format!("after-{round}");
        publish(&ch, &q, id.as_bytes(), &id).await;
        // An ack is not confirmed in AMQP 0-9-1: one written just before a rebuild can be
        // lost with its connection, and its message comes again, marked redelivered.
        loop {
            let delivery = tokio::time::timeout(Duration::from_secs(60), sub.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("round {round}: consuming resumes once the node answers")
                })
                .unwrap()
                .unwrap();
            let body = String::from_utf8_lossy(delivery.message.body()).into_owned();
            let settled = t.settle(&delivery.tag, retry_core::Settlement::Ack).await;
            if body == id {
                match settled {
                    Ok(()) => break,
                    Err(retry_core::TransportError::Connection { .. }) => continue,
                    Err(e) => panic!("round {round}: settling a fresh delivery: {e}"),
                }
            }
            let earlier = (0..round).any(|r| body == format!("after-{r}"));
            assert!(
                earlier && delivery.facts.redelivered,
                "round {round}: an unexpected delivery {body:?} (redelivered {})",
                delivery.facts.redelivered
            );
        }
        assert!(recoveries_reaching(&t, recoveries + 1).await > recoveries);

        // Every connection given up on has let go of its IO thread: one per connection
        // in use, as before.
        let threads = poll_until(
            Duration::from_secs(30),
            Duration::from_millis(100),
            || std::future::ready(io_loop_threads()),
            |n| *n == io_threads_before,
        )
        .await;
        assert_eq!(
            threads, io_threads_before,
            "round {round}: lapin IO threads, against {io_threads_before} before the stalls"
        );
    }
    sub.flush().await.unwrap();
    t.close().await.unwrap();
}

/// Bytes written to sockets connected to 127.0.0.1:`port` that the peer has not taken yet
/// (the `tx_queue` column of `/proc/net/tcp`).
fn unsent_bytes_to(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    let remote = format!("0100007F:{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|row| {
            let columns: Vec<&str> = row.split_whitespace().collect();
            let queues = columns.get(4)?.split_once(':')?;
            (columns.get(2) == Some(&remote.as_str()))
                .then(|| u64::from_str_radix(queues.0, 16).ok())
                .flatten()
        })
        .sum()
}

/// Forwards every connection to `upstream`; while `paused` is true it stops reading what the
/// client sends, with a small receive buffer, so that the client's writes soon stop
/// completing (as on a connection whose peer is gone without a reset).
async fn write_pausing_proxy(upstream: String, paused: watch::Receiver<bool>) -> u16 {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(16).unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
            });
            let mut paused = paused.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                loop {
                    if paused.wait_for(|p| !*p).await.is_err() {
                        return;
                    }
                    let n = match client_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A settle or a fetch whose frame cannot be written (the connection has stopped taking
/// writes, as a stalled one has) fails after the request timeout instead of waiting for
/// good; while it waited, it held every later settle of its subscription, and the broker,
/// never acknowledged, stopped delivering.
#[tokio::test]
async fn a_settle_or_fetch_that_cannot_be_written_fails_in_time_and_holds_nothing_up() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Some(config) = broker("stall-writes").await else {
        return;
    };
    let authority = authority(&amqp_url());
    let (pause, paused) = watch::channel(false);
    let port = write_pausing_proxy(authority, paused).await;
    let name = config.connection_name().unwrap().to_owned();
    let through_proxy = AmqpConfig::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"))
        .with_connection_name(name)
        .with_request_timeout(Duration::from_secs(2));
    let q = unique("stall-writes");
    let plan = classic_plan(&q);
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.plan(&plan);
    let t = AmqpTransport::connect(through_proxy).await.unwrap();
    t.provision(&plan).await.unwrap();
    let sub = t.consume(&q, 10).await.unwrap();
    let (_conn, ch) = raw().await;
    for id in ["one", "two"] {
        publish(&ch, &q, id.as_bytes(), id).await;
    }
    let mut held = Vec::new();
    for _ in 0..2 {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("a delivery")
            .unwrap()
            .unwrap();
        held.push(d);
    }
    // A message bigger than any socket buffer, on another channel of the same connection,
    // fills what the socket takes.
    let filler = t.connection().create_channel().await.unwrap();
    pause.send_replace(true);
    let big = vec![0u8; 16 << 20];
    let stuck = tokio::spawn(async move {
        let _ = filler
            .basic_publish(
                "".into(),
                "nowhere".into(),
                Default::default(),
                &big,
                Default::default(),
            )
            .await;
    });

    // Only once the socket holds unsent bytes is the connection known to take no more; a
    // requeue sent before that would be written.
    let unsent = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(20),
        || std::future::ready(unsent_bytes_to(port)),
        |n| *n >= 64 << 10,
    )
    .await;
    assert!(
        unsent >= 64 << 10,
        "the filler backs up ({unsent} bytes unsent)"
    );

    // The requeue's frame waits behind it: it fails in time, and the ack after it is not
    // held up by it.
    let requeue = tokio::time::timeout(
        Duration::from_secs(20),
        t.settle(&held[0].tag, retry_core::Settlement::Requeue),
    )
    .await
    .expect("a requeue that cannot be written returns");
    assert!(requeue.is_err(), "{requeue:?}");
    t.settle(&held[1].tag, retry_core::Settlement::Ack)
        .await
        .unwrap();
    let flushed = tokio::time::timeout(Duration::from_secs(20), sub.flush())
        .await
        .expect("a flush that cannot be written returns");
    assert!(flushed.is_err(), "{flushed:?}");
    let fetched = tokio::time::timeout(Duration::from_secs(20), t.fetch(plan.isolation_queue()))
        .await
        .expect("a fetch that cannot be written returns");
    assert!(
        matches!(fetched, Err(retry_core::TransportError::Timeout { .. })),
        "{fetched:?}"
    );

    // Writes flow again: what was queued goes out, and consuming goes on.
    pause.send_replace(false);
    stuck.await.unwrap();
    publish(&ch, &q, b"three", "three").await;
    let mut bodies = Vec::new();
    while !bodies.contains(&b"three".to_vec()) {
        let d = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .expect("consuming goes on")
            .unwrap()
            .unwrap();
        t.settle(&d.tag, retry_core::Settlement::Ack).await.unwrap();
        bodies.push(d.message.body().to_vec());
    }
    sub.flush().await.unwrap();
    t.close().await.unwrap();
}
