//! Test messages into streams, and streams deleted by name, through async-nats.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::message::PublishMessage;

use crate::wait::on_own_thread;

/// Publishes `body` to `subject` as a NATS application would: `id` as its `Nats-Msg-Id`,
/// `headers` as they are, the stream's acknowledgement awaited. Panics if no stream stores
/// it.
pub async fn publish(
    client: &async_nats::Client,
    subject: &str,
    id: &str,
    body: &str,
    headers: &[(&str, &str)],
) {
    let js = async_nats::jetstream::new(client.clone());
    let mut map = HeaderMap::new();
    map.insert("Nats-Msg-Id", id);
    for (name, value) in headers {
        map.insert(*name, *value);
    }
    let message = PublishMessage::build()
        .payload(body.to_owned().into())
        .headers(map);
    js.send_publish(subject.to_owned(), message)
        .await
        .expect("publish a test message")
        .await
        .unwrap_or_else(|e| panic!("the stream of {subject} acknowledges {id}: {e}"));
}

/// Deletes the streams `names`; a stream that is not there (or any other error) is passed
/// over: cleaning up must not fail a test.
pub async fn delete_streams<S: AsRef<str>>(
    client: &async_nats::Client,
    names: impl IntoIterator<Item = S>,
) {
    let js = async_nats::jetstream::new(client.clone());
    for name in names {
        let _ = js.delete_stream(name.as_ref()).await;
    }
}

/// [`delete_streams`] on the server at `url`, on a thread of its own with a runtime of its
/// own, returning when that is done: for a guard's `Drop`, which is synchronous and may run
/// inside the test's runtime or while it unwinds from a panic. Connecting waits at most 10 s.
///
/// ```no_run
/// struct Cleanup(Vec<String>);
///
/// impl Drop for Cleanup {
///     fn drop(&mut self) {
///         test_brokers::nats::delete_streams_blocking(&test_brokers::nats_url(), &self.0);
///     }
/// }
/// ```
pub fn delete_streams_blocking(url: &str, names: &[String]) {
    let (url, names) = (url.to_owned(), names.to_vec());
    on_own_thread(async move {
        let connecting = async_nats::connect(url);
        if let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(10), connecting).await {
            delete_streams(&client, &names).await;
            let _ = client.drain().await;
        }
    });
}
