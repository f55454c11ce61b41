//! [`DynTransport`]: any [`Transport`] behind one type, chosen at run time.
//!
//! A [`Transport`] names its delivery tags and subscriptions as associated types, so code
//! generic over it is monomorphised per transport, and a program that picks its broker from
//! a URL cannot name the type it gets. `DynTransport` erases them: its tags are [`DynTag`]s
//! and its subscriptions [`DynSubscription`]s, and every call goes to the transport inside.
//! The [`Registry`](crate::Registry) hands out transports this way.
//!
//! What the erasure costs per delivery: the tag is moved into one shared allocation, and a
//! subscription's `recv` wraps the inner transport's future in one more box. `publish` and
//! `settle` hand back the inner transport's own future, with no second box. The
//! `transport-memory` benchmark `erasure` measures both against the concrete type in the same
//! run (see `docs/benchmarks.md`).

use std::any::{Any, type_name};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::{
    Admin, AppliedObject, Capabilities, CheckReport, Delivery, Depth, Message, PlanOptions,
    Publish, PublishResult, QueueWalk, Settlement, SoloGate, Subscription, Timestamp, TopologyPlan,
    Transport, TransportError,
};

/// A delivery tag of any transport: what [`DynTransport`] hands out and takes back.
///
/// Cloning it is a reference count. A tag settles only on the kind of transport that made
/// it; another kind refuses it with [`TransportError::Unsupported`] naming both tag types.
///
/// ```
/// use retry_core::DynTag;
///
/// let tag = DynTag::new(42_u64);
/// assert_eq!(tag.downcast_ref::<u64>(), Some(&42));
/// assert_eq!(tag.downcast_ref::<u32>(), None);
/// assert_eq!(format!("{tag:?}"), "42");
/// ```
#[derive(Clone)]
pub struct DynTag(Arc<dyn ErasedTag>);

trait ErasedTag: Any + fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;
    fn type_name(&self) -> &'static str;
}

impl<T: Any + fmt::Debug + Send + Sync> ErasedTag for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn type_name(&self) -> &'static str {
        type_name::<T>()
    }
}

impl DynTag {
    /// Wraps a transport's tag.
    pub fn new<T: Any + fmt::Debug + Send + Sync>(tag: T) -> Self {
        DynTag(Arc::new(tag))
    }

    /// The tag inside, if it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        // Through the `dyn`: the `Arc` is an `ErasedTag` of its own.
        (*self.0).as_any().downcast_ref()
    }

    /// The name of the type inside, for error messages.
    pub fn type_name(&self) -> &'static str {
        (*self.0).type_name()
    }
}

impl fmt::Debug for DynTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// The refusal of a tag that another kind of transport made.
fn foreign_tag<Expected>(tag: &DynTag) -> TransportError {
    TransportError::Unsupported {
        what: format!("settling a delivery tag of type {}", tag.type_name()),
        why: format!(
            "this transport's tags are {}: a tag settles only on the kind of transport that \
             delivered it",
            type_name::<Expected>()
        ),
    }
}

fn erase<Tag: Any + fmt::Debug + Send + Sync>(delivery: Delivery<Tag>) -> Delivery<DynTag> {
    Delivery {
        tag: DynTag::new(delivery.tag),
        message: delivery.message,
        facts: delivery.facts,
    }
}

/// What [`DynTransport`] calls: [`Transport`] with its associated types erased, so that it
/// can be a trait object. Implemented for every transport.
trait ErasedTransport: Send + Sync + 'static {
    fn as_any(&self) -> &dyn Any;
    fn type_name(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;
    fn provision<'a>(&'a self, plan: &'a TopologyPlan)
    -> BoxFuture<'a, Result<(), TransportError>>;
    fn verify<'a>(&'a self, plan: &'a TopologyPlan) -> BoxFuture<'a, Result<(), TransportError>>;
    fn consume<'a>(
        &'a self,
        queue: &'a str,
        prefetch: u16,
    ) -> BoxFuture<'a, Result<DynSubscription, TransportError>>;
    fn fetch<'a>(
        &'a self,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Option<Delivery<DynTag>>, TransportError>>;
    fn ready<'a>(
        &'a self,
        queue: &'a str,
        poll: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    fn publish<'a>(
        &'a self,
        original: &'a Message,
        publish: &'a Publish,
    ) -> BoxFuture<'a, PublishResult>;
    fn settle<'a>(
        &'a self,
        tag: &'a DynTag,
        settlement: Settlement,
    ) -> BoxFuture<'a, Result<(), TransportError>>;
    fn walk<'a: 'f, 'q: 'f, 'f>(
        &'a self,
        queue: &'q str,
    ) -> BoxFuture<'f, Result<Box<dyn QueueWalk<DynTag> + 'a>, TransportError>>;
    fn close(&self) -> BoxFuture<'_, ()>;
    fn now(&self) -> Timestamp;
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
    fn solo_gate(&self) -> Option<SoloGate>;
}

