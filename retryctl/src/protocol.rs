//! Which protocol, and so which transport, a command speaks to the broker: chosen from
//! `--protocol` and the URL's scheme. A new transport adds a variant, its schemes in
//! [`SCHEMES`], and an arm where the commands dispatch on [`Protocol`].
//!
//! `nats://` and `tls://` speak NATS JetStream (transport-nats); `amqp://` and `amqps://`
//! AMQP 0-9-1, or AMQP 1.0 when asked.

use std::fmt;

use clap::ValueEnum;
use retry_core::TransportError;
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_nats::{NatsConfig, NatsTransport};

use crate::error::CliError;

/// The protocols `retryctl` speaks (`--protocol`). (Plain comments on the variants: a doc
/// comment would turn `--help` into clap's long form.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Protocol {
    // AMQP 0-9-1, through transport-amqp091: every command.
    #[value(name = "amqp091")]
    Amqp091,
    // AMQP 1.0 (RabbitMQ's plugin), through transport-amqp10: `parked`, and `topology
    // verify` without probes.
    #[value(name = "amqp10")]
    Amqp10,
    // NATS JetStream, through transport-nats: `parked`, `topology apply` and `topology
    // verify` without probes.
    #[value(name = "nats")]
    Nats,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Amqp091 => "AMQP 0-9-1",
            Protocol::Amqp10 => "AMQP 1.0",
            Protocol::Nats => "NATS JetStream",
        })
    }
}

/// Each URL scheme and the protocols that speak it, the first being the one used when
/// `--protocol` is not given.
const SCHEMES: &[(&str, &[Protocol])] = &[
    ("amqp", &[Protocol::Amqp091, Protocol::Amqp10]),
    ("amqps", &[Protocol::Amqp091, Protocol::Amqp10]),
    ("nats", &[Protocol::Nats]),
    ("tls", &[Protocol::Nats]),
];

impl Protocol {
    /// Its `--protocol` value.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Amqp091 => "amqp091",
            Protocol::Amqp10 => "amqp10",
            Protocol::Nats => "nats",
        }
    }

    /// The protocol for `url` (one URL, or several separated by commas): `asked` when every
    /// URL's scheme is one it speaks, else the scheme's first protocol. A scheme no protocol
    /// speaks, or one `asked` does not, is a usage error naming it and the accepted ones.
    pub fn for_url(asked: Option<Protocol>, url: &str) -> Result<Protocol, CliError> {
        let mut chosen = None;
        for node in url.split(',').map(str::trim) {
            let scheme = node.split_once("://").map_or("", |(s, _)| s);
            let Some((_, speakers)) = SCHEMES
                .iter()
                .find(|(known, _)| known.eq_ignore_ascii_case(scheme))
            else {
                let named = if scheme.is_empty() {
                    "a URL without a scheme".to_owned()
                } else {
                    format!("URL scheme {:?}", format!("{scheme}://"))
                };
                return Err(CliError::usage(format!(
                    "{named} in --url (or AMQP_URL): retryctl accepts {}",
                    accepted()
                )));
            };
            let protocol = match asked {
                Some(p) if speakers.contains(&p) => p,
                Some(p) => {
                    return Err(CliError::usage(format!(
                        "--protocol {} does not speak {scheme}:// URLs: retryctl accepts {}",
                        p.name(),
                        accepted()
                    )));
                }
                None => speakers[0],
            };
            if chosen.is_some_and(|c| c != protocol) {
                return Err(CliError::usage(
                    "the URLs of --url call for different protocols: list the nodes of one broker",
                ));
            }
            chosen = Some(protocol);
        }
        chosen.ok_or_else(|| CliError::usage("--url is empty"))
    }
}

/// The accepted schemes, and what speaks them.
fn accepted() -> String {
    SCHEMES
        .iter()
        .map(|(scheme, speakers)| {
            let names: Vec<&str> = speakers.iter().map(|p| p.name()).collect();
            format!("{scheme}:// ({})", names.join(" or "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Connects to `url` over AMQP 1.0. The transport's own connect timeout applies (10 s).
pub async fn connect_amqp10(url: &str) -> Result<Amqp10Transport, CliError> {
    let config = Amqp10Config::new(url).with_container_id("retryctl");
    Amqp10Transport::connect(config)
        .await
        .map_err(CliError::from)
}

/// Connects to `url` (one NATS server, or several separated by commas) over NATS, each
/// stream of a plan it provisions kept on `replicas` servers. The transport's own timeouts
/// apply (10 s), and its errors show the URL with its password masked
/// ([`NatsConfig::url`]).
pub async fn connect_nats(url: &str, replicas: usize) -> Result<NatsTransport, CliError> {
    let config = NatsConfig::new(url)
        .with_name("retryctl")
        .with_replicas(replicas);
    match NatsTransport::connect(config).await {
        Ok(transport) => Ok(transport),
        // Not "connection lost": there was none yet. The context names the masked URL.
        Err(TransportError::Connection {
            context,
            source: Some(source),
        }) => Err(CliError::failure_from(context, source)),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amqp_urls_speak_amqp091_unless_amqp10_is_asked_for() {
        let url = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert_eq!(Protocol::for_url(None, url).unwrap(), Protocol::Amqp091);
        let asked = Some(Protocol::Amqp10);
        assert_eq!(Protocol::for_url(asked, url).unwrap(), Protocol::Amqp10);
        let cluster = "amqps://a:b@n1:5671, AMQP://a:b@n2:5672";
        assert_eq!(Protocol::for_url(asked, cluster).unwrap(), Protocol::Amqp10);
    }

    #[test]
    fn nats_and_tls_urls_speak_nats_and_nothing_else() {
        for url in ["nats://127.0.0.1:4222", "tls://u:p@n1:4222,NATS://n2:4222"] {
            assert_eq!(
                Protocol::for_url(None, url).unwrap(),
                Protocol::Nats,
                "{url}"
            );
            let asked = Some(Protocol::Nats);
            assert_eq!(
                Protocol::for_url(asked, url).unwrap(),
                Protocol::Nats,
                "{url}"
            );
        }
        assert_eq!(Protocol::Nats.to_string(), "NATS JetStream");
        let err = Protocol::for_url(Some(Protocol::Amqp10), "nats://u:secret@h:4222").unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(
            err.chain()
                .starts_with("--protocol amqp10 does not speak nats:// URLs")
        );
        assert!(!err.chain().contains("secret"));
        let err = Protocol::for_url(Some(Protocol::Nats), "amqp://g:g@h:5672/%2f").unwrap_err();
        assert!(
            err.chain()
                .starts_with("--protocol nats does not speak amqp:// URLs")
        );
        let mixed = Protocol::for_url(None, "nats://n1:4222,amqp://n2:5672").unwrap_err();
        assert!(
            mixed.chain().contains("different protocols"),
            "{}",
            mixed.chain()
        );
    }

    #[test]
    fn an_unknown_scheme_is_a_usage_error_naming_it_and_the_accepted_ones() {
        for (url, named) in [
            ("http://127.0.0.1:4222", "\"http://\""),
            ("amqp://n1:5672,http://n2", "\"http://\""),
            ("127.0.0.1:5672", "a URL without a scheme"),
        ] {
            let err = Protocol::for_url(None, url).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{url}");
            let text = err.chain();
            assert!(text.contains(named), "{url}: {text}");
            assert!(
                text.contains(
                    "amqp:// (amqp091 or amqp10), amqps:// (amqp091 or amqp10), nats:// \
                     (nats), tls:// (nats)"
                ),
                "{text}"
            );
        }
    }
}
