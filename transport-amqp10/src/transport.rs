//! `Amqp10Transport`: the [`Transport`] implementation.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use retry_core::{
    Capabilities, Delivery, Message, Publish, PublishResult, QueueRole, Route, Settlement,
    TopologyPlan, Transport, TransportError,
};
use tokio::sync::{Mutex, oneshot};
use tracing::{debug, info};

use crate::codec::{Schedule, build_clone};
use crate::config::{Amqp10Config, Endpoint};
use crate::connection::{Probe, ProbeError};
use crate::profile::BrokerProfile;
use crate::publisher::Publisher;
use crate::receiver::{self, Amqp10Tag, Command, Incoming, Link};

/// A [`Transport`] over AMQP 1.0, through fe2o3-amqp.
///
/// It holds two connections: one consumes (opened by [`consume`](Transport::consume)), one
/// publishes clones and verifies addresses (opened by [`connect`](Self::connect)). See the
/// [crate documentation](crate) for the design and the RabbitMQ 3.x specifics.
///
/// ```no_run
/// use retry_core::{RetryPolicy, TopologyPlan, Transport};
/// use std::time::Duration;
/// use transport_amqp10::{Amqp10Config, Amqp10Transport};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = Amqp10Transport::connect(Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// // On RabbitMQ this verifies the topology (declared beforehand over AMQP 0-9-1).
/// transport.provision(&plan).await?;
/// transport.consume("comments", 20).await?;
/// while let Some(delivery) = transport.recv().await? {
///     println!("{} bytes", delivery.message.body().len());
///     transport.settle(&delivery.tag, retry_core::Settlement::Ack).await?;
/// }
/// transport.close().await;
/// # Ok(())
/// # }
/// ```
pub struct Amqp10Transport {
    shared: Arc<Shared>,
}

struct Shared {
    config: Amqp10Config,
    endpoint: Endpoint,
    publisher: Publisher,
    routes: RwLock<Routes>,
    consumer: std::sync::Mutex<ConsumerState>,
    incoming: Mutex<Option<tokio::sync::mpsc::Receiver<Incoming>>>,
}

#[derive(Default)]
struct ConsumerState {
    /// Queue and prefetch of the last `consume`.
    target: Option<(String, u16)>,
    commands: Option<tokio::sync::mpsc::Sender<Command>>,
    generation: u64,
    cancelled: bool,
}

/// What the provisioned plans say about routes.
#[derive(Default, Debug)]
struct Routes {
    /// (exchange, routing key) → the queue it is bound to.
    bound: HashMap<(String, String), String>,
    /// Routes into delay queues, and the work queue they expire back to.
    delays: HashMap<(String, String), String>,
}

impl Routes {
    fn learn(&mut self, plan: &TopologyPlan) {
        for b in plan.bindings() {
            self.bound
                .insert((b.exchange.clone(), b.routing_key.clone()), b.queue.clone());
        }
        for (_, route) in plan.delay_routes() {
            self.delays.insert(key(route), plan.work_queue().to_owned());
        }
    }
}

fn key(route: &Route) -> (String, String) {
    (route.exchange.to_string(), route.routing_key.to_string())
}

/// Where a clone goes.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    address: String,
    probe: Probe,
    /// What the probe checks when it is not `address` itself.
    probe_address: Option<String>,
    native_delay: bool,
}

/// How to provision what is missing, for the profile.
pub(crate) fn provision_hint(profile: &BrokerProfile) -> String {
    match profile {
        BrokerProfile::RabbitMq3 => "RabbitMQ's AMQP 1.0 plugin cannot declare queues with arguments: declare the topology over AMQP 0-9-1 first (transport-amqp091's `provision` with the same TopologyPlan, or rabbitmqadmin / a definitions file)".to_owned(),
        BrokerProfile::Generic(_) => "create it on the broker (its console or management API); this transport does not declare topology".to_owned(),
    }
}

