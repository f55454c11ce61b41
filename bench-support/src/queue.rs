//! How many messages a queue holds, to check that a measurement lost and left nothing (the
//! tests' own counts, from test-brokers); and the plain lapin walk of a queue, the baseline of
//! the parking lot's and the console's walks.

use lapin::Connection;
use lapin::options::BasicGetOptions;

use crate::BoxError;

pub use test_brokers::rabbitmq::{message_count, wait_for_count};

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
