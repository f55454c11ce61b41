//! A consumer process that dies on a poison message.
//!
//! `crashing_consumer QUEUE POISON_IDS RECORD_FILE CRASH_LIMIT DELAY_MS PREFETCH` runs the
//! real `Consumer` on transport-amqp091 (broker at `AMQP_URL`, the local RabbitMQ by
//! default), or, with `CRASHING_TRANSPORT=nats`, on transport-nats (server at `NATS_URL`,
//! with the NATS tests' short ack wait). Its handler appends a `run` line to the record and, when the message id is one
//! of the comma-separated `POISON_IDS`, calls `std::process::abort()`: the delivery was
//! received and is still unsettled, so the broker hands it out again, flagged redelivered,
//! with everything else the process held. Other messages take 10 ms, so with a prefetch
//! above one several are in flight when a poison strikes, and append a `succeeded` line.
//! Every settled delivery appends a `terminal` line. The process stops cleanly when its
//! standard input closes.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use conformance::rabbitmq::{BrokerEnv, runtime, unique_name};
use retry_core::{Consumer, HandlerError, Message, Transport};
use stress::process::{Event, ProcessArgs, append, encode_terminal};
use transport_amqp091::{AmqpConfig, AmqpTransport};
use transport_nats::NatsTransport;

fn message_id(msg: &Message) -> String {
    msg.properties().message_id.clone().unwrap_or_default()
}

fn main() -> ExitCode {
    let args = match ProcessArgs::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match runtime().block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crashing_consumer: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: ProcessArgs) -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var("CRASHING_TRANSPORT").as_deref() == Ok("nats") {
        let config = conformance::nats::test_config(&conformance::nats::nats_url());
        let transport = Arc::new(NatsTransport::connect(config).await?);
        consume(Arc::clone(&transport), args).await?;
        transport.close().await;
        return Ok(());
    }
    let env = BrokerEnv::from_env();
    let transport = AmqpTransport::connect(
        AmqpConfig::new(&env.amqp091_url).with_connection_name(unique_name("crashing")),
    )
    .await?;
    let transport = Arc::new(transport);
    consume(Arc::clone(&transport), args).await?;
    AmqpTransport::close(&transport).await?;
    Ok(())
}

/// Runs the consumer on `transport` until standard input closes.
async fn consume<T: Transport>(
    transport: Arc<T>,
    args: ProcessArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    let (record, poison) = (args.record.clone(), args.poison.clone());
    let isolation = format!("{}.suspect", args.queue);
    let handler = move |msg: Message| {
        let id = message_id(&msg);
        let written = append(
            &record,
            &Event::Run {
                id: id.clone(),
                attempt: msg.attempt(),
                alone: msg.queue() == isolation,
            },
        );
        let is_poison = poison.contains(&id);
        let (record, attempt) = (record.clone(), msg.attempt());
        async move {
            written.map_err(HandlerError::transient)?;
            if is_poison {
                std::process::abort();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            append(&record, &Event::Succeeded { id, attempt }).map_err(HandlerError::transient)
        }
    };
    let record = args.record.clone();
    let consumer = Consumer::builder(transport, args.queue.clone(), args.policy(), handler)
        .with_prefetch(args.prefetch)
        .with_handler_timeout(Duration::from_secs(10))
        .with_shutdown_grace(Duration::from_secs(5))
        .with_suspect_poll(Duration::from_millis(100))
        .with_on_terminal(move |msg, terminal| {
            let event = Event::Terminal {
                id: message_id(msg),
                outcome: encode_terminal(terminal),
            };
            if let Err(e) = append(&record, &event) {
                eprintln!("crashing_consumer: cannot write the record: {e}");
            }
        })
        .build()?;

    // Standard input closing is the signal to stop; reading it blocks, so on a thread.
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        let _ = closed_tx.send(());
    });
    consumer
        .run(async move {
            let _ = closed_rx.await;
        })
        .await?;
    Ok(())
}