impl<T: Transport> ErasedTransport for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn type_name(&self) -> &'static str {
        type_name::<T>()
    }

    fn capabilities(&self) -> Capabilities {
        Transport::capabilities(self)
    }

    fn provision<'a>(
        &'a self,
        plan: &'a TopologyPlan,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Transport::provision(self, plan)
    }

    fn verify<'a>(&'a self, plan: &'a TopologyPlan) -> BoxFuture<'a, Result<(), TransportError>> {
        Transport::verify(self, plan)
    }

    fn consume<'a>(
        &'a self,
        queue: &'a str,
        prefetch: u16,
    ) -> BoxFuture<'a, Result<DynSubscription, TransportError>> {
        Box::pin(async move {
            let subscription = Transport::consume(self, queue, prefetch).await?;
            Ok(DynSubscription(Box::new(subscription)))
        })
    }

    fn fetch<'a>(
        &'a self,
        queue: &'a str,
    ) -> BoxFuture<'a, Result<Option<Delivery<DynTag>>, TransportError>> {
        Box::pin(async move { Ok(Transport::fetch(self, queue).await?.map(erase)) })
    }

    fn ready<'a>(
        &'a self,
        queue: &'a str,
        poll: Duration,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Transport::ready(self, queue, poll)
    }

    fn publish<'a>(
        &'a self,
        original: &'a Message,
        publish: &'a Publish,
    ) -> BoxFuture<'a, PublishResult> {
        Transport::publish(self, original, publish)
    }

    fn settle<'a>(
        &'a self,
        tag: &'a DynTag,
        settlement: Settlement,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        match tag.downcast_ref::<T::Tag>() {
            Some(tag) => Transport::settle(self, tag, settlement),
            None => Box::pin(std::future::ready(Err(foreign_tag::<T::Tag>(tag)))),
        }
    }

    fn walk<'a: 'f, 'q: 'f, 'f>(
        &'a self,
        queue: &'q str,
    ) -> BoxFuture<'f, Result<Box<dyn QueueWalk<DynTag> + 'a>, TransportError>> {
        Box::pin(async move {
            let inner = Transport::walk(self, queue).await?;
            let walk: Box<dyn QueueWalk<DynTag> + 'a> = Box::new(DynWalk::<T::Tag> {
                inner,
                foreign: None,
            });
            Ok(walk)
        })
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Transport::close(self)
    }

    fn now(&self) -> Timestamp {
        Transport::now(self)
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Transport::sleep(self, duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        Transport::solo_gate(self)
    }
}

/// Any [`Transport`], with its tags and subscriptions erased: what a
/// [`Registry`](crate::Registry) connects to, for a program that picks its broker at run
/// time. Cloning it shares the transport inside.
///
/// It is a transport itself, so everything generic over [`Transport`] takes it:
/// [`Consumer`](crate::Consumer), [`ParkingLot`](crate::ParkingLot), the conformance suite.
/// [`downcast_ref`](Self::downcast_ref) gets the concrete transport back, for what only it
/// offers.
///
/// ```
/// # use async_trait::async_trait;
/// # use retry_core::*;
/// # use std::time::Duration;
/// # struct Null;
/// # #[async_trait]
/// # impl Transport for Null {
/// #   type Tag = u64;
/// #   type Subscription = Null;
/// #   fn capabilities(&self) -> Capabilities { Capabilities::default() }
/// #   async fn provision(&self, _: &TopologyPlan) -> Result<(), TransportError> { Ok(()) }
/// #   async fn consume(&self, _: &str, _: u16) -> Result<Null, TransportError> { Ok(Null) }
/// #   async fn fetch(&self, _: &str) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #   async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> { Ok(()) }
/// #   async fn publish(&self, _: &Message, _: &Publish) -> PublishResult { PublishResult::Confirmed }
/// #   async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # #[async_trait]
/// # impl Subscription for Null {
/// #     type Tag = u64;
/// #     async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> { Ok(None) }
/// #     async fn cancel(&self) -> Result<(), TransportError> { Ok(()) }
/// #     async fn flush(&self) -> Result<(), TransportError> { Ok(()) }
/// # }
/// # futures::executor::block_on(async {
/// async fn handle(_: Message) -> Result<(), HandlerError> { Ok(()) }
///
/// // `Null` is any transport; the consumer is the same type whichever it is.
/// let transport = DynTransport::new(Null);
/// assert!(transport.downcast_ref::<Null>().is_some());
/// let policy = RetryPolicy::delays([Duration::from_secs(30)]).build()?;
/// let consumer: Consumer<DynTransport, _> =
///     Consumer::builder(transport.clone(), "orders", policy, handle).build()?;
///
/// // A tag settles only on the kind of transport that made it.
/// let refused = transport.settle(&DynTag::new("not a u64"), Settlement::Ack).await;
/// assert!(matches!(refused, Err(TransportError::Unsupported { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct DynTransport {
    inner: Arc<dyn ErasedTransport>,
    /// The same transport as an [`Admin`], when it was erased with
    /// [`with_admin`](DynTransport::with_admin).
    admin: Option<Arc<dyn ErasedAdmin>>,
}

