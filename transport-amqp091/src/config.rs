//! Connection settings, with the password kept out of every log line and error.

use std::fmt;
use std::time::Duration;

/// How to reach the broker and how long to wait for it.
///
/// `Debug` and [`redacted_url`](Self::redacted_url) never show the password.
///
/// ```
/// use transport_amqp091::AmqpConfig;
/// use std::time::Duration;
///
/// let config = AmqpConfig::new("amqp://app:s3cret@127.0.0.1:5672/%2f")
///     .with_confirm_timeout(Duration::from_secs(10))
///     .with_connection_name("orders-consumer");
/// assert_eq!(config.redacted_url(), "amqp://app:****@127.0.0.1:5672/%2f");
/// assert!(!format!("{config:?}").contains("s3cret"));
/// ```
#[derive(Clone)]
pub struct AmqpConfig {
    url: String,
    confirm_timeout: Duration,
    connection_name: Option<String>,
    ack_flush_interval: Duration,
    auto_recover: bool,
}

impl AmqpConfig {
    /// Settings for `url` (`amqp://` or `amqps://`), with the defaults: a 30 s confirm
    /// timeout, acks flushed at least every 20 ms, automatic recovery on.
    pub fn new(url: impl Into<String>) -> Self {
        AmqpConfig {
            url: url.into(),
            confirm_timeout: Duration::from_secs(30),
            connection_name: None,
            ack_flush_interval: Duration::from_millis(20),
            auto_recover: true,
        }
    }

    /// How long a publish may wait for the broker's confirm before it counts as failed (and
    /// the original is requeued).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// The connection name the broker shows (and `rabbitmqctl list_connections` prints).
    pub fn with_connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// The longest an acknowledgement waits to be batched with others.
    pub fn with_ack_flush_interval(mut self, interval: Duration) -> Self {
        self.ack_flush_interval = interval;
        self
    }

    /// Whether to reconnect by itself when the connection drops (on by default).
    pub fn with_auto_recover(mut self, on: bool) -> Self {
        self.auto_recover = on;
        self
    }

    /// The confirm timeout.
    pub fn confirm_timeout(&self) -> Duration {
        self.confirm_timeout
    }

    /// The connection name, if set.
    pub fn connection_name(&self) -> Option<&str> {
        self.connection_name.as_deref()
    }

    /// The ack flush interval.
    pub fn ack_flush_interval(&self) -> Duration {
        self.ack_flush_interval
    }

    /// Whether automatic recovery is on.
    pub fn auto_recover(&self) -> bool {
        self.auto_recover
    }

    /// The URL with its password replaced by `****`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }
}

impl fmt::Debug for AmqpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AmqpConfig")
            .field("url", &self.redacted_url())
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connection_name", &self.connection_name)
            .field("ack_flush_interval", &self.ack_flush_interval)
            .field("auto_recover", &self.auto_recover)
            .finish()
    }
}

/// `url` with the password of its user-info replaced by `****`.
pub(crate) fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let user = userinfo.split(':').next().unwrap_or("");
    if !userinfo.contains(':') {
        return url.to_owned();
    }
    format!("{}{}:****{}", &url[..scheme_end], user, &rest[at..])
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_are_redacted() {
        let table = [
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "amqp://guest:****@127.0.0.1:5672/%2f",
            ),
            (
                "amqps://u:p%40ss@host/vh?heartbeat=5",
                "amqps://u:****@host/vh?heartbeat=5",
            ),
            ("amqp://u:a@b@host", "amqp://u:****@host"),
            ("amqp://127.0.0.1", "amqp://127.0.0.1"),
            ("amqp://user@host", "amqp://user@host"),
            ("not a url", "not a url"),
        ];
        for (url, want) in table {
            assert_eq!(redact(url), want);
        }
    }
}
