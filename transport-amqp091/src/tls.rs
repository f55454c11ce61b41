//! TLS for `amqps://` nodes: the rustls client configuration built from a
//! [`TlsConfig`], the handshake, and its refusals as [`TlsFailure`]s.
//!
//! lapin's own TLS setup (`OwnedTLSConfig`) adds a CA to the platform's roots instead of
//! replacing them, checks the certificate against the URL's host only, and reports every
//! refusal as an `io::Error` with rustls's wording. The transport therefore builds the
//! rustls `ClientConfig` itself, once per transport, opens the TCP stream and runs the
//! handshake, and hands lapin the finished stream through its connect callback (see the
//! `nodes` module). A refused handshake is an `io::Error` holding a [`TlsRefused`], which
//! survives lapin's wrapping and is turned into
//! [`TransportError::Tls`](retry_core::TransportError::Tls) where the transport reports it.
//!
//! Nothing here retries on plain TCP: an `amqps://` node is reached with TLS or not at all.
//! Errors name files and checks, never a password or the bytes of a key.

use std::sync::Arc;

use lapin::tcp::{AsyncTcpStream, RustlsConnector};
use lapin::uri::AMQPUri;
use retry_core::{TlsConfig, TlsFailure, TransportError};
use transport_kit::settings::{DefaultRoots, TlsClient};

/// The TLS side of a transport: one rustls configuration for every node, and the name
/// their certificates are checked against when it is not each node's host.
#[derive(Clone)]
pub(crate) struct Tls {
    connector: RustlsConnector,
    client: TlsClient,
}

/// How long [`Tls::verdict`] waits for the server's answer to a `close_notify`.
const VERDICT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}

/// A refused TLS handshake, or TLS settings that cannot be used, for one endpoint: carried
/// inside an `io::Error` through lapin's connect callback.
#[derive(Clone, Debug, thiserror::Error)]
#[error("TLS with {endpoint} failed: {failure}")]
pub(crate) struct TlsRefused {
    pub(crate) endpoint: String,
    pub(crate) failure: TlsFailure,
}

impl From<TlsRefused> for TransportError {
    fn from(r: TlsRefused) -> Self {
        TransportError::Tls {
            endpoint: r.endpoint,
            failure: r.failure,
        }
    }
}

/// `host:port` of a node: how a TLS refusal names it (never a user or password).
pub(crate) fn endpoint(uri: &AMQPUri) -> String {
    retry_core::tls::endpoint(&uri.authority.host, uri.authority.port)
}

impl Tls {
    /// Reads the files of `config` and builds the client configuration, trusting the
    /// platform's roots unless it names CA files. A file that cannot be read or used is a
    /// [`TlsFailure::Configuration`] naming it.
    pub(crate) fn new(config: &TlsConfig) -> Result<Self, TlsFailure> {
        let client = TlsClient::new(config, DefaultRoots::Platform)?;
        Ok(Tls {
            connector: RustlsConnector::from(Arc::clone(client.config())),
            client,
        })
    }

    /// Whether a client certificate is presented.
    pub(crate) fn presents_a_certificate(&self) -> bool {
        self.client.presents_certificate()
    }

    /// Reads the server's answer to the `close_notify` just sent on `stream`: a server that
    /// refuses the client's certificate says so with an alert once the client's side of a
    /// TLS 1.3 handshake is done. Read here, before any AMQP byte is written, the alert is
    /// not lost to the reset a server's close sends when unread data reaches it. An end of
    /// stream, any other error or no answer within [`VERDICT_WAIT`] is no refusal.
    pub(crate) async fn verdict<S>(
        &self,
        uri: &AMQPUri,
        mut stream: AsyncTcpStream<S>,
    ) -> std::io::Result<()>
    where
        S: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
    {
        use futures::AsyncReadExt;
        let mut buf = [0u8; 256];
        let reading = async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => continue,
                    Err(e) => match alert_in(&e) {
                        Some(failure) => {
                            return Err(std::io::Error::new(
                                e.kind(),
                                TlsRefused {
                                    endpoint: endpoint(uri),
                                    failure,
                                },
                            ));
                        }
                        None => return Ok(()),
                    },
                }
            }
        };
        tokio::time::timeout(VERDICT_WAIT, reading)
            .await
            .unwrap_or(Ok(()))
    }

    /// Runs the handshake on `stream`, a TCP stream to `uri`'s node: the server's
    /// certificate is checked against the configured server name, or the URL's host, which
    /// is also sent as SNI (when it is a name, not an address).
    pub(crate) async fn handshake<S>(
        &self,
        uri: &AMQPUri,
        stream: AsyncTcpStream<S>,
    ) -> std::io::Result<AsyncTcpStream<S>>
    where
        S: futures::AsyncRead + futures::AsyncWrite + Send + Unpin + 'static,
    {
        let name = self.client.checked_name(&uri.authority.host);
        stream
            .into_rustls(&self.connector, name)
            .await
            .map_err(|e| refused(uri, name, e))
    }
}

/// A failed handshake with `uri`'s node, its certificate checked against `name`: a
/// [`TlsRefused`] when rustls refused it, the error as it was otherwise (a reset, a
/// timeout).
fn refused(uri: &AMQPUri, name: &str, e: std::io::Error) -> std::io::Error {
    let Some(failure) = transport_kit::settings::failure_in(&e, name) else {
        return e;
    };
    std::io::Error::new(
        e.kind(),
        TlsRefused {
            endpoint: endpoint(uri),
            failure,
        },
    )
}

/// The TLS refusal in `err` or its chain of sources, if there is one.
pub(crate) fn refusal_in(err: &(dyn std::error::Error + 'static)) -> Option<TlsRefused> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(r) = e.downcast_ref::<TlsRefused>() {
            return Some(r.clone());
        }
        // An `io::Error`'s `source` skips the error it wraps.
        if let Some(r) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<TlsRefused>())
        {
            return Some(r.clone());
        }
        next = e.source();
    }
    None
}

/// The TLS failure of a rustls error in `err` or its chain of sources, when rustls refused
/// the connection after the handshake (a server's alert on the first read).
pub(crate) fn alert_in(err: &(dyn std::error::Error + 'static)) -> Option<TlsFailure> {
    match retry_core::tls::rustls_error_in(err)? {
        r @ rustls::Error::AlertReceived(_) => Some(retry_core::tls::failure(r, "")),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_found_through_io_errors_and_lapin_errors() {
        let refused = TlsRefused {
            endpoint: "localhost:5671".into(),
            failure: TlsFailure::NotTls,
        };
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, refused);
        let lapin = lapin::Error::from(io);
        let found = refusal_in(&lapin).expect("found through lapin's error");
        assert_eq!(found.failure, TlsFailure::NotTls);
        assert_eq!(found.endpoint, "localhost:5671");
        let other = lapin::Error::from(std::io::Error::other("reset"));
        assert!(refusal_in(&other).is_none());
    }
}
