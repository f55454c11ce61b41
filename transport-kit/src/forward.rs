//! A forwarding layer for transport decorators: a decorator overrides only what it changes,
//! and everything else reaches the transport it wraps.
//!
//! A decorator of a transport (a journal of every settlement, a record of every delivery, a
//! transport that verifies instead of declaring) changes two or three methods and forwards
//! the rest. Written by hand, such a wrapper compiles even when it forgets one of
//! [`Transport`]'s provided methods (`verify`, `walk`, `close`, `now`, `sleep`,
//! `solo_gate`), and then silently runs the trait's default instead of the inner transport's
//! own: the wall clock instead of a simulated one, the process's [`SoloGate`] instead of the
//! broker's, a `close` that closes nothing. Here the forwarding is written once:
//!
//! * [`Decorate`] is what a decorator implements: one hook per method of [`Transport`], of
//!   its [`Subscription`]s and [`QueueWalk`]s, and of [`Admin`], each given the inner
//!   transport (or subscription, or walk) and each forwarding to it by default.
//! * [`Decorated`] is a transport and a decorator together. It implements [`Transport`] by
//!   calling the hooks, and [`Admin`] too when the inner transport does, so a decorated
//!   transport can be handed to [`DynTransport::with_admin`](retry_core::DynTransport::with_admin)
//!   and to `retryctl`.
//! * Every delivery, from a subscription, a fetch or a walk, passes once through
//!   [`Decorate::delivered`]. What it returns, the decorator's [`Mark`](Decorate::Mark),
//!   travels with the delivery's tag ([`MarkedTag`]) and comes back to the hooks that settle
//!   it: a decorator that journals settlements by message id notes the id there.
//!
//! The layer is a type of its own rather than a blanket `impl<D: Decorate> Transport for D`
//! because Rust's orphan rule forbids that blanket impl outside `retry-core`.
//!
//! ```
//! use std::sync::Mutex;
//! use retry_core::{
//!     Delivery, RetryPolicy, Settlement, TopologyPlan, Transport, TransportError,
//! };
//! use transport_kit::forward::{Decorate, Decorated};
//! use transport_memory::{Broker, Outgoing};
//!
//! /// Writes down each settlement with the id of the message it settles.
//! #[derive(Default)]
//! struct Settlements(Mutex<Vec<String>>);
//!
//! impl<T: Transport> Decorate<T> for Settlements {
//!     /// The message id, noted when the delivery arrives.
//!     type Mark = String;
//!
//!     fn delivered(&self, _queue: &str, delivery: &Delivery<T::Tag>) -> String {
//!         delivery.message.properties().message_id.clone().unwrap_or_default()
//!     }
//!
//!     async fn settle(
//!         &self,
//!         inner: &T,
//!         tag: &T::Tag,
//!         id: &String,
//!         settlement: Settlement,
//!     ) -> Result<(), TransportError> {
//!         self.0.lock().unwrap().push(format!("{id}: {settlement:?}"));
//!         inner.settle(tag, settlement).await
//!     }
//! }
//!
//! let broker = Broker::new();
//! let transport = Decorated::new(broker.connect(), Settlements::default());
//! let policy = RetryPolicy::delays([std::time::Duration::from_secs(30)]).build()?;
//! let plan = TopologyPlan::new("orders", &policy)?;
//! broker.block_on(async {
//!     transport.provision(&plan).await?;
//!     broker.publish(Outgoing::to_queue("orders", b"order 7".to_vec()).with_message_id("o-7"))?;
//!     let delivery = transport.fetch("orders").await?.expect("a message is ready");
//!     assert_eq!(delivery.tag.mark(), "o-7");
//!     transport.settle(&delivery.tag, Settlement::Ack).await
//! })?;
//! assert_eq!(*transport.decorator().0.lock().unwrap(), ["o-7: Ack"]);
//!
//! // What the decorator does not override is the inner transport's own: here the
//! // broker's virtual clock and its solo gate, not the wall clock and the process's gate.
//! assert_eq!(transport.now(), transport.inner().now());
//! assert!(transport.solo_gate().unwrap().same_as(&transport.inner().solo_gate().unwrap()));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use retry_core::{
    Admin, AppliedObject, Capabilities, CheckReport, Delivery, Depth, Message, PlanOptions,
    Publish, PublishResult, QueueWalk, Settlement, SoloGate, Subscription, Timestamp, TopologyPlan,
    Transport, TransportError,
};

