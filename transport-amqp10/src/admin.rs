//! What operators' tools ask of the broker over AMQP 1.0 ([`Admin`]): little beyond what
//! [`Amqp10Transport::missing`] probes. Nothing can be declared, a single queue cannot be
//! counted, and a message published over AMQP 0-9-1 may show none of its headers.

use async_trait::async_trait;
use retry_core::{
    Admin, AppliedObject, CheckReport, Checked, Depth, Message, ObjectCheck, PlanOptions,
    QueueRole, TopologyPlan, TransportError,
};

use crate::codec::NATIVE_HEADER;
use crate::profile::BrokerProfile;
use crate::transport::{Amqp10Transport, checks};

/// Over AMQP 1.0, a tool checks that the plan's objects exist, and no more.
///
/// * [`depth`](Admin::depth) is always [`Depth::Unknown`]: this transport offers no count
///   or existence check of a single queue, so a tool walks the queue to find out (a missing
///   queue fails the walk).
/// * [`apply`](Admin::apply) is refused with [`TransportError::Unsupported`]: RabbitMQ
///   cannot declare queues over AMQP 1.0, so the topology is applied over AMQP 0-9-1 and
///   checked over AMQP 1.0.
/// * [`check`](Admin::check) reports every exchange and queue of the plan as there or
///   missing, from [`missing`](Amqp10Transport::missing)'s probes (nothing is sent: the
///   probes through the delay queues need AMQP 0-9-1). An object this profile does not
///   probe (an exchange off RabbitMQ, a delay queue with native delays) is reported `ok`
///   with why it was not checked. A plan this transport cannot serve (a delay cascade,
///   unless the profile has native delays) is [`TransportError::Unsupported`].
/// * [`hidden_headers`](Admin::hidden_headers): RabbitMQ 3.x shows an AMQP 1.0 client none
///   of the headers of a message published over AMQP 0-9-1 (one parked by an AMQP 0-9-1
///   consumer), which then reads as having no application properties, only this
///   transport's own [`NATIVE_HEADER`]: a copy replayed over AMQP 1.0 would lose them.
///
/// ```no_run
/// use retry_core::{Admin, Depth, PlanOptions, RetryPolicy, TopologyPlan};
/// use transport_amqp10::{Amqp10Config, Amqp10Transport};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// let transport =
///     Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
/// let plan = TopologyPlan::new("comments", &RetryPolicy::default())?;
/// // Applied over AMQP 0-9-1 beforehand: checked here, object by object.
/// let report = transport.check(&plan, &PlanOptions::new()).await?;
/// for object in &report.objects {
///     println!("{} {:?}", object.object, object.checked);
/// }
/// assert_eq!(transport.depth("comments").await?, Depth::Unknown);
/// assert!(transport.apply(&plan).await.is_err());
/// transport.close().await;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[async_trait]
impl Admin for Amqp10Transport {
    /// [`Depth::Unknown`]: this transport has no count or existence check of a single queue.
    async fn depth(&self, _queue: &str) -> Result<Depth, TransportError> {
        Ok(Depth::Unknown)
    }

