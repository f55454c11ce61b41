//! The helpers that moved from `transport_nats::testing` to the `test-brokers` crate keep
//! their old paths for one release, each the item of `test_brokers` it names now.

use std::any::TypeId;

use transport_nats::testing;

#[test]
fn every_old_path_names_the_moved_item() {
    assert_eq!(testing::REQUIRE_NATS, test_brokers::REQUIRE_NATS);
    let _: fn() -> String = testing::nats_url;
    let _: fn(&[&[u8]]) -> Vec<u8> = testing::header_block;
    same::<testing::RawPublisher, test_brokers::nats::RawPublisher>();
    same::<testing::PubAck, test_brokers::nats::PubAck>();
    same::<testing::RawPublishError, test_brokers::nats::RawPublishError>();
}

/// `A` and `B` are the same type.
fn same<A: 'static, B: 'static>() {
    assert_eq!(TypeId::of::<A>(), TypeId::of::<B>());
}

/// `publish` too (called here, never run).
async fn _publish_keeps_its_signature(client: &async_nats::Client) {
    testing::publish(client, "orders", "order-1", "body", &[("tenant", "acme")]).await;
}
