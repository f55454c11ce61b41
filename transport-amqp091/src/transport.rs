//! `AmqpTransport`: retry-core's `Transport` over one lapin connection.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, Event};
use retry_core::headers::{Origin, clone_headers};
use retry_core::{
    BrokerSignals, Capabilities, Delivery, DeliveryFacts, Message, MessageParts, Publish,
    PublishResult, Settlement, TopologyPlan, Transport, TransportError, message_identity,
};
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::acks::{Acks, Refusal};
use crate::config::AmqpConfig;
use crate::convert::{headers_from_table, properties_from_amqp, properties_to_amqp};
use crate::error::{connection_error, short};
use crate::provision::{self, ProvisionReport};

/// Settles one delivery: the channel incarnation it came on and its tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AmqpTag {
    epoch: u64,
    delivery_tag: u64,
}

impl AmqpTag {
    /// The broker's delivery tag.
    pub fn delivery_tag(&self) -> u64 {
        self.delivery_tag
    }
}

struct Consuming {
    queue: String,
    consumer_tag: String,
    consumer: lapin::Consumer,
}

/// A RabbitMQ (AMQP 0-9-1) transport: one connection, a consuming channel with a prefetch,
/// and a publishing channel in confirm mode.
///
/// * Clones are published `mandatory`, and only a plain positive confirm counts: a returned
///   (unroutable) or nacked publish, a channel error or a confirm timeout is a failure, and
///   the engine requeues the original.
/// * Acknowledgements are batched with `multiple` where that is safe (see the `acks`
///   module); requeues and rejects are sent at once.
/// * With automatic recovery on, a dropped connection is re-established; deliveries held
///   across the drop come back redelivered, and their old tags are never acked on the new
///   channel.
///
/// ```no_run
/// use retry_core::{RetryPolicy, TopologyPlan, Transport};
/// use transport_amqp091::{AmqpConfig, AmqpTransport};
/// use std::time::Duration;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let transport = AmqpTransport::connect(AmqpConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")).await?;
/// let policy = RetryPolicy::delays([Duration::from_secs(30), Duration::from_secs(600)]).build()?;
/// let plan = TopologyPlan::new("comments", &policy)?;
/// transport.provision(&plan).await?;
/// # Ok(()) }
/// ```
pub struct AmqpTransport {
    config: AmqpConfig,
    connection: Connection,
    publish_channel: Mutex<Channel>,
    consume_channel: Channel,
    consuming: Mutex<Option<Consuming>>,
    acks: Arc<Acks>,
    recoveries: Arc<AtomicU64>,
    last_report: StdMutex<Option<ProvisionReport>>,
}

impl std::fmt::Debug for AmqpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpTransport")
            .field("config", &self.config)
            .field("recoveries", &self.recoveries())
            .finish_non_exhaustive()
    }
}

impl AmqpTransport {
    /// Connects, opens the channels and puts the publishing one in confirm mode.
    pub async fn connect(config: AmqpConfig) -> Result<Self, TransportError> {
        let mut properties = ConnectionProperties::default();
        if config.auto_recover() {
            properties = properties.enable_auto_recover();
        }
        if let Some(name) = config.connection_name() {
            properties = properties.with_connection_name(name.into());
        }
        let connection = Connection::connect(config.url(), properties)
            .await
            .map_err(|e| {
                TransportError::Connection(format!(
                    "cannot connect to {}: {e}",
                    config.redacted_url()
                ))
            })?;
        let publish_channel = confirm_channel(&connection).await?;
        let consume_channel = connection
            .create_channel()
            .await
            .map_err(connection_error)?;
        let recoveries = Arc::new(AtomicU64::new(0));
        watch_connection(&connection, Arc::clone(&recoveries));
        let acks = Arc::new(Acks::default());
        spawn_flusher(Arc::downgrade(&acks), config.ack_flush_interval());
        info!(url = %config.redacted_url(), "connected");
        Ok(AmqpTransport {
            config,
            connection,
            publish_channel: Mutex::new(publish_channel),
            consume_channel,
            consuming: Mutex::new(None),
            acks,
            recoveries,
            last_report: StdMutex::new(None),
        })
    }

    /// The settings.
    pub fn config(&self) -> &AmqpConfig {
        &self.config
    }

