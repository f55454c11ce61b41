//! The `Handler` trait: the user's code. The errors it reports ([`HandlerError`]) are
//! `retry-proto`'s.

use std::future::Future;

use async_trait::async_trait;

use crate::{HandlerError, Message};

/// The user's message handler. Plain async functions and closures taking a [`Message`] are
/// handlers too:
///
/// ```
/// use retry_core::{Handler, HandlerError, Message};
///
/// async fn handle(msg: Message) -> Result<(), HandlerError> {
///     if msg.body().is_empty() {
///         return Err(HandlerError::permanent("empty body"));
///     }
///     Ok(())
/// }
///
/// fn assert_handler<H: Handler>(_: H) {}
/// assert_handler(handle);
/// assert_handler(|_msg: Message| async { Ok::<(), HandlerError>(()) });
/// ```
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Handles one message.
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError>;
}

#[async_trait]
impl<F, Fut> Handler for F
where
    F: Fn(Message) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        (self)(msg.clone()).await
    }
}
