//! Broker profiles: what the broker behind an AMQP 1.0 connection can do, and the encoding of
//! broker-native delays.

use std::time::Duration;

use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::primitives::{Symbol, Timestamp as AmqpTimestamp, Value};
use retry_core::{Capabilities, Timestamp};

/// Which broker is on the other end, and so which parts of AMQP 1.0 are safe to use.
///
/// ```
/// use transport_amqp10::{BrokerProfile, GenericProfile, NativeDelay};
///
/// let rabbit = BrokerProfile::RabbitMq3;
/// assert!(!rabbit.supports_modified());
/// assert!(!rabbit.capabilities().declares_topology);
///
/// let artemis = BrokerProfile::Generic(GenericProfile::new().with_native_delay(NativeDelay::DeliveryTime));
/// assert!(artemis.supports_modified());
/// assert!(artemis.capabilities().native_delays);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerProfile {
    /// RabbitMQ 3.x with the `rabbitmq_amqp1_0` plugin (the default).
    ///
    /// * The `modified` outcome is not supported: the broker ends the session. A requeue is
    ///   sent as `released`.
    /// * `header.delivery-count` is always 0; `first-acquirer = false` is the only sign of a
    ///   redelivery.
    /// * Nothing can be declared over AMQP 1.0 (`/queue/NAME` declares only argument-less
    ///   queues), so [`provision`](retry_core::Transport::provision) only verifies.
    /// * A send to a missing queue is accepted and dropped, so every address is verified
    ///   before the first send to it.
    /// * Queues are addressed as `/amq/queue/NAME`, exchanges as `/exchange/NAME`.
    /// * A plan with a delay cascade is refused with
    ///   [`TransportError::Unsupported`](retry_core::TransportError::Unsupported): the plugin
    ///   can neither declare nor inspect the cascade's bindings, and it drops a send that no
    ///   binding routes without a word.
    #[default]
    RabbitMq3,
    /// Any other AMQP 1.0 broker. Without native delays a plan with a delay cascade is
    /// refused as on RabbitMQ; with them a cascade's delayed clones go straight to their
    /// queue, scheduled.
    Generic(GenericProfile),
}

/// A broker that speaks AMQP 1.0 as the specification says: it counts deliveries, accepts
/// `modified`, and names queues by plain addresses.
///
/// ```
/// use transport_amqp10::{GenericProfile, NativeDelay};
///
/// let azure = GenericProfile::new().with_native_delay(NativeDelay::ScheduledEnqueueTime);
/// assert_eq!(azure.native_delay(), Some(NativeDelay::ScheduledEnqueueTime));
/// assert_eq!(GenericProfile::default().native_delay(), None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenericProfile {
    native_delay: Option<NativeDelay>,
}

impl GenericProfile {
    /// A generic profile without native delays: delays go through the plan's delay queues,
    /// which the broker must expire back to the work queue by itself.
    pub fn new() -> Self {
        GenericProfile::default()
    }

    /// Delays through a scheduled-delivery annotation: a delayed clone goes straight back to
    /// the work queue, and the broker holds it until it is due. The routes of a plan's delay
    /// queues or delay cascade are used only to find that queue.
    pub fn with_native_delay(mut self, delay: NativeDelay) -> Self {
        self.native_delay = Some(delay);
        self
    }

    /// The native delay annotation, if any.
    pub fn native_delay(&self) -> Option<NativeDelay> {
        self.native_delay
    }
}

/// A message annotation that asks the broker to hold a message until it is due.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NativeDelay {
    /// ActiveMQ Artemis (and Qpid JMS): `x-opt-delivery-time`, the due time as a `long` of
    /// milliseconds since the Unix epoch.
    DeliveryTime,
    /// ActiveMQ Artemis: `x-opt-delivery-delay`, the delay as a `long` of milliseconds.
    DeliveryDelay,
    /// Azure Service Bus: `x-opt-scheduled-enqueue-time`, the due time as an AMQP
    /// `timestamp`.
    ScheduledEnqueueTime,
}

