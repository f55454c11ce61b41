//! One handler and one policy on four transports: the in-memory broker, RabbitMQ over
//! AMQP 0-9-1, RabbitMQ over AMQP 1.0 and NATS JetStream. The outcomes printed are the same
//! on each. The consumer's transport comes from a URL, through the registry
//! (`retry_transports::connect_with`): the code that consumes is one function, over one
//! type (`DynTransport`), whichever broker the URL names. Only the set-up that puts the
//! comments on the broker speaks each broker's own client.
//!
//! ```sh
//! cargo run -p examples --example 03_swap_transports -- memory
//! cargo run -p examples --example 03_swap_transports -- amqp091
//! cargo run -p examples --example 03_swap_transports -- amqp10
//! cargo run -p examples --example 03_swap_transports -- nats
//! ```
//!
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) and `AMQP10_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672`) point at the broker; AMQP 1.0 needs the
//! `rabbitmq_amqp1_0` plugin. `NATS_URL` (default `nats://127.0.0.1:4222`) points at a
//! NATS server with JetStream. On NATS, `KEEP_TOPOLOGY=1` leaves the streams of
//! `comments-swap` and the two parked comments, for `retryctl --url nats://127.0.0.1:4222
//! parked list comments-swap` (its policy as a file: `examples/swap_transports.toml`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, TopologyPlan, Transport};
use retry_transports::{ConnectOptions, DynTransport};
use transport_amqp091::{AmqpConfig, AmqpTransport};
use transport_memory::{MemoryTransport, Outgoing};
use transport_nats::NatsTransport;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const COMMENTS: [&str; 4] = ["great post", "flaky", "spam", "broken"];

/// The handler: nothing in it knows which transport delivered the message.
async fn handle(msg: Message) -> Result<(), HandlerError> {
    match msg.body() {
        b"spam" => Err(HandlerError::permanent("spam is never accepted")),
        b"flaky" if msg.attempt() == 1 => Err(HandlerError::transient("db timeout")),
        b"broken" => Err(HandlerError::transient("cannot render comment")),
        _ => Ok(()),
    }
}

fn policy() -> RetryPolicy {
    let delays = [200, 400].map(Duration::from_millis);
    RetryPolicy::delays(delays).build().expect("a valid policy")
}

/// The URL in the environment variable `var`, or `default` (the local broker).
fn url(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_owned())
}

/// A runtime for one transport's run.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Connects to `url` through the registry, with the transport called `protocol`.
async fn connect(url: &str, protocol: &str) -> Result<DynTransport, BoxError> {
    let options = ConnectOptions::new().with_protocol(protocol);
    Ok(retry_transports::connect_with(url, options).await?)
}

/// Consumes `queue` until every comment has been handled or parked, and returns what
/// happened to each, in the order of `COMMENTS`.
async fn consume(transport: DynTransport, queue: &str) -> Result<String, BoxError> {
    // What happened to each comment, and the comments whose journey is over.
    let paths: Arc<Mutex<BTreeMap<String, Vec<String>>>> = Arc::default();
    let ended: Mutex<BTreeSet<String>> = Mutex::default();
    let (done, all_done) = oneshot::channel();
    let done = Mutex::new(Some(done));
    let consumer = Consumer::builder(transport, queue, policy(), handle)
        .with_on_terminal({
            let paths = Arc::clone(&paths);
            move |msg, terminal| {
                let body = String::from_utf8_lossy(msg.body()).into_owned();
                let mut paths = paths.lock().unwrap();
                paths
                    .entry(body.clone())
                    .or_default()
                    .push(terminal.to_string());
                let mut ended = ended.lock().unwrap();
                if terminal.is_final() && ended.insert(body) && ended.len() == COMMENTS.len() {
                    done.lock().unwrap().take().map(|tx| tx.send(()));
                }
            }
        })
        .build()?;
    let report = consumer
        .run(async {
            let _ = all_done.await;
        })
        .await?;
    let paths = paths.lock().unwrap();
    let mut out = String::new();
    for comment in COMMENTS {
        let path = paths.get(comment).map(|p| p.join(", ")).unwrap_or_default();
        out += &format!("{comment:<11} {path}\n");
    }
    out += &format!(
        "{} handled, {} retried, {} parked\n",
        report.handled, report.retried, report.dead_lettered
    );
    Ok(out)
}

/// On the in-memory broker, in virtual time.
fn on_memory() -> Result<String, BoxError> {
    let transport = runtime().block_on(connect("memory://", "memory"))?;
    // `memory://` is a new broker, on a virtual clock that moves inside its `block_on`.
    let broker = transport
        .downcast_ref::<MemoryTransport>()
        .expect("memory:// is transport-memory")
        .broker()
        .clone();
    broker.block_on(async {
        let plan = TopologyPlan::new("comments", &policy())?;
        transport.provision(&plan).await?;
        for comment in COMMENTS {
            broker.publish(Outgoing::to_queue("comments", comment.into()))?;
        }
        consume(transport, "comments").await
    })
}

