//! The consumer driver against mockall mocks of `Transport`, on tokio's paused clock: the
//! mock's `now` and `sleep` read and wait on tokio's virtual time, so handler timeouts,
//! in-process waits and the shutdown grace run in no real time and never flake.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use mockall::predicate::{always, eq};
use mockall::{Sequence, mock};
use retry_core::headers;
use retry_core::{
    BrokerSignals, Capabilities, Confirm, Consumer, ConsumerConfigError, ConsumerError,
    DeadLetterReason, Delivery, DeliveryFacts, HandlerError, HeaderValue, Headers, Message,
    MessageParts, Publish, PublishResult, RetryPolicy, RunReport, Settlement, SoloGate,
    StormControl, Subscription, Terminal, Timestamp, TopologyPlan, Transport, TransportError,
    message_identity,
};

mock! {
    pub Sub {}

    #[async_trait]
    impl Subscription for Sub {
        type Tag = u64;
        async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError>;
        async fn cancel(&self) -> Result<(), TransportError>;
        async fn flush(&self) -> Result<(), TransportError>;
    }
}

mock! {
    pub Broker {}

    #[async_trait]
    impl Transport for Broker {
        type Tag = u64;
        type Subscription = MockSub;
        fn capabilities(&self) -> Capabilities;
        async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError>;
        async fn consume(&self, queue: &str, prefetch: u16) -> Result<MockSub, TransportError>;
        async fn fetch(&self, queue: &str) -> Result<Option<Delivery<u64>>, TransportError>;
        async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError>;
        async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult;
        async fn settle(&self, tag: &u64, settlement: Settlement) -> Result<(), TransportError>;
        fn now(&self) -> Timestamp;
        fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
    }
}

const QUEUE: &str = "comments";
const ISOLATION: &str = "comments.suspect";
const EPOCH_MS: u64 = 1_700_000_000_000;

fn message(body: &str, headers: Headers) -> Message {
    message_in(QUEUE, body, headers)
}

fn message_in(queue: &str, body: &str, headers: Headers) -> Message {
    Message::new(MessageParts {
        queue: queue.into(),
        routing_key: queue.into(),
        body: body.as_bytes().to_vec(),
        headers,
        ..MessageParts::default()
    })
}

fn delivery_of(tag: u64, message: Message, signals: BrokerSignals) -> Delivery<u64> {
    let identity = message_identity(None, message.body());
    let facts = DeliveryFacts::decode(message.headers(), signals, identity);
    Delivery {
        tag,
        message,
        facts,
    }
}

fn delivery_with(tag: u64, body: &str, headers: Headers, signals: BrokerSignals) -> Delivery<u64> {
    delivery_of(tag, message(body, headers), signals)
}

fn delivery(tag: u64, body: &str) -> Delivery<u64> {
    delivery_with(tag, body, Headers::new(), BrokerSignals::default())
}

const REDELIVERED: BrokerSignals = BrokerSignals {
    redelivered: true,
    delivery_count: None,
};

/// A suspect waiting in the isolation queue.
fn suspect(tag: u64, body: &str, signals: BrokerSignals) -> Delivery<u64> {
    delivery_of(tag, message_in(ISOLATION, body, Headers::new()), signals)
}

fn body(msg: &Message) -> String {
    String::from_utf8_lossy(msg.body()).into_owned()
}

/// One delayed retry through a 30 s queue, then the parking queue.
fn policy() -> RetryPolicy {
    RetryPolicy::delays([Duration::from_secs(30)])
        .build()
        .unwrap()
}

/// `now` and `sleep` on tokio's clock, which the tests pause.
fn virtual_clock(mock: &mut MockBroker) {
    let start = tokio::time::Instant::now();
    mock.expect_now()
        .returning(move || Timestamp::from_millis(EPOCH_MS + start.elapsed().as_millis() as u64));
    mock.expect_sleep()
        .returning(|d| Box::pin(tokio::time::sleep(d)));
}

/// A subscription that serves `deliveries`, then reports the end of the stream; cancelling
/// and flushing succeed.
fn subscription(deliveries: impl IntoIterator<Item = Delivery<u64>>) -> MockSub {
    let mut sub = MockSub::new();
    let inbox = Mutex::new(deliveries.into_iter().collect::<VecDeque<_>>());
    sub.expect_recv()
        .returning(move || Ok(inbox.lock().unwrap().pop_front()));
    sub.expect_cancel().returning(|| Ok(()));
    sub.expect_flush().returning(|| Ok(()));
    sub
}

/// A mock broker that provisions, and whose one subscription serves `deliveries`.
/// Publishes and settlements are left to each test.
fn mock_with(sub: MockSub) -> MockBroker {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_capabilities().return_const(Capabilities {
        publisher_confirms: true,
        dead_letter_exchange: true,
        declares_topology: true,
        ..Capabilities::default()
    });
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume()
        .with(eq(QUEUE), always())
        .times(1)
        .return_once(move |_, _| Ok(sub));
    mock
}

fn broker(deliveries: impl IntoIterator<Item = Delivery<u64>>) -> Broker {
    Broker::new(mock_with(subscription(deliveries)))
}

/// The mock, with the isolation queue modelled beside it: mockall answers every call at
/// once, but a watch on the isolation queue has to wait for a suspect to arrive.
struct Broker {
    mock: MockBroker,
    suspects: Arc<Mutex<VecDeque<Delivery<u64>>>>,
    /// How long each publish waits for its confirm.
    confirm_after: Duration,
    /// How long each fetch takes to answer.
    fetch_after: Duration,
    /// When set, a watch of the isolation queue fails with a lost connection after this
    /// long, whatever the queue holds.
    watch_fails_after: Option<Duration>,
    log: Log,
}

impl Broker {
    fn new(mock: MockBroker) -> Self {
        Broker {
            mock,
            suspects: Arc::default(),
            confirm_after: Duration::ZERO,
            fetch_after: Duration::ZERO,
            watch_fails_after: None,
            log: Log::default(),
        }
    }

    fn with_suspects(self, suspects: impl IntoIterator<Item = Delivery<u64>>) -> Self {
        self.suspects.lock().unwrap().extend(suspects);
        self
    }
}