    async fn apply(&self, _plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        Err(TransportError::Unsupported {
            what: "creating queues over AMQP 1.0".into(),
            why: match self.profile() {
                BrokerProfile::RabbitMq3 => {
                    "RabbitMQ cannot declare queues over AMQP 1.0: apply the topology over \
                     AMQP 0-9-1 (protocol amqp091, the broker's amqp:// URL on port 5672), then \
                     check it over AMQP 1.0"
                }
                BrokerProfile::Generic(_) => {
                    "this transport declares no topology: create the queues on the broker (its \
                     console or management API), then check them over AMQP 1.0"
                }
            }
            .into(),
        })
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        _options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        let missing = self.missing(plan).await?;
        let profile = self.profile();
        let probed: Vec<String> = checks(plan, &profile)
            .into_iter()
            .map(|(what, _, _)| what)
            .collect();
        let checked = |object: &str, unprobed: &str| {
            if missing.iter().any(|m| m == object) {
                Checked::Missing
            } else if probed.iter().any(|p| p == object) {
                Checked::Ok(String::new())
            } else {
                Checked::Ok(unprobed.to_owned())
            }
        };
        let mut objects = Vec::with_capacity(plan.exchanges().len() + plan.queues().len());
        for exchange in plan.exchanges() {
            let object = format!("exchange {}", exchange.name);
            let checked = checked(
                &object,
                "not checked: clones go to queues by name off RabbitMQ",
            );
            objects.push(ObjectCheck::new(object, checked));
        }
        for queue in plan.queues() {
            let object = format!("queue {}", queue.name);
            let unprobed = match queue.role {
                QueueRole::Delay { .. } | QueueRole::CrashDelay { .. } => {
                    "not checked: the broker's native delays need no delay queue"
                }
                _ => "not checked",
            };
            let checked = checked(&object, unprobed);
            objects.push(ObjectCheck::new(object, checked).for_queue(&queue.name));
        }
        Ok(CheckReport::new(objects).with_scope(
            "over AMQP 1.0: that every object exists (the probes through the delay queues need \
             AMQP 0-9-1)",
        ))
    }

    fn may_hide_headers(&self) -> bool {
        true
    }

    fn hidden_headers(&self, message: &Message) -> Option<String> {
        hidden_headers(&self.profile(), message)
    }
}

/// Why `message`, read over AMQP 1.0 from a broker of `profile`, may have headers it does not
/// show: when it shows none but this transport's own [`NATIVE_HEADER`].
fn hidden_headers(profile: &BrokerProfile, message: &Message) -> Option<String> {
    let shows_none = message
        .headers()
        .iter()
        .all(|(name, _)| name == NATIVE_HEADER);
    shows_none.then(|| {
        match profile {
            BrokerProfile::RabbitMq3 => {
                "show no headers over AMQP 1.0, as RabbitMQ 3.x shows a message published over \
                 AMQP 0-9-1 (one parked by an AMQP 0-9-1 consumer), and a copy replayed over \
                 AMQP 1.0 would lose them: replay over AMQP 0-9-1 (protocol amqp091)"
            }
            BrokerProfile::Generic(_) => {
                "show no headers over AMQP 1.0, as a broker may show a message published over \
                 another protocol, and a copy replayed over AMQP 1.0 would lose them: replay \
                 over the protocol it was published with"
            }
        }
        .to_owned()
    })
}

#[cfg(test)]
mod tests {
    use retry_core::{HeaderValue, Headers, MessageParts};

    use super::*;
    use crate::GenericProfile;

    fn message(headers: &[(&str, HeaderValue)]) -> Message {
        Message::new(MessageParts {
            body: b"body".to_vec(),
            headers: headers.iter().cloned().collect::<Headers>(),
            ..Default::default()
        })
    }

    #[test]
    fn a_message_showing_only_the_native_header_may_hide_its_headers() {
        let rabbit = BrokerProfile::RabbitMq3;
        let native = (NATIVE_HEADER, HeaderValue::Bytes(vec![0x00, 0x53, 0x73]));
        for shows_none in [message(&[]), message(std::slice::from_ref(&native))] {
            assert_eq!(
                hidden_headers(&rabbit, &shows_none).as_deref(),
                Some(
                    "show no headers over AMQP 1.0, as RabbitMQ 3.x shows a message published \
                     over AMQP 0-9-1 (one parked by an AMQP 0-9-1 consumer), and a copy \
                     replayed over AMQP 1.0 would lose them: replay over AMQP 0-9-1 (protocol \
                     amqp091)"
                )
            );
        }
        let tenant = ("tenant", HeaderValue::Str("acme".into()));
        assert_eq!(
            hidden_headers(&rabbit, &message(std::slice::from_ref(&tenant))),
            None
        );
        assert_eq!(hidden_headers(&rabbit, &message(&[native, tenant])), None);
        let generic = BrokerProfile::Generic(GenericProfile::new());
        let why = hidden_headers(&generic, &message(&[])).expect("hidden");
        assert!(!why.contains("RabbitMQ"), "{why}");
    }
}
