//! SASL EXTERNAL: logging in as the client certificate of the TLS connection.
//!
//! fe2o3-amqp 0.18 sends EXTERNAL only on a connection whose TLS it opens itself, and this
//! transport opens TLS itself (the [`Tap`](crate::tap::Tap) must see the decrypted frames
//! before fe2o3 decodes them), so fe2o3 refuses EXTERNAL on the stream it is given. The SASL
//! layer is small enough to speak here: the SASL protocol header, the broker's mechanisms,
//! `sasl-init` with `EXTERNAL` and an empty response (the identity is the certificate's),
//! the outcome. fe2o3 then opens AMQP on the same stream with no SASL profile, as the
//! protocol continues after a successful SASL outcome.

use fe2o3_amqp::types::primitives::{Binary, Symbol};
use fe2o3_amqp::types::sasl::{SaslCode, SaslInit, SaslMechanisms, SaslOutcome};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const SASL_HEADER: &[u8; 8] = b"AMQP\x03\x01\x00\x00";
const FRAME_TYPE_SASL: u8 = 0x01;
/// No SASL frame of the exchange comes near this; a larger size is not SASL.
const MAX_FRAME: u32 = 64 * 1024;

/// Why an EXTERNAL login failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExternalError {
    /// The stream failed, TLS included: the caller finds a TLS failure in it.
    #[error("SASL EXTERNAL: {source}")]
    Io {
        /// Whether the broker had answered anything before.
        answered: bool,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// The broker does not offer EXTERNAL (it does only to a client that presented a
    /// certificate, with its plugin enabled).
    #[error(
        "the broker does not offer SASL EXTERNAL (it offers {offered}): present a client certificate, and enable EXTERNAL on the broker (RabbitMQ: the rabbitmq_auth_mechanism_ssl plugin and auth_mechanisms)"
    )]
    NotOffered {
        /// The mechanisms it offers.
        offered: String,
    },
    /// The broker refused the login.
    #[error(
        "the broker refused the SASL EXTERNAL login ({code}): is the certificate's user known to it, with permissions?"
    )]
    Refused {
        /// The SASL outcome code.
        code: String,
    },
    /// Something that is not the SASL exchange came back.
    #[error("SASL EXTERNAL: {0}")]
    Protocol(String),
}

/// Logs in with SASL EXTERNAL on `stream`; `hostname` is the SASL hostname.
pub(crate) async fn login<S>(stream: &mut S, hostname: &str) -> Result<(), ExternalError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let before = |source| ExternalError::Io {
        answered: false,
        source,
    };
    stream.write_all(SASL_HEADER).await.map_err(before)?;
    stream.flush().await.map_err(before)?;
    let mut header = [0u8; 8];
    stream.read_exact(&mut header).await.map_err(before)?;
    if &header != SASL_HEADER {
        return Err(ExternalError::Protocol(format!(
            "the broker answered the SASL protocol header with {header:?}"
        )));
    }

    let mechanisms: SaslMechanisms = decode(&read_frame(stream).await?, "sasl-mechanisms")?;
    let external = Symbol::from("EXTERNAL");
    if !mechanisms.sasl_server_mechanisms.0.contains(&external) {
        let offered = mechanisms
            .sasl_server_mechanisms
            .0
            .iter()
            .map(|m| m.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(ExternalError::NotOffered { offered });
    }

    // An empty response: the identity is the certificate's (RabbitMQ's plugin also wants
    // the field present).
    let init = SaslInit {
        mechanism: external,
        initial_response: Some(Binary::from(Vec::new())),
        hostname: Some(hostname.to_owned()),
    };
    let body = serde_amqp::to_vec(&init)
        .map_err(|e| ExternalError::Protocol(format!("encoding sasl-init: {e}")))?;
    let size = u32::try_from(body.len() + 8)
        .map_err(|_| ExternalError::Protocol("sasl-init too large".into()))?;
    let mut frame = Vec::with_capacity(body.len() + 8);
    frame.extend_from_slice(&size.to_be_bytes());
    frame.extend_from_slice(&[0x02, FRAME_TYPE_SASL, 0x00, 0x00]);
    frame.extend_from_slice(&body);
    stream.write_all(&frame).await.map_err(after)?;
    stream.flush().await.map_err(after)?;

    let outcome: SaslOutcome = decode(&read_frame(stream).await?, "sasl-outcome")?;
    match outcome.code {
        SaslCode::Ok => Ok(()),
        code => Err(ExternalError::Refused {
            code: format!("{code:?}"),
        }),
    }
}