#[async_trait]
impl Transport for Broker {
    type Tag = u64;
    type Subscription = MockSub;
    fn capabilities(&self) -> Capabilities {
        self.mock.capabilities()
    }
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.mock.provision(plan).await
    }
    async fn consume(&self, queue: &str, prefetch: u16) -> Result<MockSub, TransportError> {
        self.log.push("consume");
        self.mock.consume(queue, prefetch).await
    }
    async fn fetch(&self, queue: &str) -> Result<Option<Delivery<u64>>, TransportError> {
        assert_eq!(queue, ISOLATION, "only the isolation queue is fetched from");
        tokio::time::sleep(self.fetch_after).await;
        let next = self.suspects.lock().unwrap().pop_front();
        match &next {
            Some(d) => self.log.push(format!("fetch {}", body(&d.message))),
            None => self.log.push("fetch: empty"),
        }
        Ok(next)
    }
    async fn ready(&self, queue: &str, poll: Duration) -> Result<(), TransportError> {
        assert_eq!(queue, ISOLATION);
        if let Some(after) = self.watch_fails_after {
            tokio::time::sleep(after).await;
            self.log.push("watch failed");
            return Err(TransportError::connection_lost(
                "watching the isolation queue",
            ));
        }
        while self.suspects.lock().unwrap().is_empty() {
            tokio::time::sleep(poll).await;
        }
        Ok(())
    }
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let answer = self.mock.publish(original, publish).await;
        tokio::time::sleep(self.confirm_after).await;
        answer
    }
    async fn settle(&self, tag: &u64, settlement: Settlement) -> Result<(), TransportError> {
        self.mock.settle(tag, settlement).await
    }
    fn now(&self) -> Timestamp {
        self.mock.now()
    }
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.mock.sleep(duration)
    }
}

async fn failing(_msg: Message) -> Result<(), HandlerError> {
    Err(HandlerError::transient("downstream unavailable"))
}

async fn succeeding(_msg: Message) -> Result<(), HandlerError> {
    Ok(())
}

/// Runs a consumer of `QUEUE` with the default settings until the transport's stream ends.
async fn run_to_end<T: Transport, H: retry_core::Handler>(
    transport: T,
    policy: RetryPolicy,
    handler: H,
) -> RunReport {
    Consumer::builder(transport, QUEUE, policy, handler)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap()
}

/// Records the calls a test wants to see in order.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, entry: impl Into<String>) {
        self.0.lock().unwrap().push(entry.into());
    }

    fn entries(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

#[tokio::test(start_paused = true)]
async fn the_original_is_acked_only_after_the_clones_confirm() {
    let log = Log::default();
    let mut b = broker([delivery(1, "a")]);
    let mut seq = Sequence::new();
    let l = log.clone();
    b.mock
        .expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s" && p.headers.attempts == 1)
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_, _| {
            l.push("publish confirmed");
            PublishResult::Confirmed
        });
    let l = log.clone();
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_, _| {
            l.push("ack");
            Ok(())
        });

    let report = run_to_end(b, policy(), failing).await;

    assert_eq!(log.entries(), ["publish confirmed", "ack"]);
    assert_eq!((report.received, report.retried), (1, 1));
    assert_eq!(report.accounted(), report.received);
}

#[tokio::test(start_paused = true)]
async fn slow_confirms_hold_the_ack_back_and_run_concurrently() {
    let start = tokio::time::Instant::now();
    let confirm_after = Duration::from_secs(5);
    let mut b = broker([delivery(1, "a"), delivery(2, "b")]);
    b.confirm_after = confirm_after;
    b.mock
        .expect_publish()
        .times(2)
        .returning(|_, _| PublishResult::Confirmed);
    let acked_at = Arc::new(Mutex::new(Vec::new()));
    let at = acked_at.clone();
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(2)
        .returning(move |tag, _| {
            at.lock().unwrap().push((*tag, start.elapsed()));
            Ok(())
        });

    let report = run_to_end(b, policy(), failing).await;

    assert_eq!(report.retried, 2);
    let mut acked_at = acked_at.lock().unwrap().clone();
    acked_at.sort();
    // Neither ack comes before its confirm, and the second publish did not wait for the
    // first one's confirm (that would put its ack at 10 s).
    assert_eq!(acked_at, [(1, confirm_after), (2, confirm_after)]);
}

/// The policy of these tests with publish retries as given.
fn retrying_publishes(retries: u32) -> RetryPolicy {
    RetryPolicy::delays([Duration::from_secs(30)])
        .with_publish_retries(retries, Duration::from_millis(100))
        .build()
        .unwrap()
}

async fn requeued_when_the_publish_answers(answer: fn() -> PublishResult, cause: Confirm) {
    let start = tokio::time::Instant::now();
    let mut b = broker([delivery(7, "a")]);
    let published_at = Arc::new(Mutex::new(Vec::new()));
    let at = published_at.clone();
    b.mock.expect_publish().times(3).returning(move |_, _| {
        at.lock().unwrap().push(start.elapsed());
        answer()
    });
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Ack))
        .never();
    b.mock
        .expect_settle()
        .with(eq(7), eq(Settlement::Requeue))
        .times(1)
        .returning(|_, _| Ok(()));
    let terminals = Arc::new(Mutex::new(Vec::new()));
    let seen = terminals.clone();

    let report = Consumer::builder(b, QUEUE, retrying_publishes(2), failing)
        .with_solo_gate(SoloGate::new())
        .with_on_terminal(move |_, t| seen.lock().unwrap().push(*t))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!((report.requeued, report.retried), (1, 0));
    assert_eq!(*terminals.lock().unwrap(), [Terminal::Requeued { cause }]);
    // Published again after 100 ms, then after 200 ms more: never in a hot loop.
    let ms = |n| Duration::from_millis(n);
    assert_eq!(*published_at.lock().unwrap(), [ms(0), ms(100), ms(300)]);
}

#[tokio::test(start_paused = true)]
async fn a_refused_publish_is_retried_then_requeues_and_never_acks() {
    requeued_when_the_publish_answers(|| PublishResult::Refused, Confirm::Nack).await;
}

#[tokio::test(start_paused = true)]
async fn a_returned_publish_is_retried_then_requeues_and_never_acks() {
    requeued_when_the_publish_answers(|| PublishResult::Returned, Confirm::Returned).await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_publish_is_retried_then_requeues_and_never_acks() {
    requeued_when_the_publish_answers(
        || PublishResult::Failed(TransportError::connection_lost("channel closed")),
        Confirm::Failed,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_refused_publish_followed_by_a_confirmed_retry_never_requeues() {
    let mut b = broker([delivery(7, "a")]);
    let mut seq = Sequence::new();
    b.mock
        .expect_publish()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| PublishResult::Refused);
    b.mock
        .expect_publish()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| PublishResult::Confirmed);
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Requeue))
        .never();
    b.mock
        .expect_settle()
        .with(eq(7), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(b, retrying_publishes(3), failing).await;
    assert_eq!((report.retried, report.requeued), (1, 0));
}

