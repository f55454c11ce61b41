//! `Handed`: the TCP socket lapin was handed for one connection, kept so that the
//! connection's IO loop can be ended when the transport gives the connection up.
//!
//! lapin runs each connection's IO on a thread of its own, which lives as long as the
//! connection tries to be connected. A connection given up halfway (a handshake that never
//! completes, a stalled recovery that was replaced) would keep its thread waiting on a
//! socket nobody answers, and once woken, keep asking for new streams to recover on for as
//! long as its reconnect backoff allows (about a day). So the transport keeps a duplicate of
//! the socket of each stream it hands lapin. Giving the connection up shuts that socket
//! down, which wakes lapin's read with the end of the stream; the stream lapin then asks for
//! is a [`refusal`]: a local socket that answers with the protocol header of AMQP 1.0,
//! which lapin reads as an error no recovery can fix, and its IO loop ends.
//!
//! This ends every IO loop that waits on its socket. One it cannot reach: lapin's loop
//! after a broker's `connection.close` followed at once by a reset, which waits for a
//! `close-ok` it can no longer write without waiting on the socket at all (see the `link`
//! module and the guide's known limitations, `docs/limitations.md`).

use std::io::Write as _;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};

use async_rs::Runtime;
use async_rs::traits::{Reactor, RuntimeKit};
use lapin::tcp::AsyncTcpStream;
use tracing::debug;

/// The socket handed to lapin for one connection, and whether the connection was given up.
#[derive(Debug, Default)]
pub(crate) struct Handed {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// A duplicate of the socket lapin uses now.
    socket: Option<TcpStream>,
    given_up: bool,
}

impl Handed {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the connection was given up: lapin gets a [`refusal`] from now on.
    pub(crate) fn given_up(&self) -> bool {
        self.lock().given_up
    }

    /// Keeps `socket`, a duplicate of the one just handed to lapin, in place of the
    /// previous one (whose stream lapin has given up on). Shut down at once if the
    /// connection was given up meanwhile.
    pub(crate) fn keep(&self, socket: Option<TcpStream>) {
        let mut state = self.lock();
        if state.given_up {
            if let Some(socket) = socket {
                let _ = socket.shutdown(Shutdown::Both);
            }
            return;
        }
        state.socket = socket;
    }

    /// Gives the connection up: its socket is shut down, and every stream lapin asks for
    /// afterwards is a refusal. Idempotent.
    pub(crate) fn give_up(&self) {
        let mut state = self.lock();
        state.given_up = true;
        if let Some(socket) = state.socket.take() {
            // A socket already reset says so; either way lapin's next read ends.
            let _ = socket.shutdown(Shutdown::Both);
        }
    }

    /// Lets go of the socket without shutting it down (the connection was closed).
    pub(crate) fn release(&self) {
        self.lock().socket = None;
    }
}

/// The protocol header of AMQP 1.0: to lapin, a server that does not speak 0-9-1.
const ANOTHER_PROTOCOL: &[u8] = b"AMQP\x00\x01\x00\x00";

/// A stream for a connection that was given up: a local socket whose peer has sent the
/// protocol header of another AMQP version and closed. lapin reads it as an error that no
/// recovery can fix (and logs it at ERROR, as a server that only speaks AMQP 1.0) and ends
/// the connection's IO loop.
pub(crate) async fn refusal<RK: RuntimeKit + Send + Sync>(
    runtime: &Runtime<RK>,
) -> std::io::Result<AsyncTcpStream<<RK as Reactor>::TcpStream>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let stream = AsyncTcpStream::connect(
        runtime,
        runtime.to_socket_addrs((address.ip().to_string(), address.port())),
    )
    .await?;
    // Already queued: a loopback connect completes before it is accepted.
    let (mut peer, _) = listener.accept()?;
    peer.write_all(ANOTHER_PROTOCOL)?;
    debug!("ending the IO loop of a connection given up");
    Ok(stream)
}
