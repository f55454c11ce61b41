//! This transport in a [`Registry`](retry_core::Registry): `amqp://` and `amqps://` URLs.

use retry_core::{DynTransport, Endpoint, Registration};

use crate::{AmqpConfig, AmqpTransport};

/// AMQP 0-9-1 for a [`Registry`](retry_core::Registry): the name `amqp091`, the schemes
/// `amqp` and `amqps` (one URL, or a cluster's nodes separated by commas, as
/// [`AmqpConfig::new`] reads them), TLS settings ([`AmqpConfig::with_tls`]), the client name
/// as the connection's name, and these settings:
///
/// * `confirm_timeout`, `connect_timeout` and `request_timeout`, as human durations
///   ("30s"): [`AmqpConfig::with_confirm_timeout`], [`AmqpConfig::with_connect_timeout`] and
///   [`AmqpConfig::with_request_timeout`];
/// * `auto_recover`, `true` (the default) or `false`: [`AmqpConfig::with_auto_recover`]. A
///   tool that runs one command sets it to `false`, so that a lost connection fails the
///   command at once instead of waiting for the broker to come back.
///
/// `?auth_mechanism=external` in the URL logs in with the client certificate, as
/// [`AmqpConfig::new`] says.
///
/// The transport is handed out with [`DynTransport::with_admin`]: its
/// [`Admin`](retry_core::Admin) calls (a queue's depth, applying and checking a plan) reach
/// [`AmqpTransport`], for `retryctl`.
///
/// ```
/// use retry_core::{ConnectError, ConnectOptions, Registry};
///
/// let registry = Registry::new().with(transport_amqp091::registration());
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let options = ConnectOptions::new().with_setting("confirm_timeout", "soon");
/// let err = registry.connect_with("amqp://127.0.0.1:5672/%2f", options).await.unwrap_err();
/// assert!(matches!(err, ConnectError::BadSetting { key, .. } if key == "confirm_timeout"));
/// let options = ConnectOptions::new().with_setting("auto_recover", "no");
/// let err = registry.connect_with("amqp://127.0.0.1:5672/%2f", options).await.unwrap_err();
/// assert!(matches!(err, ConnectError::BadSetting { key, .. } if key == "auto_recover"));
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
            if let Some(on) = endpoint.parse_setting::<bool>("auto_recover")? {
                config = config.with_auto_recover(on);
            }
            Ok(DynTransport::with_admin(
                AmqpTransport::connect(config).await?,
            ))
        },
    )
    .with_tls()
    .with_settings([
        "confirm_timeout",
        "connect_timeout",
        "request_timeout",
        "auto_recover",
    ])
}