impl DynTransport {
    /// Erases `transport`. Its [`Admin`] calls are refused with
    /// [`TransportError::Unsupported`]: [`with_admin`](Self::with_admin) keeps them.
    pub fn new<T: Transport>(transport: T) -> Self {
        DynTransport {
            inner: Arc::new(transport),
            admin: None,
        }
    }

    /// Erases `transport`, keeping what it offers operators' tools ([`Admin`]): what a
    /// [`Registration`](crate::Registration) hands out for `retryctl`.
    pub fn with_admin<T: Admin>(transport: T) -> Self {
        let shared = Arc::new(transport);
        DynTransport {
            inner: Arc::clone(&shared) as Arc<dyn ErasedTransport>,
            admin: Some(shared),
        }
    }

    /// Whether [`Admin`] calls reach the transport inside ([`with_admin`](Self::with_admin)).
    pub fn has_admin(&self) -> bool {
        self.admin.is_some()
    }

    /// The transport inside, if it is a `T` (the type given to [`new`](Self::new)).
    pub fn downcast_ref<T: Transport>(&self) -> Option<&T> {
        (*self.inner).as_any().downcast_ref()
    }

    /// The name of the transport type inside, such as
    /// `transport_amqp091::transport::AmqpTransport`.
    pub fn type_name(&self) -> &'static str {
        (*self.inner).type_name()
    }

    fn admin(&self) -> Result<&dyn ErasedAdmin, TransportError> {
        self.admin
            .as_deref()
            .ok_or_else(|| TransportError::Unsupported {
                what: "administering the broker".into(),
                why: format!(
                    "{} was erased with DynTransport::new, which keeps only the data path: \
                     erase a transport that implements Admin with DynTransport::with_admin",
                    self.type_name()
                ),
            })
    }
}

/// What [`DynTransport`] calls for [`Admin`]: the trait with its futures boxed.
trait ErasedAdmin: Send + Sync + 'static {
    fn depth<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, Result<Depth, TransportError>>;
    fn apply<'a>(
        &'a self,
        plan: &'a TopologyPlan,
    ) -> BoxFuture<'a, Result<Vec<AppliedObject>, TransportError>>;
    fn check<'a>(
        &'a self,
        plan: &'a TopologyPlan,
        options: &'a PlanOptions,
    ) -> BoxFuture<'a, Result<CheckReport, TransportError>>;
    fn may_hide_headers(&self) -> bool;
    fn hidden_headers(&self, message: &Message) -> Option<String>;
}

impl<T: Admin> ErasedAdmin for T {
    fn depth<'a>(&'a self, queue: &'a str) -> BoxFuture<'a, Result<Depth, TransportError>> {
        Admin::depth(self, queue)
    }

    fn apply<'a>(
        &'a self,
        plan: &'a TopologyPlan,
    ) -> BoxFuture<'a, Result<Vec<AppliedObject>, TransportError>> {
        Admin::apply(self, plan)
    }

    fn check<'a>(
        &'a self,
        plan: &'a TopologyPlan,
        options: &'a PlanOptions,
    ) -> BoxFuture<'a, Result<CheckReport, TransportError>> {
        Admin::check(self, plan, options)
    }

    fn may_hide_headers(&self) -> bool {
        Admin::may_hide_headers(self)
    }

    fn hidden_headers(&self, message: &Message) -> Option<String> {
        Admin::hidden_headers(self, message)
    }
}

/// The [`Admin`] of the transport inside, when it was erased with
/// [`with_admin`](DynTransport::with_admin); else every call is
/// [`TransportError::Unsupported`], and nothing hides headers.
#[async_trait]
impl Admin for DynTransport {
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        self.admin()?.depth(queue).await
    }

    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        self.admin()?.apply(plan).await
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        self.admin()?.check(plan, options).await
    }

    fn may_hide_headers(&self) -> bool {
        self.admin.as_ref().is_some_and(|a| a.may_hide_headers())
    }

    fn hidden_headers(&self, message: &Message) -> Option<String> {
        self.admin.as_ref()?.hidden_headers(message)
    }
}

