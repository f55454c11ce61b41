//! The deprecated `transport_amqp091::testing` module (feature `testing`) keeps every path it
//! had for one release, each the item of `test_brokers` it names now. Only `delete_blocking`,
//! the one function defined in the module, warns where it is used: Rust reports a module's
//! `#[deprecated]` for the items defined in it, not for its re-exports.

#![allow(deprecated)]

use std::any::TypeId;

use transport_amqp091::testing;

#[test]
fn every_old_path_names_the_moved_item() {
    assert_eq!(testing::REQUIRE_BROKER, test_brokers::REQUIRE_BROKER);
    assert_eq!(testing::REQUIRE_CLUSTER, test_brokers::REQUIRE_CLUSTER);
    assert_eq!(testing::REQUIRE_TLS, test_brokers::REQUIRE_TLS);
    assert_eq!(testing::CLUSTER_URLS, test_brokers::rabbitmq::CLUSTER_URLS);
    same::<testing::LogRecorder, test_brokers::LogRecorder>();
    same::<testing::RawPublisher, test_brokers::rabbitmq::RawPublisher>();
    same::<testing::RawProperties, test_brokers::rabbitmq::RawProperties>();
    same::<testing::RawTable, test_brokers::rabbitmq::RawTable>();
    same::<testing::TlsNode, test_brokers::rabbitmq::TlsNode>();
    same::<testing::ClusterLease, test_brokers::rabbitmq::ClusterLease>();
    // The functions keep their names and signatures.
    let _: fn(&str, &str) = testing::no_broker;
    let _: fn() -> bool = testing::broker_required;
    let _: fn(&str) = testing::print_uncaptured;
    let _: fn(&[&str]) -> String = testing::rabbitmqctl;
    let _: fn(lapin::types::FieldTable) -> lapin::types::FieldTable = testing::refusing;
    let _: fn(&str) -> Option<Vec<String>> = testing::cluster;
    let _: fn(&[&str]) = testing::cluster_sh;
    let _: fn(&[&str]) -> Result<(), String> = testing::try_cluster_sh;
    let _: fn(&str) -> Option<testing::TlsNode> = testing::tls_node;
    let _: fn(&transport_amqp091::AmqpConfig, &[retry_core::TopologyPlan], &[String]) =
        testing::delete_blocking;
}

/// `A` and `B` are the same type.
fn same<A: 'static, B: 'static>() {
    assert_eq!(TypeId::of::<A>(), TypeId::of::<B>());
}

/// `redeclare` too (an `impl FnOnce` argument: it is called here, never run).
async fn _redeclare_keeps_its_signature(
    channel: &lapin::Channel,
    plan: &retry_core::TopologyPlan,
) -> Result<(), lapin::Error> {
    testing::redeclare(channel, plan, "work", testing::refusing).await
}
