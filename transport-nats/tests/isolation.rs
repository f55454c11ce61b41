//! The isolation queue between processes, against the local NATS server (`NATS_URL`; skipped
//! loudly without one unless `REQUIRE_NATS` is set):
//! - a suspect another process holds (kept alive) does not make a watcher answer every poll,
//!   and once its holder is gone the watcher finds it;
//! - a fetched suspect whose double ack failed is brought back by the next fetch, the claim
//!   the consumer makes before any work, instead of that fetch missing it;
//! - a double ack the server took, though its answer was lost, leaves nothing to wait for;
//! - a pull whose message is lost on its way in fails the fetch with `FetchLost`.
//!
//! The last three run the transport through [`Proxy`], a TCP relay of the test's own that
//! can swallow what one direction of a connection carries, and cut every connection.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use retry_core::{RetryPolicy, Settlement, TopologyPlan, Transport, TransportError};
use test_brokers::nats_url;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;
use transport_nats::testing;
use transport_nats::{NatsConfig, NatsTransport};

fn unique(what: &str) -> String {
    test_brokers::unique(&format!("tn-isolation-{what}"))
}

async fn connect(url: &str, ack_wait: Duration) -> Option<NatsTransport> {
    let config = NatsConfig::new(url)
        .with_ack_wait(ack_wait)
        .with_pull_wait(Duration::from_millis(500))
        .with_operation_timeout(Duration::from_secs(1));
    testing::connect_or_skip("transport-nats' isolation tests", config).await
}

/// A plan provisioned with `ack_wait` (the consumers' ack wait), and one suspect published
/// to its isolation queue.
async fn one_suspect(admin: &NatsTransport, what: &str, id: &str) -> TopologyPlan {
    let queue = unique(what);
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("policy");
    let plan = TopologyPlan::new(&queue, &policy).expect("a plan");
    admin.provision(&plan).await.expect("provision");
    test_brokers::nats::publish(admin.client(), plan.isolation_queue(), id, id, &[]).await;
    plan
}

fn id_of(d: &retry_core::Delivery<transport_nats::NatsTag>) -> String {
    d.message
        .properties()
        .message_id
        .clone()
        .unwrap_or_default()
}

/// While another process runs a long suspect (fetched, unacked, kept alive), the watch of
/// the isolation queue answers only when the suspect could have been handed out again (an
/// ack wait after its delivery), not every poll: each answer costs every consumer process a
/// drain, a flush and an empty fetch. Once the holder is gone without settling, the
/// watcher finds the suspect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_another_process_holds_does_not_wake_the_watch_every_poll() {
    const ACK_WAIT: Duration = Duration::from_secs(3);
    const POLL: Duration = Duration::from_millis(100);
    let Some(holder) = connect(&nats_url(), ACK_WAIT).await else {
        return;
    };
    let Some(watcher) = connect(&nats_url(), ACK_WAIT).await else {
        return;
    };
    let plan = one_suspect(&holder, "watch", "long-suspect").await;
    let isolation = plan.isolation_queue();
    let held = holder
        .fetch(isolation)
        .await
        .expect("fetch")
        .expect("the suspect");

    // Two ack waits: at most one answer per ack wait while the holder keeps it alive.
    let window = Instant::now() + 2 * ACK_WAIT;
    let (mut answers, mut empty) = (0, 0);
    while let Ok(ready) =
        tokio::time::timeout_at(window.into(), watcher.ready(isolation, POLL)).await
    {
        ready.expect("watch");
        answers += 1;
        match watcher.fetch(isolation).await.expect("fetch") {
            None => empty += 1,
            Some(d) => panic!("the held suspect was handed out again: {}", id_of(&d)),
        }
    }
    println!(
        "{answers} answers and {empty} empty fetches in {:?} (poll {POLL:?}, ack wait {ACK_WAIT:?})",
        2 * ACK_WAIT
    );
    assert!(
        answers <= 2 && empty <= 2,
        "{answers} answers and {empty} empty fetches in {:?} (poll {POLL:?}, ack wait {ACK_WAIT:?})",
        2 * ACK_WAIT
    );

    // The holder dies with it: no settlement, no more keep-alives.
    drop(held);
    let deadline = Instant::now() + 3 * ACK_WAIT;
    let found = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, watcher.ready(isolation, POLL))
            .await
            .expect("the watch answers once the holder is gone")
            .expect("watch");
        if let Some(d) = watcher.fetch(isolation).await.expect("fetch") {
            break d;
        }
    };
    assert_eq!(id_of(&found), "long-suspect");
    watcher
        .settle(&found.tag, Settlement::Ack)
        .await
        .expect("ack");
    testing::delete_plan(holder.client(), &plan).await;
}