impl fmt::Debug for DynTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("DynTransport")
            .field(&self.type_name())
            .finish()
    }
}

#[async_trait]
impl Transport for DynTransport {
    type Tag = DynTag;
    type Subscription = DynSubscription;

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.provision(plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.verify(plan).await
    }

    async fn consume(&self, queue: &str, prefetch: u16) -> Result<DynSubscription, TransportError> {
        self.inner.consume(queue, prefetch).await
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<DynTag>>, TransportError> {
        self.inner.fetch(queue).await
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        self.inner.ready(queue, poll).await
    }

    // The two calls of every delivery hand back the inner transport's future as it is,
    // written as `async_trait` expands an `async fn`, as `Arc<T>`'s forwarding does.
    fn publish<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        original: &'life1 Message,
        publish: &'life2 Publish,
    ) -> Pin<Box<dyn Future<Output = PublishResult> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        self.inner.publish(original, publish)
    }

    fn settle<'life0, 'life1, 'async_trait>(
        &'life0 self,
        tag: &'life1 DynTag,
        settlement: Settlement,
    ) -> Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        self.inner.settle(tag, settlement)
    }

    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<DynTag> + 'a>, TransportError> {
        self.inner.walk(queue).await
    }

    async fn close(&self) {
        self.inner.close().await
    }

    fn now(&self) -> Timestamp {
        self.inner.now()
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.inner.sleep(duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        self.inner.solo_gate()
    }
}

/// A [`DynTransport`]'s subscription: any transport's, with its tags erased.
pub struct DynSubscription(Box<dyn ErasedSubscription>);

impl fmt::Debug for DynSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DynSubscription")
    }
}

trait ErasedSubscription: Send + Sync + 'static {
    fn recv(&self) -> BoxFuture<'_, Result<Option<Delivery<DynTag>>, TransportError>>;
    fn cancel(&self) -> BoxFuture<'_, Result<(), TransportError>>;
    fn flush(&self) -> BoxFuture<'_, Result<(), TransportError>>;
}

impl<S: Subscription> ErasedSubscription for S {
    fn recv(&self) -> BoxFuture<'_, Result<Option<Delivery<DynTag>>, TransportError>> {
        let inner = Subscription::recv(self);
        Box::pin(async move { Ok(inner.await?.map(erase)) })
    }

    fn cancel(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Subscription::cancel(self)
    }

    fn flush(&self) -> BoxFuture<'_, Result<(), TransportError>> {
        Subscription::flush(self)
    }
}

#[async_trait]
impl Subscription for DynSubscription {
    type Tag = DynTag;

    fn recv<'life0, 'async_trait>(
        &'life0 self,
    ) -> Pin<
        Box<
            dyn Future<Output = Result<Option<Delivery<DynTag>>, TransportError>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        self.0.recv()
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.0.cancel().await
    }

    async fn flush(&self) -> Result<(), TransportError> {
        self.0.flush().await
    }
}

/// A walk of a [`DynTransport`]'s queue: the inner transport's walk, its tags erased.
struct DynWalk<'a, Tag> {
    inner: Box<dyn QueueWalk<Tag> + 'a>,
    /// A tag of another kind given to `leave`, which cannot fail: reported by `end`.
    foreign: Option<TransportError>,
}

#[async_trait]
impl<Tag> QueueWalk<DynTag> for DynWalk<'_, Tag>
where
    Tag: Clone + Any + fmt::Debug + Send + Sync,
{
    async fn next(&mut self) -> Result<Option<Delivery<DynTag>>, TransportError> {
        Ok(self.inner.next().await?.map(erase))
    }

    fn leave(&mut self, tag: DynTag) {
        match tag.downcast_ref::<Tag>() {
            Some(inner) => self.inner.leave(inner.clone()),
            None => {
                self.foreign.get_or_insert(foreign_tag::<Tag>(&tag));
            }
        }
    }

    async fn ack(&mut self, tag: DynTag) -> Result<(), TransportError> {
        match tag.downcast_ref::<Tag>() {
            Some(inner) => self.inner.ack(inner.clone()).await,
            None => Err(foreign_tag::<Tag>(&tag)),
        }
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        let ended = self.inner.end().await;
        match self.foreign.take() {
            Some(foreign) => Err(foreign),
            None => ended,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_read_back_as_its_own_type_only() {
        let tag = DynTag::new(7_u64);
        let copy = tag.clone();
        assert_eq!(copy.downcast_ref::<u64>(), Some(&7));
        assert!(copy.downcast_ref::<i64>().is_none());
        assert_eq!(tag.type_name(), "u64");
        let refused = foreign_tag::<String>(&tag).to_string();
        assert!(
            refused.contains("u64") && refused.contains("String"),
            "{refused}"
        );
    }
}
