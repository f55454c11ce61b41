//! NATS JetStream: `NatsTransport` under test, plain async-nats as its baselines. Each queue
//! of a plan is a stream (file storage, one replica) with the durable pull consumer
//! `retry-engine`; the plan is provisioned by a transport that is closed again before
//! anything is measured, so that its delay mover does not run beside the plain loops.
//!
//! | path | what runs |
//! |---|---|
//! | `nats-fetch` | success: a loop of pulls of 100 (`consumer.batch().max_messages(100)`, one pull request at a time), `ack` each message as it arrives (a publish to its ack subject, not waiting for the server: acks pipeline) |
//! | `nats-stream` | success: async-nats' continuous pull (`consumer.stream().max_messages_per_batch(100)`, which asks for the next batch before the current one is used up), `ack` each |
//! | `nats-retry` | retry: the continuous pull; per message a clone (the body, `x-retry-attempts` and `x-retry-delay` headers, the delay stream as the expected stream) published to the delay stream's subject, the original acked once the clone's PubAck is in; up to the prefetch at once |
//!
//! Ours on the retry path runs the transport's delay mover as production does: it pulls each
//! clone and naks it with the time it has left, which a plain loop that only stores its
//! clones does not pay.
//!
//! The floor of the `lateness` binary ([`Subject::floor`]) is the server's own delay: a nak
//! with a delay (see [`Nats::FLOOR`], and what the server does to it there). Its plain
//! client in the `first_delivery` binary is async-nats: connection, the work stream's
//! durable consumer, a continuous pull, the first message. `NATS_URL` picks the server.

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind, Context};
use bench_support::proc::NATS;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retry_core::{TopologyPlan, Transport};
use transport_nats::{CONSUMER, NatsConfig, NatsTransport, stream_name};

use crate::lateness::{Clock, Lateness, Trial, floor_delay};
use crate::{BoxError, Measured, Meter, Peer, Run, SETTLING, Side, Subject};

/// Publishes in flight while prefilling.
const PREFILL_IN_FLIGHT: usize = 1_000;
/// Messages per pull of the plain loops.
const BATCH: usize = 100;

/// NATS JetStream.
pub struct Nats {
    client: async_nats::Client,
    js: Context,
}

/// `NATS_URL`, or the local server.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

const PEERS: [Peer; 3] = [
    Peer {
        path: "nats-fetch",
        label: "async-nats fetch",
        side: Side::Success,
        legend: "plain async-nats, pulls of 100 one after the other, ack each",
    },
    Peer {
        path: "nats-stream",
        label: "async-nats stream",
        side: Side::Success,
        legend: "plain async-nats, continuous pull of 100, ack each",
    },
    Peer {
        path: "nats-retry",
        label: "async-nats retry",
        side: Side::Retry,
        legend: "plain async-nats, clone to the delay stream, PubAck, then ack; up to prefetch at once",
    },
];

impl Nats {
    /// The measurement's own connection, and the work stream's durable consumer through it.
    async fn consumer(
        queue: &str,
    ) -> Result<(async_nats::Client, Context, PullConsumer), BoxError> {
        let client = async_nats::connect(nats_url()).await?;
        let js = jetstream::new(client.clone());
        let consumer: PullConsumer = js
            .get_stream(stream_name(queue))
            .await?
            .get_consumer(CONSUMER)
            .await?;
        Ok((client, js, consumer))
    }

    /// Publishes one message with `payload` and the message id `id` to `queue`'s subject,
    /// expecting its `stream`; returns the PubAck to come.
    async fn send(
        &self,
        queue: &str,
        stream: &str,
        payload: &Bytes,
        id: &str,
    ) -> Result<jetstream::context::PublishAckFuture, BoxError> {
        let mut headers = HeaderMap::new();
        headers.insert("message-id", id);
        let message = PublishMessage::build()
            .payload(payload.clone())
            .headers(headers)
            .expected_stream(stream);
        Ok(self.js.send_publish(queue.to_owned(), message).await?)
    }
}

impl Subject for Nats {
    type Transport = NatsTransport;
    const NAME: &'static str = "nats";
    const SERVER: &'static str = NATS;
    const PLAIN: &'static str = "async-nats";

    async fn open() -> Result<Self, BoxError> {
        let client = async_nats::connect(nats_url()).await?;
        let js = jetstream::new(client.clone());
        Ok(Nats { client, js })
    }

