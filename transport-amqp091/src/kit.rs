//! `TapKit`: lapin's tokio runtime, with every TCP stream it is handed wrapped in a
//! [`Tapped`] stream.
//!
//! lapin takes its connection's stream from a callback typed by the runtime's TCP stream
//! (`AsyncTcpStream<RK::TcpStream>`). With tokio's kit that type is a bare tokio socket, so
//! nothing can sit between the socket and lapin. This kit is tokio's in every respect but
//! that type, which is [`Tapped`] over a stream of tokio's kit: the transport opens the
//! socket (and its TLS session) with tokio's kit as before, then hands lapin the tapped
//! stream as a plain one, so the tap reads what TLS has decrypted.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_rs::Tokio;
use async_rs::traits::{Executor, Reactor, RuntimeKit};
use async_rs::util::Task;
use futures::{AsyncRead, AsyncWrite, Stream};
use lapin::tcp::AsyncTcpStream;

use crate::tap::{Refusals, Tapped};

/// What tokio's kit connects: a socket, or a TLS session over one.
pub(crate) type Inner = AsyncTcpStream<<Tokio as Reactor>::TcpStream>;

/// Tokio's runtime kit, with tapped TCP streams.
#[derive(Clone, Debug)]
pub(crate) struct TapKit {
    tokio: Tokio,
    /// The `frame_max` the connection proposes, if any.
    proposed: Option<u32>,
    refusals: Arc<Refusals>,
}

impl TapKit {
    /// On the current tokio runtime, for a connection that proposes `proposed` as its
    /// `frame_max`; the streams it taps keep what they refuse in `refusals`.
    pub(crate) fn current(proposed: Option<u32>, refusals: Arc<Refusals>) -> Self {
        TapKit {
            tokio: Tokio::current(),
            proposed,
            refusals,
        }
    }

    /// `stream`, tapped.
    pub(crate) fn tap(&self, stream: Inner) -> Tapped<Inner> {
        Tapped::new(stream, self.proposed, Arc::clone(&self.refusals))
    }
}

impl RuntimeKit for TapKit {}

impl Executor for TapKit {
    type Task<T: Send + 'static> = <Tokio as Executor>::Task<T>;

    fn block_on<T, F: Future<Output = T>>(&self, f: F) -> T {
        self.tokio.block_on(f)
    }

    fn spawn<T: Send + 'static, F: Future<Output = T> + Send + 'static>(
        &self,
        f: F,
    ) -> Task<Self::Task<T>> {
        self.tokio.spawn(f)
    }

    fn spawn_blocking<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
        &self,
        f: F,
    ) -> Task<Self::Task<T>> {
        self.tokio.spawn_blocking(f)
    }
}

impl Reactor for TapKit {
    type TcpStream = Tapped<Inner>;
    type Sleep = <Tokio as Reactor>::Sleep;

    /// Not offered: lapin never registers a handle of its own, and the bound tokio's kit
    /// needs is not public.
    fn register<H: Read + Write + Send + 'static>(
        &self,
        _socket: H,
    ) -> io::Result<impl AsyncRead + AsyncWrite + Send + Unpin + 'static> {
        Err::<Self::TcpStream, _>(io::Error::new(
            io::ErrorKind::Unsupported,
            "the tapping runtime registers no handles",
        ))
    }

    fn sleep(&self, dur: Duration) -> Self::Sleep {
        self.tokio.sleep(dur)
    }

    fn interval(&self, dur: Duration) -> impl Stream<Item = Instant> + Send + 'static {
        self.tokio.interval(dur)
    }

    fn tcp_connect_addr(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = io::Result<Self::TcpStream>> + Send + 'static {
        let connecting = self.tokio.tcp_connect_addr(addr);
        let kit = self.clone();
        async move { Ok(kit.tap(AsyncTcpStream::Plain(connecting.await?))) }
    }
}