async fn panics(msg: Message) -> Result<(), HandlerError> {
    match msg.body() {
        b"str" => panic!("payload is not JSON"),
        b"string" => panic!("field {} is missing", "author"),
        _ => std::panic::panic_any(42u8),
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_handler_is_a_transient_failure_with_the_panic_message() {
    let mut b = broker([
        delivery(1, "str"),
        delivery(2, "string"),
        delivery(3, "other"),
    ]);
    let causes = Arc::new(Mutex::new(Vec::new()));
    let c = causes.clone();
    b.mock
        .expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s")
        .times(3)
        .returning(move |original, p| {
            c.lock()
                .unwrap()
                .push((body(original), p.headers.last_error.clone()));
            PublishResult::Confirmed
        });
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(3)
        .returning(|_, _| Ok(()));

    let report = run_to_end(b, policy(), panics).await;

    assert_eq!((report.handler_panics, report.retried), (3, 3));
    let mut causes = causes.lock().unwrap().clone();
    causes.sort();
    assert_eq!(
        causes,
        [
            ("other".to_owned(), Some("handler panicked".to_owned())),
            ("str".to_owned(), Some("payload is not JSON".to_owned())),
            (
                "string".to_owned(),
                Some("field author is missing".to_owned())
            ),
        ]
    );
}

/// Sets its flag when dropped: tells whether a handler's future was cancelled.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(start_paused = true)]
async fn a_handler_past_its_timeout_is_cancelled_and_counts_as_transient() {
    let mut b = broker([delivery(1, "slow")]);
    let last_error = Arc::new(Mutex::new(None));
    let e = last_error.clone();
    b.mock
        .expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s")
        .times(1)
        .returning(move |_, p| {
            *e.lock().unwrap() = p.headers.last_error.clone();
            PublishResult::Confirmed
        });
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    let dropped = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicBool::new(false));
    let (d, f) = (dropped.clone(), finished.clone());
    let handler = move |_msg: Message| {
        let guard = DropFlag(d.clone());
        let finished = f.clone();
        async move {
            let _guard = guard;
            tokio::time::sleep(Duration::from_secs(3600)).await;
            finished.store(true, Ordering::SeqCst);
            Ok::<(), HandlerError>(())
        }
    };

    let report = Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!((report.handler_timeouts, report.retried), (1, 1));
    assert_eq!(
        last_error.lock().unwrap().as_deref(),
        Some("handler timed out after 10s")
    );
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler was not cancelled"
    );
    assert!(!finished.load(Ordering::SeqCst));
}

#[tokio::test(start_paused = true)]
async fn shutdown_finishes_work_within_the_grace_flushes_its_acks_and_leaves_the_rest_unsettled() {
    let log = Log::default();
    // Three deliveries fill the prefetch; after the shutdown, one more receive finds the
    // cancelled subscription ended.
    let mut sub = MockSub::new();
    let inbox = Mutex::new(VecDeque::from([
        delivery(1, "ok after 5s"),
        delivery(2, "fails after 3s"),
        delivery(3, "ok after 25m"),
    ]));
    sub.expect_recv()
        .times(4)
        .returning(move || Ok(inbox.lock().unwrap().pop_front()));
    let l = log.clone();
    sub.expect_cancel().times(1).returning(move || {
        l.push("cancel");
        Ok(())
    });
    let l = log.clone();
    sub.expect_flush().times(1).returning(move || {
        l.push("flush");
        Ok(())
    });
    let mut mock = mock_with(sub);
    mock.expect_publish()
        .withf(|original, _| original.body() == b"fails after 3s")
        .times(1)
        .returning(|_, _| PublishResult::Confirmed);
    for tag in [1, 2] {
        let l = log.clone();
        mock.expect_settle()
            .with(eq(tag), eq(Settlement::Ack))
            .times(1)
            .returning(move |tag, _| {
                l.push(format!("ack {tag}"));
                Ok(())
            });
    }
    // The slow one is never settled: no expectation matches tag 3.
    let slow_cancelled = Arc::new(AtomicBool::new(false));
    let flag = slow_cancelled.clone();
    let handler = move |msg: Message| {
        let guard = DropFlag(flag.clone());
        async move {
            match msg.body() {
                b"ok after 5s" => tokio::time::sleep(Duration::from_secs(5)).await,
                b"fails after 3s" => {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    return Err(HandlerError::transient("downstream unavailable"));
                }
                _ => {
                    let _guard = guard;
                    tokio::time::sleep(Duration::from_secs(25 * 60)).await;
                }
            }
            Ok(())
        }
    };

    let report = Consumer::builder(Broker::new(mock), QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_prefetch(3)
        .with_handler_timeout(Duration::from_secs(9 * 60))
        .with_shutdown_grace(Duration::from_secs(30))
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(1)))
        .await
        .unwrap();

    assert_eq!(
        (
            report.received,
            report.handled,
            report.retried,
            report.left_unsettled
        ),
        (3, 1, 1, 1)
    );
    assert_eq!(report.accounted(), report.received);
    assert!(slow_cancelled.load(Ordering::SeqCst));
    // The acks decided during the grace are sent before `run` returns.
    assert_eq!(log.entries(), ["cancel", "ack 2", "ack 1", "flush"]);
}

#[tokio::test(start_paused = true)]
async fn shutdown_with_nothing_held_stops_at_once() {
    // An idle queue whose receives time out.
    let mut sub = MockSub::new();
    sub.expect_recv().returning(|| {
        Err(TransportError::Timeout {
            operation: "recv",
            after: Duration::from_secs(60),
        })
    });
    sub.expect_cancel().times(1).returning(|| Ok(()));
    sub.expect_flush().times(1).returning(|| Ok(()));
    let mut mock = mock_with(sub);
    mock.expect_settle().never();

    let report = Consumer::builder(Broker::new(mock), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(2)))
        .await
        .unwrap();

    assert_eq!(report.received, 0);
    assert!(report.receive_errors > 0);
}

#[tokio::test(start_paused = true)]
async fn concurrent_handlers_never_exceed_the_prefetch() {
    const PREFETCH: u16 = 4;
    let mut b = broker((1..=20).map(|tag| delivery(tag, &format!("m{tag}"))));
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(20)
        .returning(|_, _| Ok(()));
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (r, p) = (running.clone(), peak.clone());
    let handler = move |msg: Message| {
        let (running, peak) = (r.clone(), p.clone());
        async move {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            peak.fetch_max(now, Ordering::SeqCst);
            let secs = 1 + msg.body().len() as u64 % 3;
            tokio::time::sleep(Duration::from_secs(secs)).await;
            running.fetch_sub(1, Ordering::SeqCst);
            Ok::<(), HandlerError>(())
        }
    };

    let report = Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_prefetch(PREFETCH)
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!(report.handled, 20);
    // Reaching the prefetch shows the handlers do run concurrently.
    assert_eq!(peak.load(Ordering::SeqCst), usize::from(PREFETCH));
}

