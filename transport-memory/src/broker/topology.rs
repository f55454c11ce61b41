//! The broker's topology: its exchanges and their bindings, and routing a message through
//! them, and through the exchanges they are bound to, to queues.

use std::sync::Arc;

use retry_core::ExchangeKind;

use crate::broker::error::BrokerError;
use crate::broker::exchange::{Destination, Exchange, ExchangeIndex};
use crate::broker::hash::FastMap;
use crate::broker::queues::{QueueIndex, Queues};

/// The exchanges, by index and by name, with their bindings.
#[derive(Debug)]
pub(crate) struct Topology {
    exchanges: Vec<Exchange>,
    index: FastMap<Arc<str>, ExchangeIndex>,
}

impl Topology {
    /// The exchanges every RabbitMQ broker starts with (the default exchange, `""`, is not
    /// one of them: it routes by queue name).
    pub(crate) fn new() -> Self {
        let mut topology = Topology {
            exchanges: Vec::new(),
            index: FastMap::default(),
        };
        for (name, kind) in [
            ("amq.direct", ExchangeKind::Direct),
            ("amq.fanout", ExchangeKind::Fanout),
            ("amq.topic", ExchangeKind::Topic),
        ] {
            topology.add(name, kind);
        }
        topology
    }

    fn add(&mut self, name: &str, kind: ExchangeKind) {
        let name: Arc<str> = Arc::from(name);
        self.index.insert(name, self.exchanges.len());
        self.exchanges.push(Exchange::new(kind));
    }

    /// Whether exchange `name` exists (the default exchange, `""`, is not one).
    pub(crate) fn has_exchange(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Declares an exchange; `Ok(true)` when it is new, `Ok(false)` when it exists with the
    /// same type.
    pub(crate) fn declare_exchange(
        &mut self,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<bool, BrokerError> {
        if name.is_empty() {
            return Err(default_exchange_refused());
        }
        if let Some(&i) = self.index.get(name) {
            let existing = self.exchanges[i].kind();
            if existing != kind {
                return Err(BrokerError::Inequivalent {
                    object: format!("exchange '{name}'"),
                    argument: "type".to_owned(),
                    existing: existing.as_str().to_owned(),
                    wanted: kind.as_str().to_owned(),
                });
            }
            return Ok(false);
        }
        if name.starts_with("amq.") {
            return Err(BrokerError::AccessRefused(format!(
                "exchange name '{name}' contains reserved prefix 'amq.*'"
            )));
        }
        self.add(name, kind);
        Ok(true)
    }

    /// Binds the queue named `queue` to `exchange` with `routing_key`.
    pub(crate) fn bind(
        &mut self,
        queues: &Queues,
        exchange: &str,
        queue: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        if exchange.is_empty() {
            return Err(default_exchange_refused());
        }
        let q = queues.index_of(queue)?;
        let x = self.index_of(exchange)?;
        self.exchanges[x].bind(Destination::Queue(q), routing_key);
        Ok(())
    }

    /// Binds the exchange `destination` to the exchange `source` with `routing_key`: what
    /// `source` routes with that binding goes on through `destination`'s bindings. The
    /// default exchange can be neither end, as on RabbitMQ.
    pub(crate) fn bind_exchange(
        &mut self,
        source: &str,
        destination: &str,
        routing_key: &str,
    ) -> Result<(), BrokerError> {
        if source.is_empty() || destination.is_empty() {
            return Err(default_exchange_refused());
        }
        let from = self.index_of(source)?;
        let to = self.index_of(destination)?;
        self.exchanges[from].bind(Destination::Exchange(to), routing_key);
        Ok(())
    }

    fn index_of(&self, exchange: &str) -> Result<ExchangeIndex, BrokerError> {
        self.index
            .get(exchange)
            .copied()
            .ok_or_else(|| BrokerError::ExchangeNotFound(exchange.to_owned()))
    }

    /// The queues `exchange` routes `routing_key` to, added to `out`; `false` when the
    /// exchange does not exist. The default exchange routes to the queue the key names.
    ///
    /// Exchange-to-exchange bindings are followed as RabbitMQ follows them: every exchange
    /// reached routes the same key through its own bindings, each exchange at most once (so
    /// a cycle of bindings ends), and each queue is reached at most once however many paths
    /// lead to it.
    pub(crate) fn route(
        &self,
        queues: &Queues,
        exchange: &str,
        routing_key: &str,
        out: &mut Vec<QueueIndex>,
    ) -> bool {
        if exchange.is_empty() {
            if let Some(q) = queues.find(routing_key) {
                out.push(q);
            }
            return true;
        }
        let Some(&x) = self.index.get(exchange) else {
            return false;
        };
        // The exchanges reached through exchange bindings, in the order reached: the work
        // list and the visited set at once. Empty, it costs no allocation, as on the hot
        // path of a direct exchange bound only to queues.
        let mut reached: Vec<ExchangeIndex> = Vec::new();
        self.exchanges[x].route(routing_key, out, &mut reached);
        let mut next = 0;
        while let Some(&e) = reached.get(next) {
            next += 1;
            if e != x {
                self.exchanges[e].route(routing_key, out, &mut reached);
            }
        }
        true
    }
}

fn default_exchange_refused() -> BrokerError {
    BrokerError::AccessRefused("operation not permitted on the default exchange".to_owned())
}
