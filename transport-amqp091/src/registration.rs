//! This transport in a [`Registry`](retry_core::Registry): `amqp://` and `amqps://` URLs.

use retry_core::{DynTransport, Endpoint, Registration};

use crate::{AmqpConfig, AmqpTransport};

/// AMQP 0-9-1 for a [`Registry`](retry_core::Registry): the name `amqp091`, the schemes
/// `amqp` and `amqps` (one URL, or a cluster's nodes separated by commas, as
/// [`AmqpConfig::new`] reads them), TLS settings ([`AmqpConfig::with_tls`]), the client name
/// as the connection's name, and the settings `confirm_timeout`, `connect_timeout` and
/// `request_timeout` as human durations ("30s"). `?auth_mechanism=external` in the URL logs
/// in with the client certificate, as [`AmqpConfig::new`] says.
///
/// ```
/// use retry_core::{ConnectError, ConnectOptions, Registry};
///
/// let registry = Registry::new().with(transport_amqp091::registration());
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let options = ConnectOptions::new().with_setting("confirm_timeout", "soon");
/// let err = registry.connect_with("amqp://127.0.0.1:5672/%2f", options).await.unwrap_err();
/// assert!(matches!(err, ConnectError::BadSetting { key, .. } if key == "confirm_timeout"));
/// # });
/// ```
pub fn registration() -> Registration {
    Registration::new(
        "amqp091",
        "AMQP 0-9-1",
        ["amqp", "amqps"],
        |endpoint: Endpoint| async move {
            let mut config = AmqpConfig::new(endpoint.url());
            if let Some(tls) = endpoint.tls() {
                config = config.with_tls(tls.clone());
            }
            if let Some(name) = endpoint.client_name() {
                config = config.with_connection_name(name);
            }
            if let Some(t) = endpoint.duration_setting("confirm_timeout")? {
                config = config.with_confirm_timeout(t);
            }
            if let Some(t) = endpoint.duration_setting("connect_timeout")? {
                config = config.with_connect_timeout(t);
            }
            if let Some(t) = endpoint.duration_setting("request_timeout")? {
                config = config.with_request_timeout(t);
            }
            Ok(DynTransport::new(AmqpTransport::connect(config).await?))
        },
    )
    .with_tls()
    .with_settings(["confirm_timeout", "connect_timeout", "request_timeout"])
}
