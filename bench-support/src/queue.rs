//! How many messages a queue holds, to check that a measurement lost and left nothing; and
//! the plain lapin walk of a queue, the baseline of the parking lot's and the console's walks.

use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::BoxError;

/// The messages ready in `queue` (a passive declare on `channel`).
pub async fn message_count(channel: &Channel, queue: &str) -> Result<u32, BoxError> {
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(declared.message_count())
}

/// The messages ready in `queue`, asked every 50 ms until there are `expected` or `within`
/// has passed (the broker handles settlements and the end of a connection asynchronously).
pub async fn wait_for_count(
    channel: &Channel,
    queue: &str,
    expected: u32,
    within: Duration,
) -> Result<u32, BoxError> {
    let deadline = Instant::now() + within;
    loop {
        let count = message_count(channel, queue).await?;
        if count == expected || Instant::now() >= deadline {
            return Ok(count);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The plain lapin walk a user would write to look at every message of `queue` and leave
/// it: `basic.get` each one without acknowledging it, then close the channel, which puts
/// them all back at once (a `basic.nack` with `multiple` would take RabbitMQ 3.10 quadratic
/// time). Returns how many it read.
pub async fn plain_walk(conn: &Connection, queue: &str) -> Result<u64, BoxError> {
    let ch = conn.create_channel().await?;
    let mut n = 0;
    while ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await?
        .is_some()
    {
        n += 1;
    }
    ch.close(200, "walked".into()).await?;
    Ok(n)
}