    /// The underlying lapin connection, for whatever this transport does not cover.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// What the latest [`provision`](Transport::provision) created and verified.
    pub fn last_provision_report(&self) -> Option<ProvisionReport> {
        self.last_report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Deletes every queue and exchange of `plan`, with their messages. For tests and
    /// decommissioning.
    pub async fn teardown(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        provision::teardown(&self.connection, plan).await
    }

    /// Sends the batched acknowledgements and closes the connection. Deliveries left
    /// unsettled (a consumer stopped past its shutdown grace) go back to their queue now;
    /// while the connection stays open the broker keeps them as unacknowledged.
    pub async fn close(&self) -> Result<(), TransportError> {
        self.acks.flush().await;
        self.connection
            .close(200, "closing".into())
            .await
            .map_err(connection_error)
    }

    /// How many times the connection has been recovered.
    pub fn recoveries(&self) -> u64 {
        self.recoveries.load(Ordering::Relaxed)
    }

    /// Sends every batched acknowledgement now.
    pub async fn flush_acks(&self) {
        self.acks.flush().await;
    }

    async fn publish_channel(&self) -> Result<Channel, TransportError> {
        let mut channel = self.publish_channel.lock().await;
        if !channel.status().connected() && self.connection.status().connected() {
            // A channel error (say, a missing exchange) closed it; the connection is fine.
            *channel = confirm_channel(&self.connection).await?;
            debug!("publishing channel reopened");
        }
        Ok(channel.clone())
    }

    async fn publish_inner(
        &self,
        original: &Message,
        publish: &Publish,
    ) -> Result<Confirmation, TransportError> {
        let origin = Origin {
            queue: original.queue(),
            exchange: original.exchange(),
            routing_key: original.routing_key(),
        };
        let headers = clone_headers(original.headers(), origin, &publish.headers);
        let properties = properties_to_amqp(original.properties(), &headers, publish.expiration);
        let exchange = short(&publish.route.exchange)?;
        let routing_key = short(&publish.route.routing_key)?;
        let channel = self.publish_channel().await?;
        let confirm = channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                original.body(),
                properties,
            )
            .await
            .map_err(connection_error)?;
        confirm.await.map_err(connection_error)
    }

    async fn recover_consumer(&self, err: lapin::Error) -> Result<(), TransportError> {
        warn!(error = %err, "consuming channel lost; waiting for recovery");
        self.consume_channel
            .wait_for_recovery(err)
            .await
            .map_err(connection_error)
    }
}

async fn confirm_channel(connection: &Connection) -> Result<Channel, TransportError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(connection_error)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(connection_error)?;
    Ok(channel)
}

/// Logs every loss and recovery of the connection, and counts the recoveries.
fn watch_connection(connection: &Connection, recoveries: Arc<AtomicU64>) {
    let mut events = connection.events_listener();
    tokio::spawn(async move {
        let mut lost = false;
        while let Some(event) = events.next().await {
            match event {
                Event::Error(e) => {
                    lost = true;
                    warn!(error = %e, "connection lost; recovering");
                }
                Event::Connected if lost => {
                    lost = false;
                    let n = recoveries.fetch_add(1, Ordering::Relaxed) + 1;
                    warn!(
                        recoveries = n,
                        "connection recovered; deliveries held across the drop will be redelivered"
                    );
                }
                Event::ConnectionBlocked(reason) => warn!(reason, "broker blocked publishing"),
                Event::ConnectionUnblocked => info!("broker unblocked publishing"),
                _ => {}
            }
        }
    });
}

/// Flushes batched acks on a timer, so a quiet consumer never sits on finished deliveries.
/// Stops when the transport is dropped.
fn spawn_flusher(acks: Weak<Acks>, every: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every.max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(acks) = acks.upgrade() else { break };
            if acks.has_done() {
                acks.flush().await;
            }
        }
    });
}