impl NativeDelay {
    /// Every annotation name this crate writes; a clone drops them from its original before
    /// writing its own.
    pub const ANNOTATIONS: [&'static str; 3] = [
        "x-opt-delivery-time",
        "x-opt-delivery-delay",
        "x-opt-scheduled-enqueue-time",
    ];

    /// The annotation name.
    pub fn annotation(self) -> &'static str {
        match self {
            NativeDelay::DeliveryTime => Self::ANNOTATIONS[0],
            NativeDelay::DeliveryDelay => Self::ANNOTATIONS[1],
            NativeDelay::ScheduledEnqueueTime => Self::ANNOTATIONS[2],
        }
    }

    /// The message annotation that delays a message sent at `now` by `delay`. Values past
    /// what the AMQP types hold saturate.
    ///
    /// ```
    /// use std::time::Duration;
    /// use fe2o3_amqp::types::messaging::annotations::OwnedKey;
    /// use fe2o3_amqp::types::primitives::{Symbol, Value};
    /// use retry_core::Timestamp;
    /// use transport_amqp10::NativeDelay;
    ///
    /// let now = Timestamp::from_millis(1_700_000_000_000);
    /// let (key, value) = NativeDelay::DeliveryTime.annotate(now, Duration::from_secs(30));
    /// assert_eq!(key, OwnedKey::Symbol(Symbol::from("x-opt-delivery-time")));
    /// assert_eq!(value, Value::Long(1_700_000_030_000));
    /// ```
    pub fn annotate(self, now: Timestamp, delay: Duration) -> (OwnedKey, Value) {
        let delay_ms = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        let due_ms = i64::try_from(now.as_millis())
            .unwrap_or(i64::MAX)
            .saturating_add(delay_ms);
        let value = match self {
            NativeDelay::DeliveryTime => Value::Long(due_ms),
            NativeDelay::DeliveryDelay => Value::Long(delay_ms),
            NativeDelay::ScheduledEnqueueTime => {
                Value::Timestamp(AmqpTimestamp::from_milliseconds(due_ms))
            }
        };
        (OwnedKey::Symbol(Symbol::from(self.annotation())), value)
    }
}

impl BrokerProfile {
    /// What the transport can do on this broker.
    pub fn capabilities(&self) -> Capabilities {
        match self {
            BrokerProfile::RabbitMq3 => Capabilities {
                publisher_confirms: true,
                delivery_count: false,
                native_delays: false,
                dead_letter_exchange: true,
                declares_topology: false,
            },
            BrokerProfile::Generic(generic) => Capabilities {
                publisher_confirms: true,
                delivery_count: true,
                native_delays: generic.native_delay.is_some(),
                dead_letter_exchange: false,
                declares_topology: false,
            },
        }
    }

    /// Whether the broker takes the `modified` outcome. A requeue is `modified` with
    /// `delivery-failed` where it does (so the broker counts the attempt), `released` where
    /// it does not.
    pub fn supports_modified(&self) -> bool {
        !matches!(self, BrokerProfile::RabbitMq3)
    }

    /// Whether the broker answers every `flow` a receiver sends with one that carries the
    /// queue's count of ready messages (`available`), even a `flow` that grants nothing.
    /// RabbitMQ 3.x does; the specification leaves it to the broker.
    pub(crate) fn answers_flows(&self) -> bool {
        matches!(self, BrokerProfile::RabbitMq3)
    }

    /// The native delay annotation, if the profile has one.
    pub fn native_delay(&self) -> Option<NativeDelay> {
        match self {
            BrokerProfile::RabbitMq3 => None,
            BrokerProfile::Generic(generic) => generic.native_delay,
        }
    }

    /// The address of a queue: `/amq/queue/NAME` on RabbitMQ (which never declares), the
    /// name itself elsewhere.
    ///
    /// ```
    /// use transport_amqp10::{BrokerProfile, GenericProfile};
    ///
    /// assert_eq!(BrokerProfile::RabbitMq3.queue_address("orders"), "/amq/queue/orders");
    /// assert_eq!(BrokerProfile::Generic(GenericProfile::new()).queue_address("orders"), "orders");
    /// ```
    pub fn queue_address(&self, queue: &str) -> String {
        match self {
            BrokerProfile::RabbitMq3 => format!("/amq/queue/{queue}"),
            BrokerProfile::Generic(_) => queue.to_owned(),
        }
    }

