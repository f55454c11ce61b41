//! This transport in a [`Registry`](retry_core::Registry): `nats://` and `tls://` URLs.

use retry_core::{DynTransport, Endpoint, Registration};

use crate::{NatsConfig, NatsLayout, NatsTransport};

/// NATS JetStream for a [`Registry`](retry_core::Registry): the name `nats`, the schemes
/// `nats` and `tls` (one server, or several separated by commas, as [`NatsConfig::new`]
/// reads them; `tls://` trusts the platform's roots), the client name as the connection's
/// name, and the settings `replicas` (each stream of a plan kept on that many servers),
/// `ack_wait`, `publish_timeout` and `operation_timeout` (human durations, "30s"). TLS
/// settings of a [`TlsConfig`](retry_core::TlsConfig) are refused: NATS takes its TLS from
/// the URL. The transport it connects keeps [`Admin`](retry_core::Admin)
/// ([`DynTransport::with_admin`]), and plans are laid out by [`NatsLayout`].
///
/// ```
/// use retry_core::{ConnectError, ConnectOptions, Registry};
///
/// let registry = Registry::new().with(transport_nats::registration());
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let options = ConnectOptions::new().with_setting("replicas", "three");
/// let err = registry.connect_with("nats://127.0.0.1:4222", options).await.unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "setting replicas = \"three\" of NATS JetStream: invalid digit found in string"
/// );
/// # });
/// ```
pub fn registration() -> Registration {
    Registration::new(
        "nats",
        "NATS JetStream",
        ["nats", "tls"],
        |endpoint: Endpoint| async move {
            let mut config = NatsConfig::new(endpoint.url());
            if let Some(name) = endpoint.client_name() {
                config = config.with_name(name);
            }
            if let Some(replicas) = endpoint.parse_setting::<usize>("replicas")? {
                config = config.with_replicas(replicas);
            }
            if let Some(t) = endpoint.duration_setting("ack_wait")? {
                config = config.with_ack_wait(t);
            }
            if let Some(t) = endpoint.duration_setting("publish_timeout")? {
                config = config.with_publish_timeout(t);
            }
            if let Some(t) = endpoint.duration_setting("operation_timeout")? {
                config = config.with_operation_timeout(t);
            }
            Ok(DynTransport::with_admin(
                NatsTransport::connect(config).await?,
            ))
        },
    )
    .with_settings([
        "replicas",
        "ack_wait",
        "publish_timeout",
        "operation_timeout",
    ])
    .with_layout(NatsLayout)
}