    async fn connect(&self) -> Result<NatsTransport, BoxError> {
        Ok(NatsTransport::connect(NatsConfig::new(nats_url())).await?)
    }

    async fn declare(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        // Closed again, so that its delay mover does not run beside what is measured.
        let setup = self.connect().await?;
        let provisioned = setup.provision(plan).await;
        setup.close().await;
        Ok(provisioned?)
    }

    async fn prefill(&self, queue: &str, n: u64, body: usize) -> Result<(), BoxError> {
        let stream = stream_name(queue);
        let payload = Bytes::from(vec![b'x'; body]);
        let mut acks = FuturesUnordered::new();
        for i in 0..n {
            if acks.len() >= PREFILL_IN_FLIGHT
                && let Some(ack) = acks.next().await
            {
                let _: jetstream::publish::PublishAck = ack?;
            }
            let ack = self
                .send(queue, &stream, &payload, &format!("m{i}"))
                .await?;
            acks.push(ack.into_future());
        }
        while let Some(ack) = acks.next().await {
            ack?;
        }
        Ok(())
    }

    async fn publish_paced(
        &self,
        queue: &str,
        ids: Vec<u64>,
        body: &[u8],
        rate: f64,
    ) -> Result<(), BoxError> {
        let stream = stream_name(queue);
        let payload = Bytes::copy_from_slice(body);
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
        let mut acks = FuturesUnordered::new();
        for i in ids {
            tick.tick().await;
            let ack = self.send(queue, &stream, &payload, &i.to_string()).await?;
            acks.push(ack.into_future());
            // Collect what is in without waiting.
            while let Some(Some(ack)) = futures::FutureExt::now_or_never(acks.next()) {
                ack?;
            }
        }
        while let Some(ack) = acks.next().await {
            ack?;
        }
        Ok(())
    }