#[test]
fn a_configuration_that_can_hold_a_delivery_past_the_consumer_timeout_is_refused() {
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .with_immediate_retries(2, Duration::from_secs(5))
        .with_publish_retries(1, Duration::from_secs(1))
        .build()
        .unwrap();
    // 3 × (3 × 3m20s + 2 × 5s + 1s) + 5s = 30m38s.
    let err = Consumer::builder(MockBroker::new(), QUEUE, policy.clone(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(200))
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConsumerConfigError::ExceedsConsumerTimeout {
                runs: 3,
                immediate_retries: 2,
                in_process,
                worst_case,
                consumer_timeout,
                ..
            } if in_process == Duration::from_secs(611)
                && worst_case == Duration::from_secs(30 * 60 + 38)
                && consumer_timeout == Duration::from_secs(30 * 60)
        ),
        "{err:?}"
    );
    let text = err.to_string();
    for number in [
        "consumer_timeout (30m)",
        "handler_timeout 3m 20s",
        "3 runs",
        "immediate_retries 2",
        "immediate_wait 5s",
        "publish retry waits 1s",
        "solo_time 5s",
        "= 30m 38s",
    ] {
        assert!(text.contains(number), "{number:?} missing from: {text}");
    }

    // Reaching the timeout exactly is refused too.
    let err = Consumer::builder(MockBroker::new(), QUEUE, self::policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(20))
        .with_consumer_timeout(Duration::from_millis(3 * 20_700 + 5_000))
        .build()
        .unwrap_err();
    assert!(matches!(
        err,
        ConsumerConfigError::ExceedsConsumerTimeout { .. }
    ));

    // A shorter handler timeout, a shorter solo phase, or a longer broker timeout, fits.
    let consumer = Consumer::builder(MockBroker::new(), QUEUE, policy.clone(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(190))
        .build()
        .unwrap();
    assert_eq!(consumer.consumer_timeout(), Duration::from_secs(30 * 60));
    Consumer::builder(MockBroker::new(), QUEUE, policy.clone(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(200))
        .with_solo_limit(10, Duration::ZERO)
        .with_consumer_timeout(Duration::from_secs(30 * 60 + 34))
        .build()
        .unwrap();
    Consumer::builder(MockBroker::new(), QUEUE, policy, succeeding)
        .with_solo_gate(SoloGate::new())
        .with_handler_timeout(Duration::from_secs(200))
        .with_consumer_timeout(Duration::from_secs(60 * 60))
        .build()
        .unwrap();
}

type Builder = retry_core::ConsumerBuilder<
    MockBroker,
    fn(Message) -> BoxFuture<'static, Result<(), HandlerError>>,
>;

/// The error `configure` makes building a consumer of `QUEUE` fail with.
fn refused(configure: impl FnOnce(Builder) -> Builder) -> ConsumerConfigError {
    let handler: fn(Message) -> BoxFuture<'static, Result<(), HandlerError>> =
        |_| Box::pin(async { Ok(()) });
    configure(Consumer::builder(
        MockBroker::new(),
        QUEUE,
        policy(),
        handler,
    ))
    .build()
    .unwrap_err()
}

#[test]
fn other_invalid_settings_are_refused_by_name() {
    let err = refused(|b| b.with_prefetch(0));
    assert!(matches!(err, ConsumerConfigError::ZeroPrefetch));
    assert!(err.to_string().contains("prefetch"));

    let err = refused(|b| b.with_handler_timeout(Duration::ZERO));
    assert!(matches!(err, ConsumerConfigError::ZeroHandlerTimeout));
    assert!(err.to_string().contains("handler_timeout"));

    let err = refused(|b| b.with_solo_limit(0, Duration::from_secs(5)));
    assert!(matches!(err, ConsumerConfigError::ZeroSoloRuns));
    assert!(err.to_string().contains("solo_limit"));

    let err = refused(|b| b.with_suspect_poll(Duration::ZERO));
    assert!(matches!(err, ConsumerConfigError::ZeroSuspectPoll));
    assert!(err.to_string().contains("suspect_poll"));

    let handler = |_: Message| async { Ok::<(), HandlerError>(()) };
    let err = Consumer::builder(MockBroker::new(), "amq.reserved", policy(), handler)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::Topology(_)));
    assert!(err.to_string().contains("amq.reserved"), "{err}");
}

