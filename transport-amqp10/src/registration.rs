//! This transport in a [`Registry`](retry_core::Registry): `amqp://` and `amqps://` URLs,
//! when AMQP 1.0 is asked for.

use retry_core::{DynTransport, Endpoint, Registration};

use crate::{Amqp10Config, Amqp10Transport};

/// AMQP 1.0 for a [`Registry`](retry_core::Registry): the name `amqp10`, the schemes `amqp`
/// and `amqps`, which AMQP 0-9-1 speaks too: a registry that has both goes to the one
/// registered first, and `ConnectOptions::with_protocol("amqp10")` asks for this one. TLS
/// settings ([`Amqp10Config::with_tls`]), the client name as the container id, and the
/// settings `connect_timeout`, `publish_timeout` and `operation_timeout` as human durations
/// ("10s"). The broker profile is RabbitMQ's ([`BrokerProfile`](crate::BrokerProfile)):
/// another profile needs [`Amqp10Transport::connect`] with a configuration of its own. The
/// transport it connects keeps [`Admin`](retry_core::Admin)
/// ([`DynTransport::with_admin`]): `retryctl` checks a plan and reads parked messages
/// through it.
///
/// ```
/// use retry_core::{ConnectOptions, Registry};
///
/// let registry = Registry::new()
///     .with(transport_amqp10::registration());
/// let chosen = registry.resolve("amqps://broker:5671", Some("amqp10")).unwrap();
/// assert_eq!(chosen.title(), "AMQP 1.0");
/// ```
pub fn registration() -> Registration {
    Registration::new(
        "amqp10",
        "AMQP 1.0",
        ["amqp", "amqps"],
        |endpoint: Endpoint| async move {
            let mut config = Amqp10Config::new(endpoint.url());
            if let Some(tls) = endpoint.tls() {
                config = config.with_tls(tls.clone());
            }
            if let Some(name) = endpoint.client_name() {
                config = config.with_container_id(name);
            }
            if let Some(t) = endpoint.duration_setting("connect_timeout")? {
                config = config.with_connect_timeout(t);
            }
            if let Some(t) = endpoint.duration_setting("publish_timeout")? {
                config = config.with_publish_timeout(t);
            }
            if let Some(t) = endpoint.duration_setting("operation_timeout")? {
                config = config.with_operation_timeout(t);
            }
            Ok(DynTransport::with_admin(
                Amqp10Transport::connect(config).await?,
            ))
        },
    )
    .with_tls()
    .with_settings(["connect_timeout", "publish_timeout", "operation_timeout"])
}