    /// The address of an exchange (RabbitMQ) or topic (elsewhere).
    pub fn exchange_address(&self, exchange: &str) -> String {
        match self {
            BrokerProfile::RabbitMq3 => format!("/exchange/{exchange}"),
            BrokerProfile::Generic(_) => exchange.to_owned(),
        }
    }

    /// The name used in logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            BrokerProfile::RabbitMq3 => "RabbitMQ 3.x",
            BrokerProfile::Generic(_) => "generic AMQP 1.0",
        }
    }
}

/// How to provision what is missing, for the profile.
pub(crate) fn provision_hint(profile: &BrokerProfile) -> String {
    match profile {
        BrokerProfile::RabbitMq3 => "RabbitMQ's AMQP 1.0 plugin cannot declare queues with arguments: declare the topology over AMQP 0-9-1 first (transport-amqp091's `provision` with the same TopologyPlan, or rabbitmqadmin / a definitions file)".to_owned(),
        BrokerProfile::Generic(_) => "create it on the broker (its console or management API); this transport does not declare topology".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fe2o3_amqp::types::messaging::MessageAnnotations;

    fn encoded(delay: NativeDelay, now: u64, by: Duration) -> Vec<u8> {
        let (key, value) = delay.annotate(Timestamp::from_millis(now), by);
        let mut annotations = MessageAnnotations::default();
        annotations.0.insert(key, value);
        serde_amqp::to_vec(&annotations).expect("annotations encode")
    }

    /// The section as the specification lays it out: descriptor 0x72, a map of one pair.
    fn expected(name: &str, value_code: u8, value: i64) -> Vec<u8> {
        let mut pair = vec![0xa3, name.len() as u8];
        pair.extend_from_slice(name.as_bytes());
        pair.push(value_code);
        pair.extend_from_slice(&value.to_be_bytes());
        let mut out = vec![0x00, 0x53, 0x72, 0xc1, (pair.len() + 1) as u8, 0x02];
        out.extend(pair);
        out
    }

    #[test]
    fn artemis_delivery_time_is_an_absolute_long() {
        let bytes = encoded(
            NativeDelay::DeliveryTime,
            1_700_000_000_000,
            Duration::from_millis(1_500),
        );
        assert_eq!(
            bytes,
            expected("x-opt-delivery-time", 0x81, 1_700_000_001_500)
        );
    }

    #[test]
    fn artemis_delivery_delay_is_a_relative_long() {
        let bytes = encoded(
            NativeDelay::DeliveryDelay,
            1_700_000_000_000,
            Duration::from_secs(30),
        );
        assert_eq!(bytes, expected("x-opt-delivery-delay", 0x81, 30_000));
    }

    #[test]
    fn azure_scheduled_enqueue_time_is_a_timestamp() {
        let bytes = encoded(
            NativeDelay::ScheduledEnqueueTime,
            1_700_000_000_000,
            Duration::from_secs(600),
        );
        assert_eq!(
            bytes,
            expected("x-opt-scheduled-enqueue-time", 0x83, 1_700_000_600_000)
        );
    }

    #[test]
    fn huge_delays_saturate_instead_of_overflowing() {
        let (_, value) =
            NativeDelay::DeliveryTime.annotate(Timestamp::from_millis(u64::MAX), Duration::MAX);
        assert_eq!(value, Value::Long(i64::MAX));
        let (_, value) = NativeDelay::DeliveryDelay.annotate(Timestamp::EPOCH, Duration::MAX);
        assert_eq!(value, Value::Long(i64::MAX));
    }

    #[test]
    fn rabbitmq_never_uses_modified_and_cannot_declare() {
        let p = BrokerProfile::RabbitMq3;
        assert!(!p.supports_modified());
        let caps = p.capabilities();
        assert!(caps.publisher_confirms && caps.dead_letter_exchange);
        assert!(!caps.delivery_count && !caps.declares_topology && !caps.native_delays);
    }
}