/// The future [`Transport::sleep`] returns.
type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// What a decorator of transports of type `T` implements: one hook per method of
/// [`Transport`], of its subscriptions and walks, and of [`Admin`]. Every hook has a default
/// that forwards the call to the inner transport unchanged, so a decorator overrides only
/// the hooks of what it changes. [`Decorated`] calls them.
///
/// A hook receives the inner transport (or the inner subscription or walk) and does the
/// call itself: an override can act before the call, after it, on its result, or instead of
/// it. The asynchronous hooks are declared as returning `impl Future + Send`; an override is
/// written as an `async fn`, whose future must then be `Send`.
///
/// Every delivery, whichever way it arrives, goes through [`delivered`](Self::delivered)
/// exactly once, after the hook that received it ([`fetch`](Self::fetch),
/// [`recv`](Self::recv) or [`walk_next`](Self::walk_next)) has returned it.
///
/// The [`Admin`] hooks apply when `T` implements [`Admin`]; an override of one repeats the
/// `where T: Admin` bound when it is generic over `T`.
pub trait Decorate<T: Transport>: Send + Sync + 'static {
    /// What the decorator notes about each delivery when it arrives
    /// ([`delivered`](Self::delivered)) and gets back when the delivery is settled: `()`
    /// for a decorator that needs nothing. Its `Default` is what
    /// [`delivered`](Self::delivered) returns when not overridden.
    type Mark: Clone + Default + fmt::Debug + Send + Sync + 'static;

    /// Sees each delivery as it arrives from `queue`: from a subscription, a fetch or a walk.
    /// The default notes nothing: `Self::Mark::default()`.
    fn delivered(&self, queue: &str, delivery: &Delivery<T::Tag>) -> Self::Mark {
        let _ = (queue, delivery);
        Self::Mark::default()
    }

    /// [`Transport::capabilities`]. The default: the inner transport's.
    fn capabilities(&self, inner: &T) -> Capabilities {
        inner.capabilities()
    }

    /// [`Transport::provision`]. The default forwards it.
    fn provision(
        &self,
        inner: &T,
        plan: &TopologyPlan,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        async move { inner.provision(plan).await }
    }

    /// [`Transport::verify`]. The default forwards it.
    fn verify(
        &self,
        inner: &T,
        plan: &TopologyPlan,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        async move { inner.verify(plan).await }
    }

    /// [`Transport::consume`]: the inner subscription, which [`Decorated`] wraps so that its
    /// calls go through [`recv`](Self::recv), [`cancel`](Self::cancel) and
    /// [`flush`](Self::flush). The default forwards it.
    fn consume(
        &self,
        inner: &T,
        queue: &str,
        prefetch: u16,
    ) -> impl Future<Output = Result<T::Subscription, TransportError>> + Send {
        async move { inner.consume(queue, prefetch).await }
    }

    /// [`Transport::fetch`]. The default forwards it.
    fn fetch(
        &self,
        inner: &T,
        queue: &str,
    ) -> impl Future<Output = Result<Option<Delivery<T::Tag>>, TransportError>> + Send {
        async move { inner.fetch(queue).await }
    }

    /// [`Transport::ready`]. The default forwards it.
    fn ready(
        &self,
        inner: &T,
        queue: &str,
        poll: Duration,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        async move { inner.ready(queue, poll).await }
    }

    /// [`Transport::publish`]. The default forwards it.
    fn publish(
        &self,
        inner: &T,
        original: &Message,
        publish: &Publish,
    ) -> impl Future<Output = PublishResult> + Send {
        async move { inner.publish(original, publish).await }
    }

    /// [`Transport::settle`] of a delivery whose inner tag is `tag` and whose mark is `mark`.
    /// The default forwards it.
    fn settle(
        &self,
        inner: &T,
        tag: &T::Tag,
        mark: &Self::Mark,
        settlement: Settlement,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = mark;
        async move { inner.settle(tag, settlement).await }
    }

    /// [`Transport::walk`]: the inner walk, which [`Decorated`] wraps so that its calls go
    /// through the `walk_*` hooks. The default forwards it, so a transport's own walk (AMQP
    /// 0-9-1 walks on a channel of its own) stays its own.
    fn walk<'a>(
        &self,
        inner: &'a T,
        queue: &str,
    ) -> impl Future<Output = Result<Box<dyn QueueWalk<T::Tag> + 'a>, TransportError>> + Send {
        async move { inner.walk(queue).await }
    }

    /// [`Transport::close`]. The default forwards it.
    fn close(&self, inner: &T) -> impl Future<Output = ()> + Send {
        async move { inner.close().await }
    }

    /// [`Transport::now`]. The default: the inner transport's clock.
    fn now(&self, inner: &T) -> Timestamp {
        inner.now()
    }

    /// [`Transport::sleep`]. The default: the inner transport's sleep.
    fn sleep(&self, inner: &T, duration: Duration) -> Sleep {
        inner.sleep(duration)
    }

    /// [`Transport::solo_gate`]. The default: the inner transport's gate.
    fn solo_gate(&self, inner: &T) -> Option<SoloGate> {
        inner.solo_gate()
    }

    /// [`Subscription::recv`] on a subscription to `queue`. The default forwards it.
    fn recv(
        &self,
        queue: &str,
        subscription: &T::Subscription,
    ) -> impl Future<Output = Result<Option<Delivery<T::Tag>>, TransportError>> + Send {
        let _ = queue;
        async move { subscription.recv().await }
    }

    /// [`Subscription::cancel`] on a subscription to `queue`. The default forwards it.
    fn cancel(
        &self,
        queue: &str,
        subscription: &T::Subscription,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = queue;
        async move { subscription.cancel().await }
    }

    /// [`Subscription::flush`] on a subscription to `queue`. The default forwards it.
    fn flush(
        &self,
        queue: &str,
        subscription: &T::Subscription,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = queue;
        async move { subscription.flush().await }
    }

    /// [`QueueWalk::next`] on a walk of `queue`. The default forwards it.
    fn walk_next(
        &self,
        queue: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
    ) -> impl Future<Output = Result<Option<Delivery<T::Tag>>, TransportError>> + Send {
        let _ = queue;
        async move { walk.next().await }
    }

    /// [`QueueWalk::leave`] on a walk of `queue`. The default forwards it.
    fn walk_leave(
        &self,
        queue: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
        tag: T::Tag,
        mark: Self::Mark,
    ) {
        let _ = (queue, mark);
        walk.leave(tag);
    }

    /// [`QueueWalk::ack`] on a walk of `queue`. The default forwards it.
    fn walk_ack(
        &self,
        queue: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
        tag: T::Tag,
        mark: Self::Mark,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = (queue, mark);
        async move { walk.ack(tag).await }
    }

    /// [`QueueWalk::end`] on a walk of `queue`. The default forwards it.
    fn walk_end(
        &self,
        queue: &str,
        walk: &mut (dyn QueueWalk<T::Tag> + '_),
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let _ = queue;
        async move { walk.end().await }
    }

    /// [`Admin::depth`]. The default forwards it.
    fn depth(
        &self,
        inner: &T,
        queue: &str,
    ) -> impl Future<Output = Result<Depth, TransportError>> + Send
    where
        T: Admin,
    {
        async move { inner.depth(queue).await }
    }

    /// [`Admin::apply`]. The default forwards it.
    fn apply(
        &self,
        inner: &T,
        plan: &TopologyPlan,
    ) -> impl Future<Output = Result<Vec<AppliedObject>, TransportError>> + Send
    where
        T: Admin,
    {
        async move { inner.apply(plan).await }
    }

    /// [`Admin::check`]. The default forwards it.
    fn check(
        &self,
        inner: &T,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> impl Future<Output = Result<CheckReport, TransportError>> + Send
    where
        T: Admin,
    {
        async move { inner.check(plan, options).await }
    }

    /// [`Admin::may_hide_headers`]. The default: the inner transport's answer.
    fn may_hide_headers(&self, inner: &T) -> bool
    where
        T: Admin,
    {
        inner.may_hide_headers()
    }

    /// [`Admin::hidden_headers`]. The default: the inner transport's answer.
    fn hidden_headers(&self, inner: &T, message: &Message) -> Option<String>
    where
        T: Admin,
    {
        inner.hidden_headers(message)
    }
}

/// A transport `T` decorated by `D`: a [`Transport`] whose every call goes through `D`'s
/// [`Decorate`] hooks, and an [`Admin`] when `T` is one. A type alias gives a decorated
/// transport its name: `type Recorded<T> = Decorated<T, DeliveryLog>`, where the delivery
/// log is the decorator.
///
/// Its tags are [`MarkedTag`]s, its subscriptions [`DecoratedSubscription`]s. The decorator
/// is shared (behind an [`Arc`]) with the subscriptions and walks made from it.
#[derive(Debug)]
pub struct Decorated<T, D> {
    inner: T,
    decorator: Arc<D>,
}

impl<T, D> Decorated<T, D> {
    /// `inner`, decorated by `decorator`.
    pub fn new(inner: T, decorator: D) -> Self {
        Decorated {
            inner,
            decorator: Arc::new(decorator),
        }
    }

    /// The transport inside, for what only it offers.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The decorator.
    pub fn decorator(&self) -> &D {
        &self.decorator
    }
}

/// The tag of a delivery of a [`Decorated`] transport: the inner transport's tag, and the
/// decorator's [`Mark`](Decorate::Mark) for that delivery.
#[derive(Clone, Debug)]
pub struct MarkedTag<Tag, M> {
    tag: Tag,
    mark: M,
}

impl<Tag, M> MarkedTag<Tag, M> {
    /// The inner transport's tag.
    pub fn tag(&self) -> &Tag {
        &self.tag
    }

    /// What the decorator noted when the delivery arrived.
    pub fn mark(&self) -> &M {
        &self.mark
    }
}

/// `delivery` with its tag marked by `decorator`.
fn marked<T: Transport, D: Decorate<T>>(
    decorator: &D,
    queue: &str,
    delivery: Delivery<T::Tag>,
) -> Delivery<MarkedTag<T::Tag, D::Mark>> {
    let mark = decorator.delivered(queue, &delivery);
    let Delivery {
        tag,
        message,
        facts,
    } = delivery;
    Delivery {
        tag: MarkedTag { tag, mark },
        message,
        facts,
    }
}

#[async_trait]
impl<T: Transport, D: Decorate<T>> Transport for Decorated<T, D> {
    type Tag = MarkedTag<T::Tag, D::Mark>;
    type Subscription = DecoratedSubscription<T, D>;

    fn capabilities(&self) -> Capabilities {
        self.decorator.capabilities(&self.inner)
    }

    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.decorator.provision(&self.inner, plan).await
    }

    async fn verify(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.decorator.verify(&self.inner, plan).await
    }

    async fn consume(
        &self,
        queue: &str,
        prefetch: u16,
    ) -> Result<Self::Subscription, TransportError> {
        let inner = self.decorator.consume(&self.inner, queue, prefetch).await?;
        Ok(DecoratedSubscription {
            inner,
            decorator: Arc::clone(&self.decorator),
            queue: queue.to_owned(),
        })
    }

    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        let got = self.decorator.fetch(&self.inner, queue).await?;
        Ok(got.map(|d| marked(&*self.decorator, queue, d)))
    }

    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        self.decorator.ready(&self.inner, queue, poll).await
    }

    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        self.decorator.publish(&self.inner, original, publish).await
    }

    async fn settle(&self, tag: &Self::Tag, settlement: Settlement) -> Result<(), TransportError> {
        self.decorator
            .settle(&self.inner, &tag.tag, &tag.mark, settlement)
            .await
    }

    async fn walk<'a>(
        &'a self,
        queue: &str,
    ) -> Result<Box<dyn QueueWalk<Self::Tag> + 'a>, TransportError> {
        let inner = self.decorator.walk(&self.inner, queue).await?;
        Ok(Box::new(DecoratedWalk::<T, D> {
            inner,
            decorator: &self.decorator,
            queue: queue.to_owned(),
        }))
    }

    async fn close(&self) {
        self.decorator.close(&self.inner).await
    }

    fn now(&self) -> Timestamp {
        self.decorator.now(&self.inner)
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        self.decorator.sleep(&self.inner, duration)
    }

    fn solo_gate(&self) -> Option<SoloGate> {
        self.decorator.solo_gate(&self.inner)
    }
}

