//! How many messages a queue holds, to check that a measurement lost and left nothing.

use std::time::{Duration, Instant};

use lapin::Channel;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;

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