/// A TCP relay to the NATS server, connection by connection, that can swallow what one
/// direction carries (upstream: the client's; downstream: the server's), for the
/// connections it accepted in an order the test names, and can cut them all.
struct Proxy {
    url: String,
    accepted: Arc<AtomicUsize>,
    swallow_up: Arc<Mutex<Vec<usize>>>,
    swallow_down: Arc<Mutex<Vec<usize>>>,
    pipes: Arc<Mutex<Vec<AbortHandle>>>,
    listener: AbortHandle,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.listener.abort();
        self.cut();
    }
}

impl Proxy {
    async fn to(server: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let url = format!("nats://{}", listener.local_addr().expect("its address"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (swallow_up, swallow_down) = (Arc::<Mutex<Vec<usize>>>::default(), Arc::default());
        let pipes = Arc::<Mutex<Vec<AbortHandle>>>::default();
        let (n, up, down, all) = (
            Arc::clone(&accepted),
            Arc::clone(&swallow_up),
            Arc::clone(&swallow_down),
            Arc::clone(&pipes),
        );
        let listener = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = TcpStream::connect(server).await else {
                    continue;
                };
                let index = n.fetch_add(1, Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = upstream.into_split();
                let a = tokio::spawn(relay(client_read, server_write, index, Arc::clone(&up)));
                let b = tokio::spawn(relay(server_read, client_write, index, Arc::clone(&down)));
                all.lock()
                    .unwrap()
                    .extend([a.abort_handle(), b.abort_handle()]);
            }
        })
        .abort_handle();
        Proxy {
            url,
            accepted,
            swallow_up,
            swallow_down,
            pipes,
            listener,
        }
    }

    /// Swallows what the client of connection `index` sends, or stops.
    fn swallow_up(&self, index: usize, on: bool) {
        toggle(&self.swallow_up, index, on);
    }

    /// Swallows what the server sends on connection `index`, or stops.
    fn swallow_down(&self, index: usize, on: bool) {
        toggle(&self.swallow_down, index, on);
    }

    /// Closes every connection relayed so far: the clients reconnect.
    fn cut(&self) {
        for pipe in self.pipes.lock().unwrap().drain(..) {
            pipe.abort();
        }
    }
}

fn toggle(set: &Mutex<Vec<usize>>, index: usize, on: bool) {
    let mut set = set.lock().unwrap();
    set.retain(|i| *i != index);
    if on {
        set.push(index);
    }
}