#[async_trait]
impl<T: Admin, D: Decorate<T>> Admin for Decorated<T, D> {
    async fn depth(&self, queue: &str) -> Result<Depth, TransportError> {
        self.decorator.depth(&self.inner, queue).await
    }

    async fn apply(&self, plan: &TopologyPlan) -> Result<Vec<AppliedObject>, TransportError> {
        self.decorator.apply(&self.inner, plan).await
    }

    async fn check(
        &self,
        plan: &TopologyPlan,
        options: &PlanOptions,
    ) -> Result<CheckReport, TransportError> {
        self.decorator.check(&self.inner, plan, options).await
    }

    fn may_hide_headers(&self) -> bool {
        self.decorator.may_hide_headers(&self.inner)
    }

    fn hidden_headers(&self, message: &Message) -> Option<String> {
        self.decorator.hidden_headers(&self.inner, message)
    }
}

/// A subscription of a [`Decorated`] transport: the inner transport's, its calls going
/// through the decorator's [`recv`](Decorate::recv), [`cancel`](Decorate::cancel) and
/// [`flush`](Decorate::flush), and each delivery through
/// [`delivered`](Decorate::delivered).
pub struct DecoratedSubscription<T: Transport, D> {
    inner: T::Subscription,
    decorator: Arc<D>,
    queue: String,
}

