//! The simulation API: consumer processes running the real retry driver on the broker model,
//! with scripted handlers, crashes and faults, on virtual time.
//!
//! * [`simulator`]: [`Simulation`](simulator::Simulation), its run loop and its consumer
//!   processes; [`builder`] makes one;
//! * [`handler`]: the scripted handler, following [`script`]s; [`ledger`]: what the
//!   simulation knows about each message, which [`report`] turns into its report;
//! * [`executor`]: the deterministic single-threaded executor, and
//!   [`Broker::block_on`](crate::Broker::block_on) for running one future on virtual time.

pub(crate) mod builder;
pub(crate) mod error;
pub(crate) mod executor;
pub(crate) mod handler;
pub(crate) mod ledger;
pub(crate) mod report;
pub(crate) mod script;
pub(crate) mod simulator;

use std::sync::{Mutex, MutexGuard};

/// Locks `m`. A panic elsewhere while it was held leaves the data usable, so poisoning is
/// ignored rather than spread.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