async fn relay(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    index: usize,
    swallowed: Arc<Mutex<Vec<usize>>>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if swallowed.lock().unwrap().contains(&index) {
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// The server's address, from `NATS_URL`.
fn server_address() -> SocketAddr {
    let url = nats_url();
    let host = url.rsplit('@').next().unwrap_or(&url);
    let host = host.trim_start_matches("nats://");
    host.parse().expect("NATS_URL names an IP address and port")
}

/// A transport through a [`Proxy`]: its first connection (index 0 of the proxy) is the one
/// for everything but pulls, which is where a fetched delivery's double ack goes; the
/// second (index 1) is the one pulls are made on.
async fn proxied(ack_wait: Duration) -> Option<(Proxy, NatsTransport, NatsTransport)> {
    let admin = connect(&nats_url(), ack_wait).await?;
    let proxy = Proxy::to(server_address()).await;
    let transport = connect(&proxy.url, ack_wait).await?;
    assert_eq!(proxy.accepted.load(Ordering::SeqCst), 2, "two connections");
    Some((proxy, transport, admin))
}

const CONTROL: usize = 0;
const PULLS: usize = 1;

/// Which way the relay loses a fetched suspect's double ack.
#[derive(Clone, Copy)]
enum Lost {
    /// The ack itself, on its way to the server.
    Ack,
    /// The server's answer to it.
    Answer,
}

/// A plan named after `what` with one suspect, fetched through the proxied transport `t`;
/// its double ack then fails as `lost` says, and the proxy cuts every connection. Returns
/// the plan.
async fn settlement_lost(
    proxy: &Proxy,
    t: &NatsTransport,
    admin: &NatsTransport,
    what: &str,
    lost: Lost,
) -> TopologyPlan {
    let plan = one_suspect(admin, what, "suspect").await;
    let fetched = t
        .fetch(plan.isolation_queue())
        .await
        .expect("fetch")
        .expect("the suspect");
    let swallow = |on| match lost {
        Lost::Ack => proxy.swallow_up(CONTROL, on),
        Lost::Answer => proxy.swallow_down(CONTROL, on),
    };
    swallow(true);
    let settled = t.settle(&fetched.tag, Settlement::Ack).await;
    assert!(settled.is_err(), "the double ack fails: {settled:?}");
    swallow(false);
    proxy.cut();
    plan
}

/// As the consumer does: a fetch that fails for the connection is made again, before
/// anything else runs, until one answers; within `limit`.
async fn fetch_answered(
    t: &NatsTransport,
    queue: &str,
    limit: Duration,
) -> Option<retry_core::Delivery<transport_nats::NatsTag>> {
    let started = Instant::now();
    loop {
        match t.fetch(queue).await {
            Ok(found) => return found,
            Err(e) => {
                assert!(started.elapsed() < limit, "still failing: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The consumer claims a suspect whose settlement failed with a fetch before any work runs
/// (the claim is only worth it if that fetch brings the suspect back). The double ack is
/// lost on its way; the server still holds the message as handed out, for the whole ack
/// wait: the next fetch must bring it back, not answer "nothing".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_suspect_whose_double_ack_failed_is_brought_back_by_the_next_fetch() {
    const ACK_WAIT: Duration = Duration::from_secs(10);
    let Some((proxy, t, admin)) = proxied(ACK_WAIT).await else {
        return;
    };
    let plan = settlement_lost(&proxy, &t, &admin, "claim", Lost::Ack).await;
    let isolation = plan.isolation_queue();
    let started = Instant::now();
    let claimed = fetch_answered(&t, isolation, ACK_WAIT)
        .await
        .expect("the claim brings the suspect back, not nothing");
    assert_eq!(id_of(&claimed), "suspect");
    assert!(claimed.facts.redelivered);
    assert!(
        started.elapsed() < ACK_WAIT,
        "it came back with the nak, not after the ack wait"
    );
    t.settle(&claimed.tag, Settlement::Ack).await.expect("ack");
    assert_eq!(admin.count(isolation).await.expect("count"), 0);
    testing::delete_plan(admin.client(), &plan).await;
}

/// A double ack the server took, whose answer was lost: the message is gone, and the next
/// fetch answers "nothing" at once rather than waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_ack_the_server_took_leaves_nothing_to_wait_for() {
    const ACK_WAIT: Duration = Duration::from_secs(10);
    let Some((proxy, t, admin)) = proxied(ACK_WAIT).await else {
        return;
    };
    let plan = settlement_lost(&proxy, &t, &admin, "landed", Lost::Answer).await;
    let isolation = plan.isolation_queue();
    let started = Instant::now();
    let next = fetch_answered(&t, isolation, ACK_WAIT).await;
    assert!(next.is_none(), "acked: nothing comes");
    assert!(
        started.elapsed() < ACK_WAIT / 2,
        "answered without waiting for the ack wait: {:?}",
        started.elapsed()
    );
    testing::delete_plan(admin.client(), &plan).await;
}

/// A pull whose message never arrives (lost on the pulling connection) fails the fetch with
/// `FetchLost`: the message comes back redelivered through no crash, and the consumer must
/// not charge it one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_whose_message_is_lost_on_its_way_in_is_fetch_lost() {
    const ACK_WAIT: Duration = Duration::from_secs(2);
    let Some((proxy, t, admin)) = proxied(ACK_WAIT).await else {
        return;
    };
    let plan = one_suspect(&admin, "lost", "suspect").await;
    let isolation = plan.isolation_queue();

    proxy.swallow_down(PULLS, true);
    let lost = t.fetch(isolation).await;
    assert!(
        matches!(&lost, Err(TransportError::FetchLost { queue, .. }) if queue == isolation),
        "{lost:?}"
    );
    proxy.swallow_down(PULLS, false);
    proxy.cut();

    // It comes back, redelivered, once its ack wait has passed.
    let started = Instant::now();
    let back = loop {
        assert!(started.elapsed() < 5 * ACK_WAIT, "never came back");
        if let Ok(Some(d)) = t.fetch(isolation).await {
            break d;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(id_of(&back), "suspect");
    assert!(back.facts.redelivered);
    t.settle(&back.tag, Settlement::Ack).await.expect("ack");
    testing::delete_plan(admin.client(), &plan).await;
}