impl<T: Transport, D> DecoratedSubscription<T, D> {
    /// The queue subscribed to.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The inner transport's subscription.
    pub fn inner(&self) -> &T::Subscription {
        &self.inner
    }
}

impl<T: Transport, D> fmt::Debug for DecoratedSubscription<T, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DecoratedSubscription")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl<T: Transport, D: Decorate<T>> Subscription for DecoratedSubscription<T, D> {
    type Tag = MarkedTag<T::Tag, D::Mark>;

    async fn recv(&self) -> Result<Option<Delivery<Self::Tag>>, TransportError> {
        let got = self.decorator.recv(&self.queue, &self.inner).await?;
        Ok(got.map(|d| marked(&*self.decorator, &self.queue, d)))
    }

    async fn cancel(&self) -> Result<(), TransportError> {
        self.decorator.cancel(&self.queue, &self.inner).await
    }

    async fn flush(&self) -> Result<(), TransportError> {
        self.decorator.flush(&self.queue, &self.inner).await
    }
}

/// A walk of a [`Decorated`] transport: the inner transport's, its calls going through the
/// decorator's `walk_*` hooks, and each delivery through [`delivered`](Decorate::delivered).
struct DecoratedWalk<'a, T: Transport, D> {
    inner: Box<dyn QueueWalk<T::Tag> + 'a>,
    decorator: &'a D,
    queue: String,
}

#[async_trait]
impl<T: Transport, D: Decorate<T>> QueueWalk<MarkedTag<T::Tag, D::Mark>>
    for DecoratedWalk<'_, T, D>
{
    async fn next(
        &mut self,
    ) -> Result<Option<Delivery<MarkedTag<T::Tag, D::Mark>>>, TransportError> {
        let got = self
            .decorator
            .walk_next(&self.queue, &mut *self.inner)
            .await?;
        Ok(got.map(|d| marked(self.decorator, &self.queue, d)))
    }

    fn leave(&mut self, tag: MarkedTag<T::Tag, D::Mark>) {
        self.decorator
            .walk_leave(&self.queue, &mut *self.inner, tag.tag, tag.mark);
    }

    async fn ack(&mut self, tag: MarkedTag<T::Tag, D::Mark>) -> Result<(), TransportError> {
        self.decorator
            .walk_ack(&self.queue, &mut *self.inner, tag.tag, tag.mark)
            .await
    }

    async fn end(&mut self) -> Result<(), TransportError> {
        self.decorator.walk_end(&self.queue, &mut *self.inner).await
    }
}
