//! Returned and routed clones in flight together on the transport's one publishing channel:
//! each must be reported as what the broker did with it, whichever confirm lapin hands a
//! `basic.return` to.
//!
//! RabbitMQ sends a `basic.return` before the confirm of the same publish and may confirm
//! several publishes with one `multiple` ack; lapin 4.12 gives the oldest waiting return to
//! whichever confirm it completes next, in hash-map order. Reported as confirmed, an
//! unroutable clone's original would be acknowledged and lost.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use lapin::Connection;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use retry_core::headers::EngineHeaders;
use retry_core::{
    Message, MessageParts, Properties, Publish, PublishResult, Route, Transport, TransportError,
};
use test_brokers::print_uncaptured;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use transport_amqp091::{AmqpConfig, AmqpTransport, embed};

const ROUNDS: usize = 300;
const PER_ROUND: usize = 20;
const UNROUTABLE_PER_ROUND: usize = 4;

fn message(queue: &str, id: &str) -> Message {
    Message::new(MessageParts {
        queue: queue.into(),
        routing_key: queue.into(),
        body: id.as_bytes().to_vec(),
        properties: Properties {
            message_id: Some(id.into()),
            ..Properties::default()
        },
        ..MessageParts::default()
    })
}

fn to(routing_key: &str) -> Publish {
    Publish {
        route: Route {
            exchange: "".into(),
            routing_key: routing_key.into(),
        },
        expiration: None,
        headers: EngineHeaders {
            attempts: 1,
            crashes: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
            reason: None,
            delay: None,
            suspect: None,
        },
    }
}

/// Which clones of `round` go nowhere: four of the twenty, at places that move each round.
fn unroutable(round: usize, i: usize) -> bool {
    (0..UNROUTABLE_PER_ROUND).any(|j| (round * 7 + j * 5) % PER_ROUND == i)
}

/// How one round treats a clone.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Published and awaited.
    Awaited,
    /// Published, polled once, and the caller's future dropped: its result is never heard.
    Dropped,
}

/// What the probe saw.
#[derive(Default)]
struct Seen {
    /// Unroutable clones reported confirmed: their originals would be lost.
    returned_confirmed: Vec<String>,
    /// Routable clones reported anything but confirmed.
    routed_not_confirmed: Vec<String>,
    /// Every routable clone published and awaited.
    routed: BTreeSet<String>,
    /// Routable clones whose callers stopped waiting: sent unless dropped before they were.
    maybe_routed: BTreeSet<String>,
    unroutable: usize,
}

/// What publishes the clones.
#[derive(Clone, Copy)]
enum Via<'a> {
    Transport(&'a AmqpTransport),
    /// An embedder's publisher, on its own connection.
    Embed(&'a embed::Publisher, &'a Connection),
}

impl Via<'_> {
    async fn publish(self, original: &Message, publish: &Publish) -> PublishResult {
        match self {
            Via::Transport(t) => t.publish(original, publish).await,
            Via::Embed(p, conn) => p.publish(conn, original, publish).await,
        }
    }
}

/// Publishes `ROUNDS` rounds of `PER_ROUND` clones of which `UNROUTABLE_PER_ROUND` go to
/// `nowhere`, the rest to `queue`, each round's all at once `via` the transport or an
/// embedder's publisher, treating each as `fate` says.
async fn probe(
    via: Via<'_>,
    queue: &str,
    nowhere: &str,
    fate: impl Fn(usize, usize, bool) -> Fate,
) -> Seen {
    let mut seen = Seen::default();
    for round in 0..ROUNDS {
        let clones: Vec<(String, bool, Fate)> = (0..PER_ROUND)
            .map(|i| {
                let lost = unroutable(round, i);
                (format!("{round}-{i}"), lost, fate(round, i, lost))
            })
            .collect();
        let results = futures::future::join_all(clones.iter().map(|(id, lost, fate)| {
            let original = message(queue, id);
            let publish = to(if *lost { nowhere } else { queue });
            async move {
                let publishing = via.publish(&original, &publish);
                match fate {
                    Fate::Awaited => Some(publishing.await),
                    // tokio's timeout polls the future once before it looks at the clock.
                    Fate::Dropped => tokio::time::timeout(Duration::ZERO, publishing).await.ok(),
                }
            }
        }))
        .await;
        for ((id, lost, _), result) in clones.into_iter().zip(results) {
            if lost {
                seen.unroutable += 1;
            } else if result.is_some() {
                seen.routed.insert(id.clone());
            } else {
                seen.maybe_routed.insert(id.clone());
            }
            match (lost, result) {
                (_, None) => {}
                (true, Some(PublishResult::Confirmed)) => seen.returned_confirmed.push(id),
                (true, Some(_)) => {}
                (false, Some(PublishResult::Confirmed)) => {}
                (false, Some(other)) => seen.routed_not_confirmed.push(format!("{id}: {other:?}")),
            }
        }
    }
    print_uncaptured(&format!(
        "{} of {} unroutable clones reported confirmed, {} of {} routable ones reported \
         otherwise\n",
        seen.returned_confirmed.len(),
        seen.unroutable,
        seen.routed_not_confirmed.len(),
        seen.routed.len(),
    ));
    seen
}