#[async_trait]
impl Transport for AmqpTransport {
    type Tag = AmqpTag;

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            publisher_confirms: true,
            // Quorum queues add `x-delivery-count`; classic queues only the flag.
            delivery_count: true,
            native_delays: false,
            dead_letter_exchange: true,
            declares_topology: true,
        }
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        let report = provision::provision(&self.connection, plan).await?;
        *self.last_report.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
        Ok(())
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError> {
        self.consume_channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(connection_error)?;
        let consumer_tag = format!("retry-{}-{}", queue, self.consume_channel.id());
        let consumer = self
            .consume_channel
            .basic_consume(
                short(queue)?,
                short(&consumer_tag)?,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| match crate::error::amqp_code(&e) {
                Some(404) => TransportError::MissingAddress {
                    address: format!("queue {queue:?}"),
                    hint: "provision the topology first (Transport::provision)".into(),
                },
                _ => connection_error(e),
            })?;
        self.acks.set_batch(usize::from(prefetch / 2));
        *self.consuming.lock().await = Some(Consuming {
            queue: queue.to_owned(),
            consumer_tag,
            consumer,
        });
        info!(queue, prefetch, "consuming");
        Ok(())
    }

    async fn recv(&self) -> Result<Option<Delivery<AmqpTag>>, TransportError> {
        let mut guard = self.consuming.lock().await;
        let Some(consuming) = guard.as_mut() else {
            return Ok(None);
        };
        loop {
            // Acks left below the batch size are sent by the flusher within its interval, so
            // a broker holding deliveries back for them is never kept waiting for long.
            let delivery = match consuming.consumer.next().await {
                None => return Ok(None),
                Some(Err(err)) => {
                    self.recover_consumer(err).await?;
                    continue;
                }
                Some(Ok(d)) => d,
            };
            let epoch = self
                .acks
                .received(delivery.delivery_tag, delivery.acker.clone());
            let headers = delivery
                .properties
                .headers()
                .as_ref()
                .map(headers_from_table)
                .unwrap_or_default();
            let properties = properties_from_amqp(&delivery.properties);
            let identity = message_identity(properties.message_id.as_deref(), &delivery.data);
            let facts = DeliveryFacts::decode(
                &headers,
                BrokerSignals {
                    redelivered: delivery.redelivered,
                    delivery_count: None,
                },
                identity,
            );
            let message = Message::new(MessageParts {
                queue: consuming.queue.clone(),
                exchange: delivery.exchange.as_str().to_owned(),
                routing_key: delivery.routing_key.as_str().to_owned(),
                body: delivery.data,
                properties,
                headers,
            });
            return Ok(Some(Delivery {
                tag: AmqpTag {
                    epoch,
                    delivery_tag: delivery.delivery_tag,
                },
                message,
                facts,
            }));
        }
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let timeout = self.config.confirm_timeout();
        match tokio::time::timeout(timeout, self.publish_inner(original, publish)).await {
            Err(_) => PublishResult::Failed(TransportError::Timeout {
                operation: "publisher confirm",
                after: timeout,
            }),
            Ok(Ok(Confirmation::Ack(None))) => PublishResult::Confirmed,
            Ok(Ok(Confirmation::Ack(Some(returned)))) => {
                debug!(reply = returned.reply_code, "clone returned as unroutable");
                PublishResult::Returned
            }
            Ok(Ok(Confirmation::Nack(Some(_)))) => PublishResult::Returned,
            Ok(Ok(Confirmation::Nack(None))) => PublishResult::Refused,
            Ok(Ok(Confirmation::NotRequested)) => PublishResult::Failed(TransportError::Other(
                "the publishing channel is not in confirm mode".into(),
            )),
            Ok(Err(e)) => PublishResult::Failed(e),
        }
    }

    async fn settle(&self, tag: &AmqpTag, settlement: Settlement) -> Result<(), TransportError> {
        let sent = match settlement {
            Settlement::Ack => self.acks.done(tag.epoch, tag.delivery_tag).await,
            Settlement::Requeue => self
                .acks
                .refuse(tag.epoch, tag.delivery_tag, Refusal::Requeue)
                .await
                .map_err(connection_error)?,
            Settlement::Reject => self
                .acks
                .refuse(tag.epoch, tag.delivery_tag, Refusal::Reject)
                .await
                .map_err(connection_error)?,
        };
        if !sent {
            // The delivery belongs to a channel that has since been recovered: the broker
            // has it back and will redeliver it. Never settle it on the new channel.
            warn!(
                tag = tag.delivery_tag,
                ?settlement,
                "stale delivery not settled; the broker redelivers it"
            );
        }
        Ok(())
    }

    /// tokio's timer wheel: far cheaper per handler run than the default's timer thread.
    fn sleep(&self, duration: Duration) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        let consuming = self.consuming.lock().await.take();
        if let Some(c) = consuming {
            self.consume_channel
                .basic_cancel(short(&c.consumer_tag)?, BasicCancelOptions::default())
                .await
                .map_err(connection_error)?;
            info!(queue = c.queue, "stopped consuming");
        }
        self.acks.flush().await;
        Ok(())
    }
}