/// On RabbitMQ, over AMQP 0-9-1 or (`amqp10`) AMQP 1.0, on a queue named `queue`. RabbitMQ
/// 3.x cannot declare queues with arguments over AMQP 1.0, so the topology is always
/// declared over AMQP 0-9-1, and deleted afterwards.
async fn on_rabbitmq(amqp10: bool, queue: &str) -> Result<String, BoxError> {
    let amqp091_url = url("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
    let setup = AmqpTransport::connect(AmqpConfig::new(&amqp091_url)).await?;
    let plan = TopologyPlan::new(queue, &policy())?;
    setup.provision(&plan).await?;
    let channel = setup.connection().create_channel().await?;
    channel.confirm_select(Default::default()).await?;
    for comment in COMMENTS {
        let (options, properties) = (BasicPublishOptions::default(), BasicProperties::default());
        let body = comment.as_bytes();
        channel
            .basic_publish("".into(), queue.into(), options, body, properties)
            .await?
            .await?;
    }
    let consumed = async {
        let transport = if amqp10 {
            connect(
                &url("AMQP10_URL", "amqp://guest:guest@127.0.0.1:5672"),
                "amqp10",
            )
            .await?
        } else {
            connect(&amqp091_url, "amqp091").await?
        };
        consume(transport, queue).await
    };
    let outcome = tokio::time::timeout(Duration::from_secs(60), consumed).await;
    setup.teardown(&plan).await?;
    outcome.map_err(|_| "not every comment was handled or parked within a minute")?
}

/// On NATS JetStream: the transport declares the plan's streams itself, and the comments
/// are published as any NATS application would, with the stream's acknowledgement and an
/// id in a `message-id` header.
async fn on_nats(url: &str, queue: &str) -> Result<String, BoxError> {
    let transport = connect(url, "nats").await?;
    let plan = TopologyPlan::new(queue, &policy())?;
    transport.provision(&plan).await?;
    let nats = transport
        .downcast_ref::<NatsTransport>()
        .expect("nats:// is transport-nats")
        .clone();
    let js = async_nats::jetstream::new(nats.client().clone());
    for (i, comment) in COMMENTS.into_iter().enumerate() {
        // transport-nats reads the `message-id` header as the message id (`comment-3`), as
        // `retryctl parked` shows it.
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("message-id", format!("comment-{}", i + 1).as_str());
        js.publish_with_headers(queue.to_owned(), headers, comment.into())
            .await?
            .await?;
    }
    let outcome =
        tokio::time::timeout(Duration::from_secs(60), consume(transport.clone(), queue)).await;
    // `KEEP_TOPOLOGY=1` leaves the streams, and what was parked, for `retryctl`.
    if std::env::var_os("KEEP_TOPOLOGY").is_none() {
        for spec in plan.queues() {
            js.delete_stream(transport_nats::stream_name(&spec.name))
                .await?;
        }
    }
    nats.close().await;
    outcome.map_err(|_| "not every comment was handled or parked within a minute")?
}

/// Runs the comments on `transport` (`memory`, `amqp091`, `amqp10` or `nats`); `None` for
/// another name.
fn run(transport: &str, queue: &str) -> Option<Result<String, BoxError>> {
    let rabbitmq = |amqp10| runtime().block_on(on_rabbitmq(amqp10, queue));
    match transport {
        "memory" => Some(on_memory()),
        "amqp091" => Some(rabbitmq(false)),
        "amqp10" => Some(rabbitmq(true)),
        "nats" => {
            let nats_url = url("NATS_URL", "nats://127.0.0.1:4222");
            Some(runtime().block_on(on_nats(&nats_url, queue)))
        }
        _ => None,
    }
}

fn main() {
    let transport = std::env::args().nth(1).unwrap_or_default();
    match run(&transport, "comments-swap") {
        Some(Ok(out)) => print!("{out}"),
        Some(Err(e)) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        None => {
            eprintln!("usage: 03_swap_transports memory|amqp091|amqp10|nats");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use retry_core::Transport;

    use super::{BoxError, connect, runtime};

    const EXPECTED: &str = "\
great post  handled on attempt 1
flaky       retried in 200ms, handled on attempt 2
spam        parked (permanent)
broken      retried in 200ms, retried in 400ms, parked (attempts-exhausted)
2 handled, 3 retried, 2 parked
";

    /// Runs the example on `transport` and checks what it printed.
    fn check(transport: &str) {
        let queue = format!("swap-{transport}-{}", std::process::id());
        let out = super::run(transport, &queue).expect("a transport the example knows");
        let out = out.unwrap_or_else(|e| panic!("on {transport}: {e}"));
        assert_eq!(out, EXPECTED, "on {transport}");
    }

    /// Whether the broker of `transport` answers: the registry connects to it as the example
    /// does. Without it the test is skipped (loudly), or fails when `REQUIRE_BROKER` /
    /// `REQUIRE_NATS` is set.
    fn broker_answers(transport: &str) -> bool {
        let (url, skip): (String, fn(&str, &str)) = match transport {
            "amqp091" => (test_brokers::amqp_url(), test_brokers::no_broker),
            "amqp10" => (test_brokers::amqp10_url(), test_brokers::no_broker),
            _ => (test_brokers::nats_url(), test_brokers::no_nats),
        };
        let probe = runtime().block_on(async {
            let transport = connect(&url, transport).await?;
            transport.close().await;
            Ok::<_, BoxError>(())
        });
        match probe {
            Ok(()) => true,
            Err(e) => {
                skip(
                    &format!("03_swap_transports on {transport}"),
                    &e.to_string(),
                );
                false
            }
        }
    }

    #[test]
    fn memory() {
        check("memory");
    }

    #[test]
    fn amqp091() {
        if broker_answers("amqp091") {
            check("amqp091");
        }
    }

    #[test]
    fn amqp10() {
        if broker_answers("amqp10") {
            check("amqp10");
        }
    }

    #[test]
    fn nats() {
        if broker_answers("nats") {
            check("nats");
        }
    }
}
