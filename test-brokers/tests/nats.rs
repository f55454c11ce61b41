//! The `nats` helpers on the local NATS server (`NATS_URL`): test messages published and
//! read back, header bytes published raw, streams deleted. Without a server these tests
//! skip loudly, and with `REQUIRE_NATS=1` they fail.

#![cfg(feature = "nats")]

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use test_brokers::{nats, nats_url, unique};

/// A client and a stream of its own capturing the subject `name`, or `None` after the skip.
async fn stream_of_its_own(
    what: &str,
    name: &str,
) -> Option<(async_nats::Client, jetstream::Context)> {
    let client = match async_nats::connect(nats_url()).await {
        Ok(client) => client,
        Err(e) => {
            test_brokers::no_nats(what, &e.to_string());
            return None;
        }
    };
    let js = jetstream::new(client.clone());
    let config = stream::Config {
        name: name.to_owned(),
        subjects: vec![name.to_owned()],
        ..stream::Config::default()
    };
    if let Err(e) = js.create_stream(config).await {
        test_brokers::no_nats(what, &format!("no JetStream: {e}"));
        return None;
    }
    Some((client, js))
}

#[tokio::test]
async fn messages_are_published_read_back_and_their_stream_deleted() {
    let name = unique("tb-nats");
    let Some((client, js)) = stream_of_its_own("test-brokers' NATS helpers", &name).await else {
        return;
    };
    nats::publish(&client, &name, "m-1", "body", &[("tenant", "acme")]).await;
    let block = nats::header_block(&[b"tenant: ac\xffme"]);
    let url = nats_url();
    let subject = name.clone();
    let ack = tokio::task::spawn_blocking(move || {
        let mut raw = nats::RawPublisher::connect(&url)?;
        raw.publish(&subject, &block, b"raw")
    })
    .await
    .unwrap()
    .expect("stored");
    assert_eq!(
        (ack.stream.as_str(), ack.sequence, ack.duplicate),
        (name.as_str(), 2, false)
    );

    let mut stream = js.get_stream(&name).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 2);
    let first = stream.get_raw_message(1).await.unwrap();
    let headers = first.headers;
    assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), Some("m-1"));

    let names = vec![name.clone()];
    tokio::task::spawn_blocking(move || nats::delete_streams_blocking(&nats_url(), &names))
        .await
        .unwrap();
    let gone = tokio::time::timeout(Duration::from_secs(5), js.get_stream(&name)).await;
    assert!(matches!(gone, Ok(Err(_))), "the stream is still there");
}
