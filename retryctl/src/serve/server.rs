//! The console's HTTP/1.1 server: hyper, with the bounds a server facing slow or hostile
//! clients needs and `axum::serve` does not have.
//!
//! * **Request head**: a client has [`Limits::client_timeout`] to send a request's line and
//!   headers, from the moment its connection is accepted or its previous response was
//!   written; then the connection is closed. With hyper 1's `header_read_timeout` the
//!   clock starts again as soon as a kept-alive connection goes idle, so an idle
//!   connection is closed after the same time.
//! * **Request body**: read whole, before any route sees it, within the same time and up
//!   to [`Limits::max_body`] bytes; a body that stalls is answered 408, one too large 413,
//!   and the connection is closed.
//! * **Connections**: at most [`Limits::max_connections`] open at once. Beyond that the
//!   server stops accepting: new connections wait in the system's listen queue until one
//!   closes, which the timeouts above ensure happens soon.
//!
//! A slow reader of a response is not bounded here: the console's answers are small.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The bounds on clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The time to send a request's head, again its body, and the longest a kept-alive
    /// connection stays idle (default 10 s).
    pub client_timeout: Duration,
    /// The most connections open at once (default 256).
    pub max_connections: usize,
    /// The largest request body, in bytes (default 2 MiB, axum's own default).
    pub max_body: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            client_timeout: Duration::from_secs(10),
            max_connections: 256,
            max_body: 2 << 20,
        }
    }
}

/// Serves `router` on `listener` within `limits`, until accepting fails for good.
pub async fn serve(listener: TcpListener, router: Router, limits: Limits) -> std::io::Result<()> {
    let router = router.layer(middleware::from_fn_with_state(limits, read_body));
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    loop {
        // Taken before accepting: at the cap, connections wait in the listen queue.
        let permit = Arc::clone(&open)
            .acquire_owned()
            .await
            .map_err(std::io::Error::other)?;
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) if is_transient(&e) => {
                // Out of file descriptors, or a connection reset before it was accepted:
                // the next accept may work.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.client_timeout)
                .keep_alive(true);
            // A connection that fails or times out only ends itself.
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
            drop(permit);
        });
    }
}

fn is_transient(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | Interrupted | WouldBlock
    ) || matches!(e.raw_os_error(), Some(23 | 24)) // ENFILE, EMFILE
}

/// Reads the request's body whole within the client timeout and the size limit, and hands
/// the request on with it; a refusal closes the connection.
async fn read_body(State(limits): State<Limits>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = format!("the request body is larger than {} bytes", limits.max_body);
    if declared.is_some_and(|n| n > limits.max_body as u64) {
        return closing(StatusCode::PAYLOAD_TOO_LARGE, &too_large);
    }
    match tokio::time::timeout(
        limits.client_timeout,
        axum::body::to_bytes(body, limits.max_body),
    )
    .await
    {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        // Without a length declared, only reading tells.
        Ok(Err(_)) if declared.is_none() => closing(StatusCode::PAYLOAD_TOO_LARGE, &too_large),
        Ok(Err(_)) => closing(StatusCode::BAD_REQUEST, "the request body was cut short"),
        Err(_) => closing(
            StatusCode::REQUEST_TIMEOUT,
            &format!(
                "the request body did not arrive within {}",
                humantime::format_duration(limits.client_timeout)
            ),
        ),
    }
}

/// A plain-text refusal after which the connection is closed.
fn closing(status: StatusCode, why: &str) -> Response {
    let mut response = (status, format!("{why}\n")).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}