#[test]
fn storm_control_settings_are_refused_by_name() {
    let err = refused(|b| b.with_storm_control(StormControl::consecutive_failures(0)));
    assert!(matches!(
        err,
        ConsumerConfigError::InvalidStormControl {
            setting: "consecutive_failures",
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "storm_control: consecutive_failures must be at least 1, got 0"
    );
    let err = refused(|b| b.with_storm_control(StormControl::failure_ratio(0.0, 10)));
    assert!(err.to_string().contains("failure_ratio"), "{err}");
}

#[test]
fn storm_control_that_could_hold_a_prefetched_delivery_past_the_consumer_timeout_is_refused() {
    // In-process time 30.7 s (30 s handler timeout, 0.7 s of publish-retry waits): with
    // prefetch 20 and a 60 s cool-down, (60 s + 30.7 s) × 20 + 30.7 s = 30m 44.7s.
    let storm = StormControl::consecutive_failures(10);
    let err = refused(|b| b.with_prefetch(20).with_storm_control(storm.clone()));
    assert!(
        matches!(
            err,
            ConsumerConfigError::StormExceedsConsumerTimeout {
                prefetch: 20,
                worst_case,
                ..
            } if worst_case == Duration::from_millis(30 * 60_000 + 44_700)
        ),
        "{err:?}"
    );
    let text = err.to_string();
    for part in ["max_cool_down 1m", "prefetch 20", "= 30m 44s 700ms"] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    // A shorter longest cool-down fits.
    let handler = |_: Message| async { Ok::<(), HandlerError>(()) };
    let consumer = Consumer::builder(MockBroker::new(), QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_prefetch(20)
        .with_storm_control(storm.with_cool_down(Duration::from_secs(5), Duration::from_secs(50)))
        .build()
        .unwrap();
    assert_eq!(
        consumer.storm_control().map(StormControl::max_cool_down),
        Some(Duration::from_secs(50))
    );
}

#[test]
fn a_plan_without_the_policys_crash_delay_queue_is_refused_by_name() {
    // The plan is made for run-handler (no crash-delay queue), the policy diverts.
    let run_handler = RetryPolicy::delays([Duration::from_secs(30)])
        .with_on_crash(retry_core::CrashAction::RunHandler)
        .build()
        .unwrap();
    let plan = TopologyPlan::new(QUEUE, &run_handler).unwrap();
    let err = retry_core::Engine::<()>::new(policy(), &plan).unwrap_err();
    assert!(err.to_string().contains("comments.crash.30s"), "{err}");
    // Run-handler needs no broker delivery count any more: crashes are counted on the
    // message, by clones into the isolation queue.
    let mut blind = MockBroker::new();
    blind
        .expect_capabilities()
        .return_const(Capabilities::default());
    let consumer = Consumer::builder(blind, QUEUE, run_handler, succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap();
    assert_eq!(consumer.plan().crash_route(), None);
}

#[test]
fn the_plan_is_available_after_build_and_can_be_customised() {
    let consumer = Consumer::builder(MockBroker::new(), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_topology(|b| b.with_queue_type(retry_core::QueueType::Quorum))
        .build()
        .unwrap();
    assert_eq!(consumer.plan().work_queue(), QUEUE);
    assert_eq!(consumer.plan().isolation_queue(), ISOLATION);
    assert!(
        consumer
            .plan()
            .queues()
            .iter()
            .all(|q| q.arguments.queue_type == retry_core::QueueType::Quorum)
    );
    assert_eq!(consumer.prefetch(), 10);
    assert_eq!(consumer.handler_timeout(), Duration::from_secs(30));
    assert_eq!(consumer.shutdown_grace(), Duration::from_secs(30));
    assert_eq!(consumer.solo_limit(), (32, Duration::from_secs(5)));
    assert_eq!(consumer.suspect_poll(), Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn the_topology_is_provisioned_then_waiting_suspects_run_before_any_work() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    let mut seq = Sequence::new();
    mock.expect_provision()
        .withf(|plan| plan.work_queue() == QUEUE && plan.parking_queue() == "comments.parking")
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    mock.expect_consume()
        .with(eq(QUEUE), eq(10))
        .times(1)
        .in_sequence(&mut seq)
        .return_once(|_, _| Ok(subscription([delivery(2, "work")])));
    mock.expect_settle().times(2).returning(|_, _| Ok(()));
    let b = Broker::new(mock).with_suspects([suspect(
        1,
        "left by the last consumer",
        BrokerSignals::default(),
    )]);
    let log = b.log.clone();

    let report = run_to_end(b, policy(), succeeding).await;

    assert_eq!(
        log.entries(),
        ["fetch left by the last consumer", "fetch: empty", "consume"]
    );
    assert_eq!((report.suspects, report.handled), (1, 2));
}

#[tokio::test(start_paused = true)]
async fn provisioning_can_be_turned_off_and_its_failure_stops_the_run() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().never();
    mock.expect_consume()
        .times(1)
        .return_once(|_, _| Ok(subscription([])));
    Consumer::builder(Broker::new(mock), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .with_provision(false)
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| {
        Err(TransportError::MissingAddress {
            address: "comments.retry".into(),
            hint: "declare it".into(),
        })
    });
    mock.expect_consume().never();
    let err = Consumer::builder(Broker::new(mock), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, ConsumerError::Provision { .. }), "{err:?}");
    // The chain names each cause once: printed by the error that has it, or returned as
    // its source, never both.
    let chain = error_chain(&err);
    assert_eq!(chain.matches("comments.retry").count(), 1, "{chain}");
    assert!(
        chain.starts_with("provisioning the topology of queue"),
        "{chain}"
    );
}

/// An error and its sources, joined as `{:#}` in anyhow prints them.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut next = err.source();
    while let Some(cause) = next {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        next = cause.source();
    }
    text
}

#[test]
fn a_handler_error_is_transparent_over_its_cause() {
    #[derive(Debug, thiserror::Error)]
    #[error("timed out calling the search index")]
    struct Upstream(#[source] std::io::Error);

    let cause = Upstream(std::io::Error::other("connection refused"));
    let err = HandlerError::transient(cause);
    assert_eq!(
        error_chain(&err),
        "timed out calling the search index: connection refused"
    );
}

#[tokio::test(start_paused = true)]
async fn an_immediate_retry_runs_in_process_after_its_wait() {
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .with_immediate_retries(1, Duration::from_secs(2))
        .build()
        .unwrap();
    let mut b = broker([delivery(1, "flaky")]);
    b.mock.expect_publish().never();
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = attempts.clone();
    let handler = move |msg: Message| {
        let seen = seen.clone();
        async move {
            seen.lock()
                .unwrap()
                .push((msg.attempt(), tokio::time::Instant::now()));
            if msg.attempt() == 1 {
                return Err(HandlerError::transient("blip"));
            }
            Ok(())
        }
    };

    let report = run_to_end(b, policy, handler).await;

    assert_eq!(report.handled, 1);
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 2);
    assert_eq!((attempts[0].0, attempts[1].0), (1, 2));
    assert_eq!(attempts[1].1 - attempts[0].1, Duration::from_secs(2));
}

/// Publishes into the isolation queue land in `b`'s model of it, as new deliveries.
fn isolation_lands_in_the_model(b: &mut Broker, log: &Log) {
    let (suspects, log) = (b.suspects.clone(), log.clone());
    let next_tag = AtomicU64::new(100);
    b.mock
        .expect_publish()
        .withf(|_, p| &*p.route.routing_key == ISOLATION)
        .returning(move |original, p| {
            log.push(format!("isolate {}", body(original)));
            let origin = headers::Origin {
                queue: QUEUE,
                exchange: "",
                routing_key: QUEUE,
            };
            let headers = headers::clone_headers(original.headers(), origin, &p.headers);
            let tag = next_tag.fetch_add(1, Ordering::SeqCst);
            let copy = message_in(ISOLATION, &body(original), headers);
            suspects
                .lock()
                .unwrap()
                .push_back(delivery_of(tag, copy, BrokerSignals::default()));
            PublishResult::Confirmed
        });
}

/// A handler that logs when each run starts and ends, taking as many seconds as its body
/// says after a `:` (`slow:5`), or no time.
fn timed_handler(
    log: &Log,
) -> impl Fn(Message) -> BoxFuture<'static, Result<(), HandlerError>> + Send + Sync + 'static {
    let log = log.clone();
    move |msg: Message| {
        let log = log.clone();
        Box::pin(async move {
            let name = body(&msg);
            let secs = name
                .split_once(':')
                .and_then(|(_, s)| s.parse().ok())
                .unwrap_or(0);
            log.push(format!("start {name}"));
            tokio::time::sleep(Duration::from_secs(secs)).await;
            log.push(format!("end {name}"));
            Ok(())
        })
    }
}

#[tokio::test(start_paused = true)]
async fn a_redelivered_message_is_isolated_and_runs_alone_once_the_work_lane_is_drained() {
    let log = Log::default();
    let mut sub = subscription([
        delivery(1, "slow:5"),
        delivery_with(2, "redelivered", Headers::new(), REDELIVERED),
        delivery(3, "fresh"),
    ]);
    sub.checkpoint();
    let inbox = Mutex::new(VecDeque::from([
        delivery(1, "slow:5"),
        delivery_with(2, "redelivered", Headers::new(), REDELIVERED),
        delivery(3, "fresh"),
        delivery(4, "later"),
    ]));
    sub.expect_recv()
        .returning(move || Ok(inbox.lock().unwrap().pop_front()));
    sub.expect_cancel().returning(|| Ok(()));
    let l = log.clone();
    sub.expect_flush().returning(move || {
        l.push("flush");
        Ok(())
    });
    let mut b = Broker::new(mock_with(sub));
    b.log = log.clone();
    isolation_lands_in_the_model(&mut b, &log);
    let l = log.clone();
    b.mock.expect_settle().returning(move |tag, s| {
        l.push(format!("{s:?} {tag}"));
        Ok(())
    });
    let ended = Arc::new(Mutex::new(Vec::new()));
    let e = ended.clone();

    let report = Consumer::builder(b, QUEUE, policy(), timed_handler(&log))
        .with_solo_gate(SoloGate::new())
        .with_prefetch(3)
        .with_on_terminal(move |msg, t| e.lock().unwrap().push((body(msg), *t)))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!(
        log.entries(),
        [
            "fetch: empty",
            "consume",
            "start slow:5",
            "isolate redelivered",
            "start fresh",
            "end fresh",
            "Ack 2",
            "Ack 3",
            // The isolated delivery's ack is sent at once.
            "flush",
            // A suspect waits: "later" is not started, and the slow run is waited for and
            // its ack sent.
            "end slow:5",
            "Ack 1",
            "flush",
            "fetch redelivered",
            "start redelivered",
            "end redelivered",
            "Ack 100",
            "fetch: empty",
            "start later",
            "end later",
            "Ack 4",
            "flush",
        ]
    );
    assert_eq!(
        (
            report.received,
            report.suspects,
            report.isolated,
            report.handled
        ),
        (5, 1, 1, 4)
    );
    let ended = ended.lock().unwrap().clone();
    assert!(ended.contains(&("redelivered".to_owned(), Terminal::Isolated)));
    assert!(ended.contains(&("redelivered".to_owned(), Terminal::Handled { attempt: 1 })));
}

#[tokio::test(start_paused = true)]
async fn a_suspect_redelivered_from_the_isolation_queue_counts_a_crash_without_running() {
    let mut b = broker([]).with_suspects([suspect(1, "killer", REDELIVERED)]);
    b.mock
        .expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.crash.30s" && p.headers.crashes == 1)
        .times(1)
        .returning(|_, _| PublishResult::Confirmed);
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = move |_msg: Message| {
        r.fetch_add(1, Ordering::SeqCst);
        async { Ok::<(), HandlerError>(()) }
    };
    let ended = Arc::new(Mutex::new(Vec::new()));
    let e = ended.clone();

    let report = Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_on_terminal(move |msg, t| e.lock().unwrap().push((msg.attempt(), *t)))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!((report.suspects, report.diverted), (1, 1));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(
        *ended.lock().unwrap(),
        [(
            1,
            Terminal::Diverted {
                crashes: 1,
                delay: Duration::from_secs(30)
            }
        )]
    );
}

#[tokio::test(start_paused = true)]
async fn a_suspect_whose_connection_dropped_while_it_ran_is_not_blamed_when_it_returns() {
    let mut b = broker([]).with_suspects([suspect(1, "unlucky", BrokerSignals::default())]);
    let suspects = b.suspects.clone();
    let mut seq = Sequence::new();
    // The ack finds the connection gone: the broker puts the suspect back, redelivered.
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_, _| {
            suspects
                .lock()
                .unwrap()
                .push_back(suspect(2, "unlucky", REDELIVERED));
            Err(TransportError::connection_lost("connection reset"))
        });
    b.mock
        .expect_settle()
        .with(eq(2), eq(Settlement::Ack))
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Ok(()));
    b.mock.expect_publish().never();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let handler = move |_msg: Message| {
        r.fetch_add(1, Ordering::SeqCst);
        async { Ok::<(), HandlerError>(()) }
    };

    let report = run_to_end(b, policy(), handler).await;

    assert_eq!(runs.load(Ordering::SeqCst), 2, "run again, not diverted");
    assert_eq!(
        (
            report.suspects,
            report.settle_errors,
            report.handled,
            report.diverted
        ),
        (2, 1, 1, 0)
    );
}

#[tokio::test(start_paused = true)]
async fn a_solo_phase_stops_at_its_limit_and_the_work_lane_takes_a_turn() {
    let log = Log::default();
    // One work delivery, then a quiet queue.
    let mut sub = MockSub::new();
    let inbox = Mutex::new(VecDeque::from([delivery(10, "work:0")]));
    sub.expect_recv()
        .returning(move || match inbox.lock().unwrap().pop_front() {
            Some(d) => Ok(Some(d)),
            None => Err(TransportError::Timeout {
                operation: "recv",
                after: Duration::from_secs(1),
            }),
        });
    sub.expect_cancel().returning(|| Ok(()));
    sub.expect_flush().returning(|| Ok(()));
    let mut b = Broker::new(mock_with(sub))
        .with_suspects((1..=5).map(|n| suspect(n, &format!("s{n}:1"), BrokerSignals::default())));
    b.log = log.clone();
    b.mock.expect_settle().returning(|_, _| Ok(()));

    let report = Consumer::builder(b, QUEUE, policy(), timed_handler(&log))
        .with_solo_gate(SoloGate::new())
        .with_solo_limit(2, Duration::from_secs(60))
        .with_suspect_poll(Duration::from_secs(1))
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(60)))
        .await
        .unwrap();

    let fetches_and_work: Vec<_> = log
        .entries()
        .into_iter()
        .filter(|e| e.starts_with("fetch") || e.starts_with("start"))
        .collect();
    assert_eq!(
        fetches_and_work,
        [
            "fetch s1:1",
            "start s1:1",
            "fetch s2:1",
            "start s2:1",
            "start work:0",
            "fetch s3:1",
            "start s3:1",
            "fetch s4:1",
            "start s4:1",
            "fetch s5:1",
            "start s5:1",
            "fetch: empty",
        ]
    );
    assert_eq!((report.suspects, report.handled), (5, 6));
}

