//! Broker errors as the retry engine's transport errors.

use retry_core::TransportError;

use crate::broker::error::BrokerError;

impl From<BrokerError> for TransportError {
    fn from(e: BrokerError) -> Self {
        match e {
            BrokerError::ExchangeNotFound(name) => TransportError::MissingAddress {
                address: format!("exchange {name:?}"),
                hint: "declare it, or provision the topology plan first".to_owned(),
            },
            BrokerError::QueueNotFound(name) => TransportError::MissingAddress {
                address: format!("queue {name:?}"),
                hint: "declare it, or provision the topology plan first".to_owned(),
            },
            BrokerError::Inequivalent {
                object,
                argument,
                existing,
                wanted,
            } => TransportError::TopologyConflict {
                object,
                argument,
                existing,
                wanted,
            },
            BrokerError::ConnectionClosed(reason) => TransportError::connection_lost(reason),
            other => TransportError::Other(Box::new(other)),
        }
    }
}
