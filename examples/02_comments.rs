//! The article's `comments` queue on a real RabbitMQ: three delay levels and a parking queue.
//!
//! ```sh
//! cargo run -p examples --example 02_comments
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `QUEUE`
//! (default `comments`), `DELAYS_MS` (default `500,1000,2000`), `KEEP_TOPOLOGY=1` to leave
//! the queues in place afterwards.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

const COMMENTS: [(&str, &str); 5] = [
    ("comment-1", "great post"),
    ("comment-2", "flaky: fails once"),
    ("comment-3", "flaky: fails twice"),
    ("comment-4", "spam"),
    ("comment-5", "broken: always fails"),
];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = std::env::var("QUEUE").unwrap_or_else(|_| "comments".into());
    let delays: Vec<Duration> = std::env::var("DELAYS_MS")
        .unwrap_or_else(|_| "500,1000,2000".into())
        .split(',')
        .map(|s| s.trim().parse().map(Duration::from_millis))
        .collect::<Result<_, _>>()?;

    let policy = RetryPolicy::delays(delays).build()?;
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(&url)).await?);
    let start = Instant::now();
    let stamp = move || format!("[{:>5} ms]", start.elapsed().as_millis());

    // The handler: succeed, fail a few times, refuse spam for good, or always fail.
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let handler = {
        let runs = Arc::clone(&runs);
        move |msg: Message| {
            let id = msg.properties().message_id.clone().unwrap_or_default();
            let body = String::from_utf8_lossy(msg.body()).into_owned();
            let run = {
                let mut runs = runs.lock().unwrap();
                let n = runs.entry(id.clone()).or_default();
                *n += 1;
                *n
            };
            let outcome = match body.as_str() {
                "spam" => Err(HandlerError::permanent("spam is never accepted")),
                "flaky: fails once" if run < 2 => Err(HandlerError::transient("db timeout")),
                "flaky: fails twice" if run < 3 => Err(HandlerError::transient("db timeout")),
                "broken: always fails" => Err(HandlerError::transient("cannot render comment")),
                _ => Ok(()),
            };
            if let Err(e) = &outcome {
                println!("{} {id} attempt {run} failed: {e}", stamp());
            }
            async move { outcome }
        }
    };

    let finished: Arc<Mutex<usize>> = Arc::default();
    let consumer = Consumer::builder(Arc::clone(&transport), queue.clone(), policy, handler)
        .with_prefetch(10)
        .with_on_terminal({
            let finished = Arc::clone(&finished);
            move |msg, terminal| {
                let id = msg.properties().message_id.clone().unwrap_or_default();
                if terminal.is_final() {
                    *finished.lock().unwrap() += 1;
                }
                println!("{} {id} {terminal}", stamp());
            }
        })
        .build()?;
    let plan = consumer.plan().clone();
    transport.provision(&plan).await?;
    let names: Vec<&str> = plan.queues().iter().map(|q| q.name.as_str()).collect();
    println!("{} provisioned {}", stamp(), names.join(", "));

    // Publish the comments the way any producer would.
    let producer = Connection::connect(&url, ConnectionProperties::default()).await?;
    let channel = producer.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for (id, text) in COMMENTS {
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                text.as_bytes(),
                BasicProperties::default()
                    .with_message_id(id.into())
                    .with_delivery_mode(2),
            )
            .await?
            .await?;
        println!("{} {id} published: {text:?}", stamp());
    }

    let done = {
        let finished = Arc::clone(&finished);
        async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            while *finished.lock().unwrap() < COMMENTS.len() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let report = consumer.run(done).await?;
    println!(
        "{} done: {} handled, {} retried, {} parked",
        stamp(),
        report.handled,
        report.retried,
        report.dead_lettered
    );
    if std::env::var_os("KEEP_TOPOLOGY").is_none() {
        transport.teardown(&plan).await?;
    }
    Ok(())
}