/// Reads `queue` by consuming until it has read every one of `expected` (or nothing more
/// comes for 10 s), then takes whatever else it holds; returns what it read, and how many it
/// read twice.
async fn read_back(
    conn: &Connection,
    queue: &str,
    expected: &BTreeSet<String>,
) -> (BTreeSet<String>, usize) {
    let reader = conn.create_channel().await.unwrap();
    let mut consumer = reader
        .basic_consume(
            queue.into(),
            "returns-reader".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut found = BTreeSet::new();
    let mut duplicates = 0;
    let mut take = |data: Vec<u8>| {
        if !found.insert(String::from_utf8(data).unwrap()) {
            duplicates += 1;
        }
    };
    let mut left = expected.len();
    while left > 0 {
        let Ok(Some(delivery)) =
            tokio::time::timeout(Duration::from_secs(10), consumer.next()).await
        else {
            break;
        };
        let data = delivery.unwrap().data;
        if expected.contains(std::str::from_utf8(&data).unwrap()) {
            left -= 1;
        }
        take(data);
    }
    reader
        .basic_cancel("returns-reader".into(), Default::default())
        .await
        .unwrap();
    while let Some(delivery) = consumer.next().await {
        take(delivery.unwrap().data);
    }
    while let Some(got) = get(&reader, queue).await {
        take(got.body);
    }
    let _ = reader.close(200, "read".into()).await;
    (found, duplicates)
}

/// Asserts that no clone was misreported and that every routable one is in `queue`.
async fn check(seen: &Seen, conn: &Connection, queue: &str) {
    let (found, duplicates) = read_back(conn, queue, &seen.routed).await;
    let missing: Vec<_> = seen.routed.difference(&found).collect();
    let strays: Vec<_> = found
        .iter()
        .filter(|id| !seen.routed.contains(*id) && !seen.maybe_routed.contains(*id))
        .collect();
    let first = |v: &[String]| v[..v.len().min(10)].to_vec();
    assert!(
        seen.returned_confirmed.is_empty(),
        "{} of {} unroutable clones were reported confirmed (their originals would be acked \
         and lost): {:?}",
        seen.returned_confirmed.len(),
        seen.unroutable,
        first(&seen.returned_confirmed),
    );
    assert!(
        seen.routed_not_confirmed.is_empty(),
        "{} routable clones were not reported confirmed: {:?}",
        seen.routed_not_confirmed.len(),
        first(&seen.routed_not_confirmed),
    );
    assert!(
        missing.is_empty() && strays.is_empty() && duplicates == 0,
        "the queue holds {} of {} routable clones: missing {:?}, unexpected {:?}, {duplicates} \
         duplicates",
        found.len(),
        seen.routed.len(),
        &missing[..missing.len().min(10)],
        &strays[..strays.len().min(10)],
    );
    assert_eq!(
        seen.routed.len() + seen.maybe_routed.len(),
        ROUNDS * (PER_ROUND - UNROUTABLE_PER_ROUND)
    );
}

/// A queue of its own, the name nothing is bound to, and a transport.
async fn setup(test: &str) -> Option<(AmqpTransport, String, String, Connection, Cleanup)> {
    let config = broker(test).await?;
    let q = unique(test);
    // The default exchange routes by queue name: nothing has this one.
    let nowhere = format!("{q}.nowhere");
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.queue(q.clone());
    let (conn, ch) = raw().await;
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let t = transport(&config).await;
    Some((t, q, nowhere, conn, cleanup))
}

#[tokio::test]
async fn mixed_routable_and_unroutable_clones_in_flight_are_each_reported_as_the_broker_routed_them()
 {
    let Some((t, q, nowhere, conn, _cleanup)) = setup("returns").await else {
        return;
    };
    let seen = probe(Via::Transport(&t), &q, &nowhere, |_, _, _| Fate::Awaited).await;
    check(&seen, &conn, &q).await;
    t.close().await.unwrap();
}

/// The same through `embed::Publisher`, for consumers of their own.
#[tokio::test]
async fn an_embedders_publisher_reports_mixed_clones_in_flight_as_the_broker_routed_them() {
    let Some((t, q, nowhere, conn, _cleanup)) = setup("returns-embed").await else {
        return;
    };
    t.close().await.unwrap();
    let publisher = embed::Publisher::new(Duration::from_secs(30));
    let fate = |round: usize, i: usize, _| {
        if (i + round).is_multiple_of(7) {
            Fate::Dropped
        } else {
            Fate::Awaited
        }
    };
    let seen = probe(Via::Embed(&publisher, &conn), &q, &nowhere, fate).await;
    check(&seen, &conn, &q).await;
}

/// A publish whose caller stops listening still has its confirm read: that confirm can
/// carry another clone's return.
#[tokio::test]
async fn clones_whose_callers_stop_waiting_take_no_other_clones_return_with_them() {
    let Some((t, q, nowhere, conn, _cleanup)) = setup("returns-dropped").await else {
        return;
    };
    // Per round, one unroutable and three routable clones are dropped after being sent.
    let fate = |round: usize, i: usize, lost: bool| {
        let dropped = if lost {
            (round * 7) % PER_ROUND == i
        } else {
            (i + round).is_multiple_of(6)
        };
        if dropped {
            Fate::Dropped
        } else {
            Fate::Awaited
        }
    };
    let seen = probe(Via::Transport(&t), &q, &nowhere, fate).await;
    check(&seen, &conn, &q).await;
    t.close().await.unwrap();
}

/// Forwards every connection to `upstream`; while `paused` is true, nothing the broker sends
/// reaches the client (it is held, and delivered once unpaused).
async fn pausing_proxy(upstream: String, paused: watch::Receiver<bool>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
            });
            let mut paused = paused.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let Ok(n) = server_read.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 || paused.wait_for(|p| !*p).await.is_err() {
                        return;
                    }
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// A confirm that does not come in time is not given up on alone: every publish in flight
/// on the channel fails with it (its confirm could carry their returns), and the next
/// publish goes out on a new channel.
#[tokio::test]
async fn a_confirm_timeout_fails_every_publish_in_flight_and_publishing_resumes() {
    let Some(config) = broker("returns-timeout").await else {
        return;
    };
    let q = unique("returns-timeout");
    let mut cleanup = Cleanup::new(amqp_url());
    cleanup.queue(q.clone());
    let (conn, ch) = raw().await;
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let authority = authority(&amqp_url());
    let (pause, paused) = watch::channel(false);
    let port = pausing_proxy(authority, paused).await;
    let through_proxy = AmqpConfig::new(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"))
        .with_connection_name(config.connection_name().unwrap().to_owned())
        .with_confirm_timeout(Duration::from_secs(2));
    let t = AmqpTransport::connect(through_proxy).await.unwrap();
    let first = t.publish(&message(&q, "first"), &to(&q)).await;
    assert!(matches!(first, PublishResult::Confirmed), "{first:?}");

    // The broker's answers stop reaching the client: five publishes in flight.
    pause.send_replace(true);
    let stuck: Vec<String> = (0..5).map(|i| format!("stuck-{i}")).collect();
    let results = futures::future::join_all(stuck.iter().map(|id| {
        let (t, original, publish) = (&t, message(&q, id), to(&q));
        async move { t.publish(&original, &publish).await }
    }))
    .await;
    let timeouts = results
        .iter()
        .filter(|r| matches!(r, PublishResult::Failed(TransportError::Timeout { .. })))
        .count();
    let failed_with_it = results
        .iter()
        .filter(|r| {
            matches!(r, PublishResult::Failed(e @ TransportError::Connection { .. })
                if e.to_string().contains("timed out"))
        })
        .count();
    assert_eq!(
        (timeouts, failed_with_it),
        (1, 4),
        "one confirm timed out and the channel was given up with the others: {results:?}"
    );

    // The answers flow again; the next publish opens a new channel and is confirmed. The
    // stuck ones reached the broker all the same (their originals would be requeued: a
    // duplicate, never a loss).
    pause.send_replace(false);
    let last = t.publish(&message(&q, "last"), &to(&q)).await;
    assert!(matches!(last, PublishResult::Confirmed), "{last:?}");
    let mut expected: BTreeSet<String> = stuck.into_iter().collect();
    expected.extend(["first".to_owned(), "last".to_owned()]);
    assert_eq!(read_back(&conn, &q, &expected).await, (expected, 0));
    t.close().await.unwrap();
}