    async fn count(&self, queue: &str, expected: u64) -> Result<u64, BoxError> {
        let deadline = tokio::time::Instant::now() + SETTLING;
        loop {
            let count = self
                .js
                .get_stream(stream_name(queue))
                .await?
                .info()
                .await?
                .state
                .messages;
            if count == expected || tokio::time::Instant::now() >= deadline {
                return Ok(count);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn delete(&self, plan: &TopologyPlan) -> Result<(), BoxError> {
        for q in plan.queues() {
            // A stream that was never made is not an error here.
            let _ = self.js.delete_stream(stream_name(&q.name)).await;
        }
        self.client.flush().await?;
        Ok(())
    }

    fn peers() -> &'static [Peer] {
        &PEERS
    }

    async fn peer(&self, path: &str, run: &Run<'_>) -> Result<(Measured, String), BoxError> {
        let (queue, n) = (run.queue(), run.n);
        let delay_queue = run.delay_queue()?.to_owned();
        let measured = match path {
            "nats-fetch" => success(queue, n, false).await?,
            "nats-stream" => success(queue, n, true).await?,
            "nats-retry" => {
                let delay = run.policy.delay_levels().first().copied();
                let delay = delay.ok_or("the policy has no delay")?;
                retry(queue, &delay_queue, delay, n, usize::from(run.prefetch)).await?
            }
            other => return Err(crate::unknown_path::<Self>(other)),
        };
        Ok((measured, delay_queue))
    }

    /// The server's own delay: a plain async-nats continuous pull (batches of the
    /// prefetch) on the work stream's durable consumer, on a connection of its own, naks
    /// each first delivery with its delay (`AckKind::Nak(Some(delay))`, which the server
    /// holds and hands out again then) and acks the second; with jitter, each message's
    /// delay is drawn by [`floor_delay`].
    ///
    /// **What the server does to this floor.** A nak with a delay resets the consumer's
    /// pending timer, the one that hands delayed messages back, to 10 ms (`processNak` in
    /// nats-server 2.9.10's `server/consumer.go`, and still so on its main branch): while
    /// naks reach one consumer more often than every 10 ms, that timer never fires, and
    /// every delayed message waits until the naks pause: at 500 msg/s this floor's p99 is
    /// about 3 s (docs/benchmarks.md). Ours is not held up by it: the transport's delay
    /// mover naks only clones more than its horizon from due and holds the rest itself.
    const FLOOR: &'static str = "plain async-nats, nak with the delay";
    const FLOOR_JITTERS: bool = true;

    async fn floor(&self, trial: &Trial<'_>) -> Result<Lateness, BoxError> {
        let (work, base) = (trial.queue(), trial.delay()?);
        let (client, _js, consumer) = Nats::consumer(work).await?;
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(usize::from(trial.prefetch))
            .messages()
            .await?;
        let mut clock = Clock::default();
        let consume = async {
            let mut second_runs = 0;
            while second_runs < trial.n {
                let m = messages.next().await.ok_or("the pull ended early")??;
                let id = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("message-id"))
                    .map(|v| v.as_str().to_owned());
                let delay = floor_delay(id.as_deref().unwrap_or_default(), base, trial.jitter);
                if m.info()?.delivered > 1 {
                    clock.returned(id.as_deref(), delay);
                    second_runs += 1;
                    m.ack().await?;
                } else {
                    clock.failed(id.as_deref());
                    m.ack_with(AckKind::Nak(Some(delay))).await?;
                }
            }
            Ok::<_, BoxError>(())
        };
        let feed = self.publish_paced(work, trial.ids(), trial.body, trial.rate);
        // A failed publisher ends the measurement rather than leaving the pull waiting.
        tokio::try_join!(feed, consume)?;
        client.flush().await?;
        Ok(clock.finish())
    }

    async fn plain_first_delivery(&self, queue: &str) -> Result<Duration, BoxError> {
        let start = Instant::now();
        let (client, _js, consumer) = Nats::consumer(queue).await?;
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(BATCH)
            .messages()
            .await?;
        let message = messages
            .next()
            .await
            .ok_or("the pull ended before a message")??;
        let first = start.elapsed();
        message.ack().await?;
        client.flush().await?;
        Ok(first)
    }
}

/// Success path: pulls of [`BATCH`] one after the other (`stream`: async-nats' continuous
/// pull), `ack` each message as it arrives.
async fn success(queue: &str, n: u64, stream: bool) -> Result<Measured, BoxError> {
    let (client, _js, consumer) = Nats::consumer(queue).await?;
    let meter = Meter::start(NATS);
    let mut done = 0;
    if stream {
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(BATCH)
            .messages()
            .await?;
        while done < n {
            let message = messages.next().await.ok_or("the pull ended early")??;
            meter.first();
            message.ack().await?;
            done += 1;
        }
    } else {
        while done < n {
            let mut batch = consumer
                .batch()
                .max_messages(BATCH)
                .expires(Duration::from_secs(1))
                .messages()
                .await?;
            while let Some(message) = batch.next().await {
                let message = message?;
                meter.first();
                message.ack().await?;
                done += 1;
            }
        }
    }
    client.flush().await?;
    Ok(meter.stop())
}

/// Retry path: per message, publish a clone to the delay stream's subject and ack the
/// original once the clone's PubAck is in; up to `in_flight` at once.
async fn retry(
    queue: &str,
    delay_queue: &str,
    delay: Duration,
    n: u64,
    window: usize,
) -> Result<Measured, BoxError> {
    let (client, js, consumer) = Nats::consumer(queue).await?;
    let delay_stream = stream_name(delay_queue);
    let delay_ms = delay.as_millis().to_string();
    let meter = Meter::start(NATS);
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(BATCH)
        .messages()
        .await?;
    let (mut received, mut done) = (0, 0);
    let mut in_flight = FuturesUnordered::new();
    while done < n {
        tokio::select! {
            Some((message, acked)) = in_flight.next(), if !in_flight.is_empty() => {
                let _: jetstream::publish::PublishAck = acked?;
                let message: jetstream::Message = message;
                message.ack().await?;
                done += 1;
            }
            message = messages.next(), if received < n && in_flight.len() < window => {
                let message = message.ok_or("the pull ended early")??;
                meter.first();
                received += 1;
                let mut headers = message.headers.clone().unwrap_or_default();
                headers.insert("x-retry-attempts", "~i:1");
                headers.insert("x-retry-delay", delay_ms.as_str());
                let clone = PublishMessage::build()
                    .payload(message.payload.clone())
                    .headers(headers)
                    .expected_stream(delay_stream.as_str());
                let ack = js.send_publish(delay_queue.to_owned(), clone).await?;
                in_flight.push(async move { (message, ack.await) });
            }
        }
    }
    client.flush().await?;
    Ok(meter.stop())
}