#[tokio::test(start_paused = true)]
async fn a_missing_isolation_queue_stops_the_consumer_naming_it() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().never();
    struct NoIsolation(MockBroker);
    #[async_trait]
    impl Transport for NoIsolation {
        type Tag = u64;
        type Subscription = MockSub;
        fn capabilities(&self) -> Capabilities {
            Capabilities::default()
        }
        async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
            self.0.provision(plan).await
        }
        async fn consume(&self, queue: &str, prefetch: u16) -> Result<MockSub, TransportError> {
            self.0.consume(queue, prefetch).await
        }
        async fn fetch(&self, queue: &str) -> Result<Option<Delivery<u64>>, TransportError> {
            Err(TransportError::MissingAddress {
                address: format!("queue {queue:?}"),
                hint: "provision the topology".into(),
            })
        }
        async fn ready(&self, _: &str, _: Duration) -> Result<(), TransportError> {
            std::future::pending().await
        }
        async fn publish(&self, _: &Message, _: &Publish) -> PublishResult {
            unreachable!("nothing is received")
        }
        async fn settle(&self, _: &u64, _: Settlement) -> Result<(), TransportError> {
            unreachable!("nothing is received")
        }
        fn now(&self) -> Timestamp {
            self.0.now()
        }
        fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
            self.0.sleep(duration)
        }
    }

    let err = Consumer::builder(NoIsolation(mock), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ConsumerError::Isolation { queue, .. } if queue == ISOLATION),
        "{err:?}"
    );
    assert!(err.to_string().contains(ISOLATION));
}