/// A failure of the stream after the broker's first answer.
fn after(source: std::io::Error) -> ExternalError {
    ExternalError::Io {
        answered: true,
        source,
    }
}

/// The body of the next SASL frame.
async fn read_frame<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>, ExternalError> {
    let mut size = [0u8; 4];
    stream.read_exact(&mut size).await.map_err(after)?;
    let size = u32::from_be_bytes(size);
    if !(8..=MAX_FRAME).contains(&size) {
        return Err(ExternalError::Protocol(format!(
            "a SASL frame of {size} bytes"
        )));
    }
    let mut rest = vec![0u8; size as usize - 4];
    stream.read_exact(&mut rest).await.map_err(after)?;
    let (doff, kind) = (usize::from(rest[0]), rest[1]);
    if kind != FRAME_TYPE_SASL || doff < 2 || doff * 4 > size as usize {
        return Err(ExternalError::Protocol(format!(
            "a frame of type {kind} with data offset {doff} where a SASL frame was due"
        )));
    }
    Ok(rest.split_off(doff * 4 - 4))
}

fn decode<T: serde_amqp::serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, ExternalError> {
    serde_amqp::from_slice(body)
        .map_err(|e| ExternalError::Protocol(format!("expected {what}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    /// A broker's side of the exchange: reads the header and the init, answers with
    /// `mechanisms` and `code`. Returns the init it got.
    async fn broker(
        mut io: tokio::io::DuplexStream,
        mechanisms: &[&str],
        code: SaslCode,
    ) -> Option<SaslInit> {
        let mut header = [0u8; 8];
        io.read_exact(&mut header).await.ok()?;
        assert_eq!(&header, SASL_HEADER);
        io.write_all(SASL_HEADER).await.ok()?;
        let offered = SaslMechanisms {
            sasl_server_mechanisms: fe2o3_amqp::types::primitives::Array(
                mechanisms.iter().map(|m| Symbol::from(*m)).collect(),
            ),
        };
        write_frame(&mut io, &serde_amqp::to_vec(&offered).unwrap()).await;
        let body = read_frame(&mut io).await.ok()?;
        let init: SaslInit = serde_amqp::from_slice(&body).unwrap();
        let outcome = SaslOutcome {
            code,
            additional_data: None,
        };
        write_frame(&mut io, &serde_amqp::to_vec(&outcome).unwrap()).await;
        Some(init)
    }

    async fn write_frame(io: &mut tokio::io::DuplexStream, body: &[u8]) {
        let mut frame = ((body.len() + 8) as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&[2, FRAME_TYPE_SASL, 0, 0]);
        frame.extend_from_slice(body);
        io.write_all(&frame).await.unwrap();
    }

    #[tokio::test]
    async fn logs_in_with_an_empty_response() {
        let (mut client, server) = duplex(4096);
        let broker = tokio::spawn(broker(server, &["PLAIN", "EXTERNAL"], SaslCode::Ok));
        login(&mut client, "localhost").await.expect("login");
        let init = broker.await.unwrap().expect("an init");
        assert_eq!(init.mechanism.as_str(), "EXTERNAL");
        assert_eq!(init.initial_response, Some(Binary::from(Vec::new())));
        assert_eq!(init.hostname.as_deref(), Some("localhost"));
    }

    #[tokio::test]
    async fn a_broker_without_external_or_refusing_it_is_named() {
        let (mut client, server) = duplex(4096);
        tokio::spawn(broker(server, &["PLAIN", "AMQPLAIN"], SaslCode::Ok));
        let err = login(&mut client, "h").await.expect_err("not offered");
        assert!(
            matches!(&err, ExternalError::NotOffered { offered } if offered == "PLAIN, AMQPLAIN"),
            "{err:?}"
        );

        let (mut client, server) = duplex(4096);
        tokio::spawn(broker(server, &["EXTERNAL"], SaslCode::Auth));
        let err = login(&mut client, "h").await.expect_err("refused");
        assert!(matches!(err, ExternalError::Refused { .. }), "{err:?}");
    }
}
