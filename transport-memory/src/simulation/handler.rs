//! The handler every simulated consumer runs: the message's script, or the user's handler
//! with scripted crashes.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use retry_core::{Handler, HandlerError, Message};

use crate::broker::Broker;
use crate::broker::message::MessageKey;
use crate::broker::trace::EventKind;
use crate::simulation::ledger::{Begun, Ledger, message_id, message_ref};
use crate::simulation::script::Step;
use crate::transport::link::LinkHandle;

/// The handler every simulated consumer runs: the message's script, or the user's handler.
pub(crate) struct SimHandler {
    pub(crate) ledger: Arc<Ledger>,
    pub(crate) broker: Broker,
    pub(crate) consumer: u32,
    pub(crate) link: LinkHandle,
    pub(crate) custom: Option<Arc<dyn Handler>>,
    /// The isolation queue: a message from it is a suspect running alone.
    pub(crate) isolation: Arc<str>,
}

impl SimHandler {
    fn record(&self, kind: impl FnOnce() -> EventKind) {
        self.broker.shared.with(|s| s.record(kind));
    }

    fn finished(&self, key: MessageKey, id: &str, run: usize, step: &Step) {
        let consumer = self.consumer;
        self.ledger.end(id, run, step.clone());
        self.record(|| EventKind::HandlerFinished {
            message: message_ref(key, id),
            consumer,
            outcome: Arc::from(step.to_string()),
        });
    }

    async fn crash(&self, key: MessageKey, id: &str, run: usize) -> Result<(), HandlerError> {
        self.finished(key, id, run, &Step::Crash);
        self.ledger.request_crash(self.consumer);
        // The process is dying: this run never ends, and the simulation drops it.
        std::future::pending().await
    }
}

#[async_trait]
impl Handler for SimHandler {
    async fn handle(&self, msg: &Message) -> Result<(), HandlerError> {
        let id = message_id(msg);
        let now = self.broker.now();
        let (consumer, attempt) = (self.consumer, msg.attempt());
        let Begun {
            key,
            run,
            step,
            takes,
            drop_connection,
        } = self
            .ledger
            .begin(id, attempt, consumer, msg.queue() == &*self.isolation, now);
        self.record(|| EventKind::HandlerStarted {
            message: message_ref(key, id),
            consumer,
            attempt,
        });
        if drop_connection {
            let conn = self.link.connection() as u64;
            self.broker
                .close_connection(conn, "connection dropped mid-handler");
        }
        if !takes.is_zero() {
            self.broker.sleep(takes).await;
        }
        if let Some(custom) = &self.custom {
            if step == Step::Crash {
                return self.crash(key, id, run).await;
            }
            let result = custom.handle(msg).await;
            let step = match &result {
                Ok(()) => Step::Succeed,
                Err(e) => Step::fail(e.to_string()),
            };
            self.finished(key, id, run, &step);
            return result;
        }
        match &step {
            Step::Crash => return self.crash(key, id, run).await,
            Step::Hang => return std::future::pending().await,
            _ => self.finished(key, id, run, &step),
        }
        match step {
            Step::Fail(cause) => Err(HandlerError::transient(Scripted(cause))),
            Step::Permanent(cause) => Err(HandlerError::permanent(Scripted(cause))),
            Step::RetryAfter(d, cause) => Err(HandlerError::retry_after(d, Scripted(cause))),
            // Unwinds without the panic hook: the driver catches it like any panic, and
            // scripted panics do not litter test output.
            Step::Panic(message) => std::panic::resume_unwind(Box::new(message.to_string())),
            _ => Ok(()),
        }
    }
}

/// A scripted failure's cause: the script's own text, shared rather than copied into a
/// `String` for every run that fails. It reads as that text would (`Display` and `Debug`
/// alike), so handler errors say the same as before.
struct Scripted(Arc<str>);

impl fmt::Display for Scripted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl fmt::Debug for Scripted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::error::Error for Scripted {}