#[tokio::test(start_paused = true)]
async fn exhausted_and_permanent_failures_are_parked_and_observed() {
    // Attempt 2 of 2 (one earlier failure in the headers), and a permanent failure.
    let headers: Headers = [(headers::ATTEMPTS, 1i64)].into_iter().collect();
    let mut b = broker([
        delivery_with(1, "again", headers, BrokerSignals::default()),
        delivery(2, "poison"),
    ]);
    b.mock
        .expect_publish()
        .withf(|_, p| {
            &*p.route.routing_key == QUEUE && p.route.exchange.as_ref() == "comments.dead-letter"
        })
        .times(2)
        .returning(|_, _| PublishResult::Confirmed);
    b.mock
        .expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(2)
        .returning(|_, _| Ok(()));
    let ended = Arc::new(Mutex::new(Vec::new()));
    let e = ended.clone();
    let handler = |msg: Message| async move {
        match msg.body() {
            b"poison" => Err(HandlerError::permanent("schema mismatch")),
            _ => Err(HandlerError::transient("still down")),
        }
    };

    let report = Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_on_terminal(move |msg, t| e.lock().unwrap().push((body(msg), msg.attempt(), *t)))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!(report.dead_lettered, 2);
    let mut ended = ended.lock().unwrap().clone();
    ended.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        ended,
        [
            (
                "again".to_owned(),
                2,
                Terminal::DeadLettered {
                    reason: DeadLetterReason::AttemptsExhausted
                }
            ),
            (
                "poison".to_owned(),
                1,
                Terminal::DeadLettered {
                    reason: DeadLetterReason::Permanent
                }
            ),
        ]
    );
}

fn scripted_subscription(answers: Vec<Result<Option<Delivery<u64>>, TransportError>>) -> MockSub {
    let mut sub = MockSub::new();
    let mut seq = Sequence::new();
    for answer in answers {
        sub.expect_recv()
            .times(1)
            .in_sequence(&mut seq)
            .return_once(move || answer);
    }
    sub.expect_cancel().returning(|| Ok(()));
    sub.expect_flush().returning(|| Ok(()));
    sub
}

#[tokio::test(start_paused = true)]
async fn a_lost_connection_while_receiving_is_retried() {
    let lost = || Err(TransportError::connection_lost("connection reset"));
    let sub = scripted_subscription(vec![lost(), lost(), Ok(Some(delivery(1, "a"))), Ok(None)]);
    let mut b = Broker::new(mock_with(sub));
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(b, policy(), succeeding).await;

    assert_eq!((report.receive_errors, report.handled), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn an_unrecoverable_receive_error_finishes_held_work_then_stops() {
    let sub = scripted_subscription(vec![
        Ok(Some(delivery(1, "a"))),
        Err(TransportError::MissingAddress {
            address: "/amq/queue/comments".into(),
            hint: "declare the queue".into(),
        }),
    ]);
    let mut b = Broker::new(mock_with(sub));
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    let handler = |_msg: Message| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok::<(), HandlerError>(())
    };

    let err = Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, ConsumerError::Receive { .. }), "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn a_failed_settlement_is_counted_and_the_run_goes_on() {
    let mut b = broker([delivery(1, "a"), delivery(2, "b")]);
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Err(TransportError::connection_lost("channel closed")));
    b.mock
        .expect_settle()
        .with(eq(2), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(b, policy(), succeeding).await;

    assert_eq!((report.settle_errors, report.handled), (1, 1));
    assert_eq!(report.accounted(), report.received);
}

#[tokio::test(start_paused = true)]
async fn malformed_headers_do_not_stop_the_message() {
    let headers: Headers = [(headers::ATTEMPTS, HeaderValue::from("many"))]
        .into_iter()
        .collect();
    let mut b = broker([delivery_with(1, "a", headers, BrokerSignals::default())]);
    b.mock
        .expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(b, policy(), succeeding).await;
    assert_eq!(report.handled, 1);
}

fn assert_send<F: Future + Send>(f: F) -> F {
    f
}

#[tokio::test(start_paused = true)]
async fn the_consumer_is_one_send_future() {
    let mut b = broker([delivery(1, "a")]);
    b.mock.expect_settle().times(1).returning(|_, _| Ok(()));
    let consumer = Consumer::builder(b, QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap();
    let run = assert_send(consumer.run(std::future::pending()));
    let report: RunReport = tokio::spawn(run).await.unwrap().unwrap();
    assert_eq!(report.handled, 1);
}

/// The handler runs in `log` between `start NAME` and `end NAME`, as `(name, start, end)`
/// in log order.
fn runs(log: &Log) -> Vec<(String, usize, usize)> {
    let entries = log.entries();
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if let Some(name) = e.strip_prefix("start ") {
            let end = entries
                .iter()
                .skip(i)
                .position(|x| x == &format!("end {name}"))
                .map_or(usize::MAX, |j| i + j);
            out.push((name.to_owned(), i, end));
        }
    }
    out
}

/// The work runs that started while the run named `suspect` was under way.
fn started_beside(log: &Log, suspect: &str) -> Vec<String> {
    let all = runs(log);
    let (_, from, to) = all
        .iter()
        .find(|(name, _, _)| name == suspect)
        .cloned()
        .unwrap_or_else(|| panic!("{suspect} never ran: {:?}", log.entries()));
    all.into_iter()
        .filter(|(name, start, _)| name != suspect && *start > from && *start < to)
        .map(|(name, _, _)| name)
        .collect()
}

/// A work queue that hands out `first`, then fresh work (`w1:1`, `w2:1`, ...) forever.
fn endless_work(first: Vec<Delivery<u64>>) -> MockSub {
    let mut sub = MockSub::new();
    let first = Mutex::new(VecDeque::from(first));
    let next = AtomicU64::new(1);
    sub.expect_recv().returning(move || {
        if let Some(d) = first.lock().unwrap().pop_front() {
            return Ok(Some(d));
        }
        let n = next.fetch_add(1, Ordering::SeqCst);
        Ok(Some(delivery(1000 + n, &format!("w{n}:1"))))
    });
    sub.expect_cancel().returning(|| Ok(()));
    sub.expect_flush().returning(|| Ok(()));
    sub
}

#[tokio::test(start_paused = true)]
async fn a_watch_that_fails_while_a_suspect_runs_alone_never_lets_work_start_beside_it() {
    let log = Log::default();
    // A redelivered delivery first: it is isolated, and runs alone for 10 s. The watch of
    // the isolation queue, started while work ran, fails 3 s in.
    let sub = endless_work(vec![delivery_with(
        1,
        "suspect:10",
        Headers::new(),
        REDELIVERED,
    )]);
    let mut b = Broker::new(mock_with(sub));
    b.log = log.clone();
    b.watch_fails_after = Some(Duration::from_secs(3));
    isolation_lands_in_the_model(&mut b, &log);
    b.mock.expect_settle().returning(|_, _| Ok(()));

    Consumer::builder(b, QUEUE, policy(), timed_handler(&log))
        .with_solo_gate(SoloGate::new())
        .with_prefetch(2)
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(20)))
        .await
        .unwrap();

    assert!(log.entries().iter().any(|e| e == "watch failed"));
    assert_eq!(
        started_beside(&log, "suspect:10"),
        Vec::<String>::new(),
        "{:?}",
        log.entries()
    );
    assert!(
        runs(&log).len() > 3,
        "work resumed after the suspect: {:?}",
        log.entries()
    );
}