impl Amqp10Transport {
    /// Opens the publishing connection. Consuming starts with
    /// [`consume`](Transport::consume).
    pub async fn connect(config: Amqp10Config) -> Result<Self, TransportError> {
        let endpoint = config
            .endpoint()
            .map_err(|e| TransportError::Other(Box::new(e)))?;
        let publisher = Publisher::new(endpoint.clone(), config.clone());
        publisher.connect().await?;
        info!(broker = %endpoint.redacted, profile = config.profile().name(), "AMQP 1.0 transport connected");
        Ok(Amqp10Transport {
            shared: Arc::new(Shared {
                config,
                endpoint,
                publisher,
                routes: RwLock::new(Routes::default()),
                consumer: std::sync::Mutex::new(ConsumerState::default()),
                incoming: Mutex::new(None),
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &Amqp10Config {
        &self.shared.config
    }

    /// The broker profile.
    pub fn profile(&self) -> BrokerProfile {
        self.shared.config.profile()
    }

    /// Checks that everything in `plan` exists, without declaring anything, and learns the
    /// plan's routes. Every missing object is named in one
    /// [`TransportError::MissingAddress`]. On the RabbitMQ profile this is what
    /// [`provision`](Transport::provision) does.
    ///
    /// On RabbitMQ queues are probed by attaching a receiver with no credit (`/amq/queue/NAME`
    /// never declares, so a missing queue fails NOT_FOUND) and exchanges by attaching a
    /// sender. Bindings cannot be seen over AMQP 1.0; clones are therefore sent to the
    /// verified queue a route is bound to, not through the exchange.
    pub async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let profile = self.profile();
        let mut checks: Vec<(String, String, Probe)> = Vec::new();
        for queue in plan.queues() {
            let delayed_natively =
                matches!(queue.role, QueueRole::Delay { .. }) && profile.native_delay().is_some();
            if delayed_natively {
                continue;
            }
            let probe = match profile {
                BrokerProfile::RabbitMq3 => Probe::Receiver,
                BrokerProfile::Generic(_) => Probe::Sender,
            };
            checks.push((
                format!("queue {}", queue.name),
                profile.queue_address(&queue.name),
                probe,
            ));
        }
        // Exchanges are RabbitMQ's; elsewhere clones go to queues by name.
        if profile == BrokerProfile::RabbitMq3 {
            for exchange in plan.exchanges() {
                checks.push((
                    format!("exchange {}", exchange.name),
                    profile.exchange_address(&exchange.name),
                    Probe::Sender,
                ));
            }
        }
        let mut missing = Vec::new();
        for (what, address, probe) in checks {
            match self.shared.publisher.verify(&address, probe).await {
                Ok(()) => debug!(%address, "verified"),
                Err(ProbeError::Missing(why)) => {
                    debug!(%address, %why, "missing");
                    missing.push(what);
                }
                Err(ProbeError::Failed(e)) => return Err(e),
            }
        }
        if !missing.is_empty() {
            return Err(TransportError::MissingAddress {
                address: missing.join(", "),
                hint: provision_hint(&profile),
            });
        }
        if let Ok(mut routes) = self.shared.routes.write() {
            routes.learn(plan);
        }
        Ok(())
    }

    /// Stops consuming, detaches every link and closes both connections. Deliveries not yet
    /// settled go back to the queue.
    pub async fn close(&self) {
        let commands = self.shared.consumer.lock().ok().and_then(|mut c| {
            c.cancelled = true;
            c.commands.take()
        });
        if let Some(commands) = commands {
            let (done, closed) = oneshot::channel();
            if commands.send(Command::Close { done }).await.is_ok() {
                let _ = tokio::time::timeout(self.shared.config.operation_timeout(), closed).await;
            }
        }
        self.shared.publisher.close().await;
    }

    fn target(&self, route: &Route) -> Result<Target, TransportError> {
        let profile = self.profile();
        let routes = self
            .shared
            .routes
            .read()
            .map_err(|_| TransportError::Other("route table poisoned".into()))?;
        let k = key(route);
        if profile.native_delay().is_some()
            && let Some(work) = routes.delays.get(&k)
        {
            return Ok(Target {
                address: profile.queue_address(work),
                probe: Probe::Sender,
                probe_address: None,
                native_delay: true,
            });
        }
        let queue_probe = match profile {
            BrokerProfile::RabbitMq3 => Probe::Receiver,
            BrokerProfile::Generic(_) => Probe::Sender,
        };
        if let Some(queue) = routes.bound.get(&k) {
            return Ok(Target {
                address: profile.queue_address(queue),
                probe: queue_probe,
                probe_address: None,
                native_delay: false,
            });
        }
        if route.exchange.is_empty() {
            return Ok(Target {
                address: profile.queue_address(&route.routing_key),
                probe: queue_probe,
                probe_address: None,
                native_delay: false,
            });
        }
        match profile {
            // Not from a verified plan: the exchange can be checked, its binding cannot.
            BrokerProfile::RabbitMq3 => Ok(Target {
                address: format!("/exchange/{}/{}", route.exchange, route.routing_key),
                probe: Probe::Sender,
                probe_address: Some(profile.exchange_address(&route.exchange)),
                native_delay: false,
            }),
            BrokerProfile::Generic(_) => Err(TransportError::MissingAddress {
                address: format!(
                    "exchange {} with routing key {}",
                    route.exchange, route.routing_key
                ),
                hint: "the generic profile sends only to the queues of a provisioned plan: call provision first".into(),
            }),
        }
    }

    async fn attach_consumer(&self) -> Result<(), TransportError> {
        let (queue, prefetch, generation) = {
            let mut state = self
                .shared
                .consumer
                .lock()
                .map_err(|_| TransportError::Other("consumer state poisoned".into()))?;
            let Some((queue, prefetch)) = state.target.clone() else {
                return Err(TransportError::Other("recv called before consume".into()));
            };
            let generation = state.generation;
            state.generation += 1;
            (queue, prefetch, generation)
        };
        let Link { commands, incoming } = receiver::start(
            &self.shared.endpoint,
            &self.shared.config,
            &queue,
            prefetch,
            generation,
        )
        .await?;
        *self.shared.incoming.lock().await = Some(incoming);
        if let Ok(mut state) = self.shared.consumer.lock() {
            state.commands = Some(commands);
        }
        info!(%queue, prefetch, generation, "consuming");
        Ok(())
    }

    fn cancelled(&self) -> bool {
        self.shared
            .consumer
            .lock()
            .map(|c| c.cancelled)
            .unwrap_or(true)
    }
}

impl std::fmt::Debug for Amqp10Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp10Transport")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for Amqp10Transport {
    type Tag = Amqp10Tag;

    fn capabilities(&self) -> Capabilities {
        self.profile().capabilities()
    }

    /// Verifies the plan (see [`verify`](Amqp10Transport::verify)): neither profile declares
    /// topology over AMQP 1.0.
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.verify(plan).await
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError> {
        if prefetch == 0 {
            return Err(TransportError::Other(
                "prefetch must be at least 1: it is the consuming link's credit".into(),
            ));
        }
        if let Ok(mut state) = self.shared.consumer.lock() {
            state.target = Some((queue.to_owned(), prefetch));
            state.cancelled = false;
        }
        self.attach_consumer().await
    }

    async fn recv(&self) -> Result<Option<Delivery<Amqp10Tag>>, TransportError> {
        if self.cancelled() {
            return Ok(None);
        }
        let mut incoming = self.shared.incoming.lock().await;
        if incoming.is_none() {
            drop(incoming);
            self.attach_consumer().await?;
            incoming = self.shared.incoming.lock().await;
        }
        let Some(rx) = incoming.as_mut() else {
            return Err(TransportError::Closed);
        };
        match rx.recv().await {
            Some(Incoming::Delivery(d)) => Ok(Some(*d)),
            Some(Incoming::Cancelled) => Ok(None),
            Some(Incoming::Lost(e)) => {
                *incoming = None;
                Err(e)
            }
            None if self.cancelled() => Ok(None),
            None => {
                *incoming = None;
                Err(TransportError::Connection(
                    "the consuming link stopped".into(),
                ))
            }
        }
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let target = match self.target(&publish.route) {
            Ok(t) => t,
            Err(e) => return PublishResult::Failed(e),
        };
        // RabbitMQ accepts and drops a send to a missing queue: never send anywhere unchecked.
        let probe_address = target.probe_address.as_deref().unwrap_or(&target.address);
        match self
            .shared
            .publisher
            .verify(probe_address, target.probe)
            .await
        {
            Ok(()) => {}
            Err(ProbeError::Missing(why)) => {
                return PublishResult::Failed(TransportError::MissingAddress {
                    address: probe_address.to_owned(),
                    hint: format!("{why}; {}", provision_hint(&self.profile())),
                });
            }
            Err(ProbeError::Failed(e)) => return PublishResult::Failed(e),
        }
        let schedule = match (target.native_delay, self.profile().native_delay()) {
            (true, Some(kind)) => Some(Schedule {
                kind,
                now: self.now(),
                delay: publish
                    .headers
                    .delay
                    .or(publish.expiration)
                    .unwrap_or_default(),
            }),
            _ => None,
        };
        let clone = build_clone(original, publish, schedule);
        self.shared.publisher.send(&target.address, clone).await
    }

    async fn settle(&self, tag: &Amqp10Tag, settlement: Settlement) -> Result<(), TransportError> {
        receiver::settle(tag, settlement, self.shared.config.operation_timeout()).await
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        let commands = match self.shared.consumer.lock() {
            Ok(mut state) => {
                state.cancelled = true;
                state.commands.clone()
            }
            Err(_) => None,
        };
        if let Some(commands) = commands {
            let (done, cancelled) = oneshot::channel();
            if commands.send(Command::Cancel { done }).await.is_ok() {
                let _ =
                    tokio::time::timeout(self.shared.config.operation_timeout(), cancelled).await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retry_core::RetryPolicy;
    use std::collections::HashSet;
    use std::time::Duration;

    fn routes(plan: &TopologyPlan) -> Routes {
        let mut r = Routes::default();
        r.learn(plan);
        r
    }

    #[test]
    fn plan_routes_resolve_to_their_bound_queues() {
        let policy = RetryPolicy::delays([Duration::from_secs(1), Duration::from_secs(60)])
            .build()
            .expect("policy");
        let plan = TopologyPlan::new("orders", &policy).expect("plan");
        let r = routes(&plan);
        let (_, delay) = &plan.delay_routes()[1];
        assert_eq!(
            r.bound.get(&key(delay)).map(String::as_str),
            Some("orders.retry.1m")
        );
        assert_eq!(
            r.bound.get(&key(plan.parking_route())).map(String::as_str),
            Some("orders.parking")
        );
        assert_eq!(
            r.delays.get(&key(delay)).map(String::as_str),
            Some("orders")
        );
        let unique: HashSet<_> = r.bound.values().collect();
        assert_eq!(unique.len(), 3);
    }
}
