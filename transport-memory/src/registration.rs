//! This transport in a [`Registry`](retry_core::Registry): `memory://`.

use retry_core::{ConnectError, DynTransport, Endpoint, Registration, TransportError};

use crate::Broker;

/// The in-memory broker for a [`Registry`](retry_core::Registry): the name `memory` and the
/// URL `memory://`, which connects to a new [`Broker`] of its own each time. Its clock is
/// virtual and moves only inside [`Broker::block_on`]: reach the broker through the
/// transport, as below, to publish to it and to run a consumer on it. The transport keeps
/// [`Admin`](retry_core::Admin) ([`DynTransport::with_admin`]).
///
/// ```
/// use retry_core::{Registry, TopologyPlan, RetryPolicy, Transport};
/// use transport_memory::{MemoryTransport, Outgoing};
///
/// # futures::executor::block_on(async {
/// let registry = Registry::new().with(transport_memory::registration());
/// let transport = registry.connect("memory://").await?;
/// let broker = transport.downcast_ref::<MemoryTransport>().unwrap().broker().clone();
/// broker.block_on(async {
///     let plan = TopologyPlan::new("orders", &RetryPolicy::default())?;
///     transport.provision(&plan).await?;
///     broker.publish(Outgoing::to_queue("orders", "hello".into()))?;
///     let delivery = transport.fetch("orders").await?.expect("the message");
///     assert_eq!(delivery.message.body(), b"hello");
///     Ok::<(), Box<dyn std::error::Error>>(())
/// })?;
///
/// // Anything after the scheme is refused: each connection is a broker of its own.
/// assert!(registry.connect("memory://orders").await.is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub fn registration() -> Registration {
    Registration::new(
        "memory",
        "in-memory broker",
        ["memory"],
        |endpoint: Endpoint| async move {
            let rest = endpoint
                .url()
                .split_once("://")
                .map_or("", |(_, rest)| rest);
            if !rest.is_empty() {
                return Err(ConnectError::Transport(TransportError::Unsupported {
                    what: format!("the URL {:?}", endpoint.url()),
                    why: "memory:// takes nothing after the scheme: each connection is a new \
                          broker, reached through the transport (MemoryTransport::broker)"
                        .to_owned(),
                }));
            }
            Ok(DynTransport::with_admin(Broker::new().connect()))
        },
    )
}