#[tokio::test(start_paused = true)]
async fn a_suspect_fetched_after_shutdown_began_goes_back_unrun_as_a_fresh_copy() {
    let log = Log::default();
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().never();
    let mut b = Broker::new(mock).with_suspects([suspect(7, "late", BrokerSignals::default())]);
    b.log = log.clone();
    // The fetch answers 2 s after it was asked; shutdown comes 1 s in.
    b.fetch_after = Duration::from_secs(2);
    isolation_lands_in_the_model(&mut b, &log);
    let l = log.clone();
    b.mock.expect_settle().returning(move |tag, s| {
        l.push(format!("{s:?} {tag}"));
        Ok(())
    });
    let suspects = b.suspects.clone();
    let ended = Arc::new(Mutex::new(Vec::new()));
    let e = ended.clone();

    let report = Consumer::builder(b, QUEUE, policy(), timed_handler(&log))
        .with_solo_gate(SoloGate::new())
        .with_on_terminal(move |msg, t| e.lock().unwrap().push((body(msg), *t)))
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(1)))
        .await
        .unwrap();

    assert_eq!(runs(&log), [], "no handler runs once shutdown began");
    assert_eq!(log.entries(), ["fetch late", "isolate late", "Ack 7"]);
    assert_eq!(
        *ended.lock().unwrap(),
        [("late".to_owned(), Terminal::Isolated)]
    );
    assert_eq!(report.left_unsettled, 0);
    // The copy waits in the isolation queue, not redelivered and with no crash on it.
    let back = suspects.lock().unwrap().pop_front().expect("the copy");
    assert_eq!((back.facts.redelivered, back.facts.crashes), (false, 0));
}

#[tokio::test(start_paused = true)]
async fn while_one_consumer_runs_a_suspect_no_other_consumer_of_its_process_runs_work() {
    let log = Log::default();
    let gate = SoloGate::new();
    // Consumer A starts with a suspect waiting that runs for 10 s.
    let mut a = broker([]).with_suspects([suspect(1, "suspect:10", BrokerSignals::default())]);
    a.log = log.clone();
    a.mock.expect_settle().returning(|_, _| Ok(()));
    // Consumer B, of the same process, runs endless work of 1 s each, two at a time.
    let mut b = Broker::new(mock_with(endless_work(vec![])));
    b.log = log.clone();
    b.mock.expect_settle().returning(|_, _| Ok(()));

    let b_run = Consumer::builder(b, "comments", policy(), timed_handler(&log))
        .with_solo_gate(gate.clone())
        .with_prefetch(2)
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_secs(30)));
    // A starts while B is busy.
    let a_run = async {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        Consumer::builder(a, QUEUE, policy(), timed_handler(&log))
            .with_solo_gate(gate.clone())
            .build()
            .unwrap()
            .run(tokio::time::sleep(Duration::from_secs(20)))
            .await
    };
    let (a_report, b_report) = futures::join!(a_run, b_run);

    assert_eq!(a_report.unwrap().suspects, 1);
    assert!(b_report.unwrap().handled > 10);
    assert_eq!(
        started_beside(&log, "suspect:10"),
        Vec::<String>::new(),
        "{:?}",
        log.entries()
    );
    assert_eq!(gate.members(), 0, "both left the gate");
}

#[tokio::test(start_paused = true)]
async fn a_delivery_received_after_storm_control_paused_waits_unstarted() {
    let timeout = || {
        Err(TransportError::Timeout {
            operation: "recv",
            after: Duration::ZERO,
        })
    };
    // "fail:1" fails after 1 s and trips storm control. The receive under way then waits
    // out backoffs of 0.1 + 0.2 + 0.4 + 0.8 s and brings "later" at 1.5 s, into the pause.
    let sub = scripted_subscription(vec![
        Ok(Some(delivery(1, "fail:1"))),
        timeout(),
        timeout(),
        timeout(),
        timeout(),
        Ok(Some(delivery(2, "later"))),
        Ok(None),
    ]);
    let mut b = Broker::new(mock_with(sub));
    b.mock
        .expect_publish()
        .returning(|_, _| PublishResult::Confirmed);
    b.mock.expect_settle().returning(|_, _| Ok(()));
    let started = Arc::new(Mutex::new(Vec::new()));
    let s = started.clone();
    let t0 = tokio::time::Instant::now();
    let handler = move |msg: Message| {
        s.lock().unwrap().push((body(&msg), t0.elapsed()));
        async move {
            if body(&msg).starts_with("fail") {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return Err(HandlerError::transient("downstream down"));
            }
            Ok(())
        }
    };

    Consumer::builder(b, QUEUE, policy(), handler)
        .with_solo_gate(SoloGate::new())
        .with_prefetch(2)
        .with_storm_control(
            StormControl::consecutive_failures(1)
                .with_cool_down(Duration::from_secs(10), Duration::from_secs(10)),
        )
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    let started = started.lock().unwrap().clone();
    assert_eq!(started.len(), 2, "{started:?}");
    assert_eq!(started[1].0, "later");
    assert!(
        started[1].1 >= Duration::from_secs(11),
        "\"later\" started at {:?}, inside the pause from 1 s to 11 s",
        started[1].1
    );
}

#[tokio::test(start_paused = true)]
async fn a_subscribe_that_loses_its_connection_is_tried_again() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    let mut seq = Sequence::new();
    mock.expect_consume()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_, _| Err(TransportError::connection_lost("failing over")));
    let sub = subscription([delivery(1, "a")]);
    mock.expect_consume()
        .times(1)
        .in_sequence(&mut seq)
        .return_once(move |_, _| Ok(sub));
    mock.expect_settle().times(1).returning(|_, _| Ok(()));

    let report = Consumer::builder(Broker::new(mock), QUEUE, policy(), succeeding)
        .with_solo_gate(SoloGate::new())
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!((report.handled, report.receive_errors), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_runs_what_the_subscription_was_sent_before_its_cancel() {
    // Prefetch 2, five deliveries in the subscription's buffer, each run taking 1 s: the
    // shutdown comes 1.5 s in, and the three still buffered are run, not sent back.
    let log = Log::default();
    let sub = subscription((1..=5).map(|n| delivery(n, &format!("m{n}:1"))));
    let mut b = Broker::new(mock_with(sub));
    b.log = log.clone();
    let acked = Arc::new(Mutex::new(Vec::new()));
    let a = acked.clone();
    b.mock.expect_settle().returning(move |tag, s| {
        a.lock().unwrap().push((*tag, s));
        Ok(())
    });

    let report = Consumer::builder(b, QUEUE, policy(), timed_handler(&log))
        .with_solo_gate(SoloGate::new())
        .with_prefetch(2)
        .build()
        .unwrap()
        .run(tokio::time::sleep(Duration::from_millis(1_500)))
        .await
        .unwrap();

    assert_eq!(
        (report.handled, report.left_unsettled),
        (5, 0),
        "{report:?}"
    );
    let mut acked = acked.lock().unwrap().clone();
    acked.sort_by_key(|(tag, _)| *tag);
    assert_eq!(
        acked,
        (1..=5).map(|n| (n, Settlement::Ack)).collect::<Vec<_>>()
    );
}
