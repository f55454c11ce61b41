//! What the delay benchmarks (`lateness`, `delay_accuracy`) share: the broker's URL, the
//! machine's load, a paced publisher and percentiles. Included by each with `#[path]`.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `AMQP_URL`, or the local broker.
pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The one-minute load average, for the table's notes.
pub fn load1() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Publishes one persistent message with `body` per id of `ids`, message id the id, at
/// `rate` per second with confirms; returns once all are confirmed.
pub async fn publish_paced(
    conn: &Connection,
    queue: &str,
    ids: impl IntoIterator<Item = u64>,
    body: &[u8],
    rate: f64,
) -> Result<(), BoxError> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
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
                BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(i.to_string().into()),
            )
            .await?,
        );
    }
    ch.wait_for_confirms().await?;
    ch.close(200, "published".into()).await?;
    Ok(())
}

/// p50, p99 and max of `values` (not empty).
pub fn percentiles(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let at =
        |q: f64| values[((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1];
    (at(0.50), at(0.99), values[values.len() - 1])
}
