//! The broker's URLs, from the environment or the local broker's defaults.

/// `AMQP_URL` (AMQP 0-9-1), or the local broker as guest on the default vhost.
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// `AMQP10_URL` (AMQP 1.0), or the local broker as guest.
pub fn amqp10_url() -> String {
    std::env::var("AMQP10_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".into())
}
