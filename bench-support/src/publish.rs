//! Publishing over AMQP 0-9-1 with publisher confirms: prefilling a queue before a
//! measurement, and publishing at a steady rate during one.

use std::time::Duration;

use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Connection};

use crate::BoxError;

pub use test_brokers::rabbitmq::confirm_channel;

/// How many publishes [`prefill`] has in flight before it awaits their confirms.
pub const CONFIRM_BATCH: usize = 1_000;

/// Properties of a persistent message (delivery mode 2), to build on.
pub fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Publishes `n` messages to `queue` through the default exchange on `channel`, which is
/// in confirm mode; `message(i)` gives the body and properties of message `i` (from 0).
/// Confirms are awaited [`CONFIRM_BATCH`] at a time; a negative one is an error.
///
/// ```no_run
/// # async fn f(channel: lapin::Channel) -> Result<(), bench_support::BoxError> {
/// use bench_support::publish::{persistent, prefill};
///
/// // 20,000 persistent 256-byte messages.
/// prefill(&channel, "work", 20_000, |_| ([b'x'; 256], persistent())).await?;
/// # Ok(()) }
/// ```
pub async fn prefill<B: AsRef<[u8]>>(
    channel: &Channel,
    queue: &str,
    n: u64,
    mut message: impl FnMut(u64) -> (B, BasicProperties),
) -> Result<(), BoxError> {
    let mut confirms = Vec::with_capacity(CONFIRM_BATCH);
    for i in 0..n {
        let (body, properties) = message(i);
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body.as_ref(),
                    properties,
                )
                .await?,
        );
        if confirms.len() == CONFIRM_BATCH || i + 1 == n {
            for confirm in confirms.drain(..) {
                if !confirm.await?.is_ack() {
                    return Err(
                        format!("a message prefilled into {queue} was not confirmed").into(),
                    );
                }
            }
        }
    }
    Ok(())
}

/// Publishes one persistent message with `body` per id of `ids`, message id the id, at
/// `rate` per second on a confirm channel of its own; returns once all are confirmed.
pub async fn publish_paced(
    conn: &Connection,
    queue: &str,
    ids: impl IntoIterator<Item = u64>,
    body: &[u8],
    rate: f64,
) -> Result<(), BoxError> {
    let ch = confirm_channel(conn).await?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    for i in ids {
        tick.tick().await;
        // Dropped confirms are collected by wait_for_confirms below.
        drop(
            ch.basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body,
                persistent().with_message_id(i.to_string().into()),
            )
            .await?,
        );
    }
    ch.wait_for_confirms().await?;
    ch.close(200, "published".into()).await?;
    Ok(())
}
