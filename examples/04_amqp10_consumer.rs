//! A retrying consumer over AMQP 1.0 against RabbitMQ 3.x, start to finish.
//!
//! ```sh
//! rabbitmq-plugins enable rabbitmq_amqp1_0
//! cargo run -p examples --example 04_amqp10_consumer
//! ```
//!
//! `AMQP10_URL` (default `amqp://guest:guest@127.0.0.1:5672`) is the AMQP 1.0 side;
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`) the AMQP 0-9-1 side of the
//! same broker. RabbitMQ's AMQP 1.0 plugin cannot declare queues with arguments, so the
//! example declares the topology over AMQP 0-9-1 first, as a deployment would, and the
//! AMQP 1.0 transport verifies it.
//!
//! It publishes five messages over AMQP 1.0 and prints the path of each: `crashed` was held
//! by a consumer that died, so it comes back redelivered, is isolated in the suspect queue
//! and then runs alone; `ok` is handled, `flaky` fails once and comes back after the 1 s
//! delay queue, `poison` fails every time and is parked once its attempts are used up,
//! `bad` fails permanently and is parked at once. Then it reads the parking queue, deletes
//! the topology and exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fe2o3_amqp::types::messaging::{Message as AmqpMessage, Properties};
use fe2o3_amqp::types::primitives::Binary;
use fe2o3_amqp::{Connection, Sender, Session};
use retry_core::{
    Consumer, HandlerError, Message, ParkedRecord, RetryPolicy, Settlement, Subscription, Terminal,
    TopologyPlan, Transport,
};
use tokio::sync::Notify;
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The message a consumer dies holding.
const CRASHED: &str = "crashed";
const MESSAGES: [&str; 4] = ["ok", "flaky", "poison", "bad"];

async fn handle(msg: Message) -> Result<(), HandlerError> {
    let body = String::from_utf8_lossy(msg.body()).into_owned();
    match body.as_str() {
        "ok" | CRASHED => Ok(()),
        "flaky" if msg.headers().get("x-retry-attempts").is_none() => {
            Err(HandlerError::transient("the first try times out"))
        }
        "flaky" => Ok(()),
        "poison" => Err(HandlerError::transient("fails every time")),
        _ => Err(HandlerError::permanent("cannot be parsed")),
    }
}

/// Publishes messages over AMQP 1.0 with fe2o3 directly, as another application would.
async fn publish(url: &str, queue: &str, bodies: &[&str]) -> Result<(), BoxError> {
    let mut connection = Connection::open("amqp10-example-producer", url).await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut sender =
        Sender::attach(&mut session, "producer", format!("/amq/queue/{queue}")).await?;
    for body in bodies {
        let message = AmqpMessage::builder()
            .properties(Properties::builder().message_id((*body).to_owned()).build())
            .data(Binary::from(body.as_bytes().to_vec()))
            .build();
        let outcome = tokio::time::timeout(Duration::from_secs(5), sender.send(message)).await??;
        outcome.accepted_or("publish refused")?;
    }
    // Detach, not close: closing a link misbehaves on RabbitMQ 3.10.
    let _ = sender.detach().await;
    session.end().await?;
    connection.close().await?;
    Ok(())
}

fn describe(msg: &Message, terminal: &Terminal) -> String {
    format!("{:>7}: {terminal}", String::from_utf8_lossy(msg.body()))
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let url10 =
        std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into());
    let url091 = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = format!("amqp10-example-{}", std::process::id());
    let policy = RetryPolicy::delays([Duration::from_secs(1), Duration::from_secs(2)]).build()?;
    let plan = TopologyPlan::new(&queue, &policy)?;

    // 1. Declare over AMQP 0-9-1.
    let setup = AmqpTransport::connect(AmqpConfig::new(url091)).await?;
    setup.provision(&plan).await?;
    println!(
        "declared {} queues for {queue} over AMQP 0-9-1",
        plan.queues().len()
    );

    let outcome = run(&url10, &queue, policy, &plan).await;

    // 6. Clean up, whatever happened.
    setup.teardown(&plan).await?;
    println!("deleted the topology");
    outcome
}

async fn run(
    url10: &str,
    queue: &str,
    policy: RetryPolicy,
    plan: &TopologyPlan,
) -> Result<(), BoxError> {
    // 2. A consumer takes one message and dies without settling it: the broker puts it back,
    //    redelivered. It may have crashed its consumer, or only been there when something
    //    else did.
    publish(url10, queue, &[CRASHED]).await?;
    let doomed = Amqp10Transport::connect(Amqp10Config::new(url10)).await?;
    let subscription = doomed.consume(queue, 1).await?;
    if let Some(held) = subscription.recv().await? {
        println!(
            "a consumer took {:?} and died holding it",
            String::from_utf8_lossy(held.message.body())
        );
    }
    doomed.close().await;

    // 3. Publish the rest over AMQP 1.0.
    publish(url10, queue, &MESSAGES).await?;
    println!("published {MESSAGES:?} over AMQP 1.0");

    // 4. Consume until every message has reached its end, or 30 s at most.
    let transport = Amqp10Transport::connect(Amqp10Config::new(url10)).await?;
    let started = Instant::now();
    let finished = Arc::new(AtomicUsize::new(0));
    let all_done = Arc::new(Notify::new());
    let consumer = Consumer::builder(transport, queue, policy, handle)
        .with_prefetch(10)
        .with_on_terminal({
            let finished = Arc::clone(&finished);
            let all_done = Arc::clone(&all_done);
            move |msg, terminal| {
                println!(
                    "[{:>5} ms] {}",
                    started.elapsed().as_millis(),
                    describe(msg, terminal)
                );
                if terminal.is_final()
                    && finished.fetch_add(1, Ordering::SeqCst) + 1 == MESSAGES.len() + 1
                {
                    all_done.notify_one();
                }
            }
        })
        .build()?;
    let shutdown = async move {
        let _ = tokio::time::timeout(Duration::from_secs(30), all_done.notified()).await;
    };
    let report = consumer.run(shutdown).await?;
    println!("report: {report:?}");

    // 5. Read what was parked, with the reason the engine recorded.
    let reader = Amqp10Transport::connect(Amqp10Config::new(url10)).await?;
    let parking = reader.consume(plan.parking_queue(), 10).await?;
    while let Ok(Ok(Some(parked))) =
        tokio::time::timeout(Duration::from_millis(500), parking.recv()).await
    {
        let record = ParkedRecord::decode(parked.message.headers());
        println!(
            "parked {:?}: reason {:?}, {} attempts, last error {:?}, from {:?}",
            String::from_utf8_lossy(parked.message.body()),
            record.reason.map(|r| r.as_str()),
            record.attempts,
            record.last_error,
            record.origin_queue,
        );
        reader.settle(&parked.tag, Settlement::Ack).await?;
    }
    reader.close().await;
    Ok(())
}
