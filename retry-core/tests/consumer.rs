//! The consumer driver against mockall mocks of `Transport`, on tokio's paused clock: the
//! mock's `now` and `sleep` read and wait on tokio's virtual time, so handler timeouts,
//! in-process waits and the shutdown grace run in no real time and never flake.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
    MessageParts, Publish, PublishResult, RetryPolicy, RunReport, Settlement, Terminal, Timestamp,
    TopologyPlan, Transport, TransportError, message_identity,
};

mock! {
    pub Broker {}

    #[async_trait]
    impl Transport for Broker {
        type Tag = u64;
        fn capabilities(&self) -> Capabilities;
        async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError>;
        async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError>;
        async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError>;
        async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult;
        async fn settle(&self, tag: &u64, settlement: Settlement) -> Result<(), TransportError>;
        async fn cancel(&self) -> Result<(), TransportError>;
        fn now(&self) -> Timestamp;
        fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;
    }
}

const QUEUE: &str = "comments";
const EPOCH_MS: u64 = 1_700_000_000_000;

fn message(body: &str, headers: Headers) -> Message {
    Message::new(MessageParts {
        queue: QUEUE.into(),
        routing_key: QUEUE.into(),
        body: body.as_bytes().to_vec(),
        headers,
        ..MessageParts::default()
    })
}

fn delivery_with(tag: u64, body: &str, headers: Headers, signals: BrokerSignals) -> Delivery<u64> {
    let message = message(body, headers);
    let identity = message_identity(None, message.body());
    let facts = DeliveryFacts::decode(message.headers(), signals, identity);
    Delivery {
        tag,
        message,
        facts,
    }
}

fn delivery(tag: u64, body: &str) -> Delivery<u64> {
    delivery_with(tag, body, Headers::new(), BrokerSignals::default())
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

/// A broker that serves `deliveries`, then reports the end of the stream; provisioning,
/// consuming and cancelling succeed. Publishes and settlements are left to each test.
fn broker(deliveries: impl IntoIterator<Item = Delivery<u64>>) -> MockBroker {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_capabilities().return_const(Capabilities {
        publisher_confirms: true,
        dead_letter_exchange: true,
        declares_topology: true,
        ..Capabilities::default()
    });
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().returning(|_, _| Ok(()));
    let inbox = Mutex::new(deliveries.into_iter().collect::<VecDeque<_>>());
    mock.expect_recv()
        .returning(move || Ok(inbox.lock().unwrap().pop_front()));
    mock.expect_cancel().returning(|| Ok(()));
    mock
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
    Consumer::builder(transport, policy, handler)
        .queue(QUEUE)
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
    let mut mock = broker([delivery(1, "a")]);
    let mut seq = Sequence::new();
    let l = log.clone();
    mock.expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s" && p.headers.attempts == 1)
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_, _| {
            l.push("publish confirmed");
            PublishResult::Confirmed
        });
    let l = log.clone();
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .in_sequence(&mut seq)
        .returning(move |_, _| {
            l.push("ack");
            Ok(())
        });

    let report = run_to_end(mock, policy(), failing).await;

    assert_eq!(log.entries(), ["publish confirmed", "ack"]);
    assert_eq!((report.received, report.retried), (1, 1));
    assert_eq!(report.accounted(), report.received);
}

/// Wraps the mock so confirms take `confirm_after` of virtual time, as on a real broker:
/// the publish is sent (the mock records it) and answered later.
struct SlowConfirms {
    inner: MockBroker,
    confirm_after: Duration,
}

#[async_trait]
impl Transport for SlowConfirms {
    type Tag = u64;
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn provision(&self, plan: &TopologyPlan) -> Result<(), TransportError> {
        self.inner.provision(plan).await
    }
    async fn consume(&self, queue: &str, prefetch: u16) -> Result<(), TransportError> {
        self.inner.consume(queue, prefetch).await
    }
    async fn recv(&self) -> Result<Option<Delivery<u64>>, TransportError> {
        self.inner.recv().await
    }
    async fn publish(&self, original: &Message, publish: &Publish) -> PublishResult {
        let answer = self.inner.publish(original, publish).await;
        tokio::time::sleep(self.confirm_after).await;
        answer
    }
    async fn settle(&self, tag: &u64, settlement: Settlement) -> Result<(), TransportError> {
        self.inner.settle(tag, settlement).await
    }
    async fn cancel(&self) -> Result<(), TransportError> {
        self.inner.cancel().await
    }
    fn now(&self) -> Timestamp {
        self.inner.now()
    }
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        self.inner.sleep(duration)
    }
}

#[tokio::test(start_paused = true)]
async fn slow_confirms_hold_the_ack_back_and_run_concurrently() {
    let start = tokio::time::Instant::now();
    let confirm_after = Duration::from_secs(5);
    let mut mock = broker([delivery(1, "a"), delivery(2, "b")]);
    mock.expect_publish()
        .times(2)
        .returning(|_, _| PublishResult::Confirmed);
    let acked_at = Arc::new(Mutex::new(Vec::new()));
    let at = acked_at.clone();
    mock.expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(2)
        .returning(move |tag, _| {
            at.lock().unwrap().push((*tag, start.elapsed()));
            Ok(())
        });
    let transport = SlowConfirms {
        inner: mock,
        confirm_after,
    };

    let report = run_to_end(transport, policy(), failing).await;

    assert_eq!(report.retried, 2);
    let mut acked_at = acked_at.lock().unwrap().clone();
    acked_at.sort();
    // Neither ack comes before its confirm, and the second publish did not wait for the
    // first one's confirm (that would put its ack at 10 s).
    assert_eq!(acked_at, [(1, confirm_after), (2, confirm_after)]);
}

async fn requeued_when_the_publish_answers(answer: fn() -> PublishResult, cause: Confirm) {
    let mut mock = broker([delivery(7, "a")]);
    mock.expect_publish()
        .times(1)
        .returning(move |_, _| answer());
    mock.expect_settle()
        .with(always(), eq(Settlement::Ack))
        .never();
    mock.expect_settle()
        .with(eq(7), eq(Settlement::Requeue))
        .times(1)
        .returning(|_, _| Ok(()));
    let terminals = Arc::new(Mutex::new(Vec::new()));
    let seen = terminals.clone();

    let report = Consumer::builder(mock, policy(), failing)
        .queue(QUEUE)
        .on_terminal(move |_, t| seen.lock().unwrap().push(*t))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!((report.requeued, report.retried), (1, 0));
    assert_eq!(*terminals.lock().unwrap(), [Terminal::Requeued { cause }]);
}

#[tokio::test(start_paused = true)]
async fn a_requeue_after_a_failed_publish_waits_the_requeue_delay() {
    // A broker that keeps refusing the clone would otherwise get the message straight back,
    // in a hot loop.
    let start = tokio::time::Instant::now();
    let mut mock = broker([delivery(7, "a")]);
    mock.expect_publish()
        .times(1)
        .returning(|_, _| PublishResult::Refused);
    let requeued_after = Arc::new(Mutex::new(None));
    let at = requeued_after.clone();
    mock.expect_settle()
        .with(eq(7), eq(Settlement::Requeue))
        .times(1)
        .returning(move |_, _| {
            *at.lock().unwrap() = Some(start.elapsed());
            Ok(())
        });
    Consumer::builder(mock, policy(), failing)
        .queue(QUEUE)
        .requeue_delay(Duration::from_secs(2))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();
    assert_eq!(
        *requeued_after.lock().unwrap(),
        Some(Duration::from_secs(2))
    );
}

#[tokio::test(start_paused = true)]
async fn a_refused_publish_requeues_and_never_acks() {
    requeued_when_the_publish_answers(|| PublishResult::Refused, Confirm::Nack).await;
}

#[tokio::test(start_paused = true)]
async fn a_returned_publish_requeues_and_never_acks() {
    requeued_when_the_publish_answers(|| PublishResult::Returned, Confirm::Returned).await;
}

#[tokio::test(start_paused = true)]
async fn a_failed_publish_requeues_and_never_acks() {
    requeued_when_the_publish_answers(
        || PublishResult::Failed(TransportError::Connection("channel closed".into())),
        Confirm::Failed,
    )
    .await;
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
    let mut mock = broker([
        delivery(1, "str"),
        delivery(2, "string"),
        delivery(3, "other"),
    ]);
    let causes = Arc::new(Mutex::new(Vec::new()));
    let c = causes.clone();
    mock.expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s")
        .times(3)
        .returning(move |original, p| {
            c.lock()
                .unwrap()
                .push((body(original), p.headers.last_error.clone()));
            PublishResult::Confirmed
        });
    mock.expect_settle()
        .with(always(), eq(Settlement::Ack))
        .times(3)
        .returning(|_, _| Ok(()));

    let report = run_to_end(mock, policy(), panics).await;

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
    let mut mock = broker([delivery(1, "slow")]);
    let last_error = Arc::new(Mutex::new(None));
    let e = last_error.clone();
    mock.expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s")
        .times(1)
        .returning(move |_, p| {
            *e.lock().unwrap() = p.headers.last_error.clone();
            PublishResult::Confirmed
        });
    mock.expect_settle()
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

    let report = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .handler_timeout(Duration::from_secs(10))
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
async fn shutdown_finishes_work_within_the_grace_and_leaves_the_rest_unsettled() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume()
        .with(eq(QUEUE), eq(3))
        .returning(|_, _| Ok(()));
    // Three deliveries fill the prefetch; no receive may follow the shutdown.
    let inbox = Mutex::new(VecDeque::from([
        delivery(1, "ok after 5s"),
        delivery(2, "fails after 3s"),
        delivery(3, "ok after 25m"),
    ]));
    mock.expect_recv()
        .times(3)
        .returning(move || Ok(inbox.lock().unwrap().pop_front()));
    mock.expect_cancel().times(1).returning(|| Ok(()));
    mock.expect_publish()
        .withf(|original, _| original.body() == b"fails after 3s")
        .times(1)
        .returning(|_, _| PublishResult::Confirmed);
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    mock.expect_settle()
        .with(eq(2), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
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

    let report = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .prefetch(3)
        .handler_timeout(Duration::from_secs(29 * 60))
        .shutdown_grace(Duration::from_secs(30))
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
}

#[tokio::test(start_paused = true)]
async fn shutdown_with_nothing_held_stops_at_once() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().returning(|_, _| Ok(()));
    // An idle queue whose receives time out.
    mock.expect_recv().returning(|| {
        Err(TransportError::Timeout {
            operation: "recv",
            after: Duration::from_secs(60),
        })
    });
    mock.expect_cancel().times(1).returning(|| Ok(()));
    mock.expect_settle().never();

    let report = Consumer::builder(mock, policy(), succeeding)
        .queue(QUEUE)
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
    let mut mock = broker((1..=20).map(|tag| delivery(tag, &format!("m{tag}"))));
    mock.expect_settle()
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

    let report = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .prefetch(PREFETCH)
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
        .build()
        .unwrap();
    let err = Consumer::builder(MockBroker::new(), policy.clone(), succeeding)
        .queue(QUEUE)
        .handler_timeout(Duration::from_secs(10 * 60))
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            ConsumerConfigError::ExceedsConsumerTimeout {
                runs: 3,
                immediate_retries: 2,
                worst_case,
                consumer_timeout,
                ..
            } if worst_case == Duration::from_secs(30 * 60 + 10)
                && consumer_timeout == Duration::from_secs(30 * 60)
        ),
        "{err:?}"
    );
    let text = err.to_string();
    for number in [
        "consumer_timeout (30m)",
        "handler_timeout (10m)",
        "3 runs",
        "immediate_retries 2",
        "immediate_wait (5s)",
        "= 30m10s",
    ] {
        assert!(text.contains(number), "{number:?} missing from: {text}");
    }

    // Reaching the timeout exactly is refused too.
    let err = Consumer::builder(MockBroker::new(), self::policy(), succeeding)
        .queue(QUEUE)
        .handler_timeout(Duration::from_secs(60))
        .consumer_timeout(Duration::from_secs(60))
        .build()
        .unwrap_err();
    assert!(matches!(
        err,
        ConsumerConfigError::ExceedsConsumerTimeout { .. }
    ));

    // A shorter handler timeout, or a longer broker timeout, fits.
    let consumer = Consumer::builder(MockBroker::new(), policy.clone(), succeeding)
        .queue(QUEUE)
        .handler_timeout(Duration::from_secs(9 * 60))
        .build()
        .unwrap();
    assert_eq!(consumer.consumer_timeout(), Duration::from_secs(30 * 60));
    Consumer::builder(MockBroker::new(), policy, succeeding)
        .queue(QUEUE)
        .handler_timeout(Duration::from_secs(10 * 60))
        .consumer_timeout(Duration::from_secs(60 * 60))
        .build()
        .unwrap();
}

#[test]
fn other_invalid_settings_are_refused_by_name() {
    let err = Consumer::builder(MockBroker::new(), policy(), succeeding)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::MissingQueue));
    assert!(err.to_string().contains("queue"));

    let err = Consumer::builder(MockBroker::new(), policy(), succeeding)
        .queue(QUEUE)
        .prefetch(0)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::ZeroPrefetch));
    assert!(err.to_string().contains("prefetch"));

    let err = Consumer::builder(MockBroker::new(), policy(), succeeding)
        .queue(QUEUE)
        .handler_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::ZeroHandlerTimeout));

    let err = Consumer::builder(MockBroker::new(), policy(), succeeding)
        .queue("amq.reserved")
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::Topology(_)));
}

#[test]
fn run_handler_crash_mode_needs_a_transport_with_delivery_counts() {
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .with_on_crash(retry_core::CrashAction::RunHandler)
        .build()
        .unwrap();
    fn quorum(b: retry_core::TopologyBuilder<'_>) -> retry_core::TopologyBuilder<'_> {
        b.with_queue_type(retry_core::QueueType::Quorum)
    }
    let mut blind = MockBroker::new();
    blind
        .expect_capabilities()
        .return_const(Capabilities::default());
    let err = Consumer::builder(blind, policy.clone(), succeeding)
        .queue(QUEUE)
        .topology(quorum)
        .build()
        .unwrap_err();
    assert!(matches!(err, ConsumerConfigError::NoDeliveryCount));
    assert!(err.to_string().contains("delivery count"));

    let mut counting = MockBroker::new();
    counting.expect_capabilities().return_const(Capabilities {
        delivery_count: true,
        ..Capabilities::default()
    });
    Consumer::builder(counting, policy, succeeding)
        .queue(QUEUE)
        .topology(quorum)
        .build()
        .unwrap();
}

#[test]
fn the_plan_is_available_after_build_and_can_be_customised() {
    let consumer = Consumer::builder(MockBroker::new(), policy(), succeeding)
        .queue(QUEUE)
        .topology(|b| b.with_queue_type(retry_core::QueueType::Quorum))
        .build()
        .unwrap();
    assert_eq!(consumer.plan().work_queue(), QUEUE);
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
}

#[tokio::test(start_paused = true)]
async fn the_topology_is_provisioned_before_consuming() {
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
        .returning(|_, _| Ok(()));
    mock.expect_recv()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Ok(None));

    run_to_end(mock, policy(), succeeding).await;
}

#[tokio::test(start_paused = true)]
async fn provisioning_can_be_turned_off_and_its_failure_stops_the_run() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().never();
    mock.expect_consume().times(1).returning(|_, _| Ok(()));
    mock.expect_recv().returning(|| Ok(None));
    Consumer::builder(mock, policy(), succeeding)
        .queue(QUEUE)
        .provision(false)
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
    let err = Consumer::builder(mock, policy(), succeeding)
        .queue(QUEUE)
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, ConsumerError::Provision { .. }), "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn an_immediate_retry_runs_in_process_after_its_wait() {
    let policy = RetryPolicy::delays([Duration::from_secs(30)])
        .with_immediate_retries(1, Duration::from_secs(2))
        .build()
        .unwrap();
    let mut mock = broker([delivery(1, "flaky")]);
    mock.expect_publish().never();
    mock.expect_settle()
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

    let report = run_to_end(mock, policy, handler).await;

    assert_eq!(report.handled, 1);
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 2);
    assert_eq!((attempts[0].0, attempts[1].0), (1, 2));
    assert_eq!(attempts[1].1 - attempts[0].1, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_redelivered_message_is_diverted_without_running_the_handler() {
    let redelivered = BrokerSignals {
        redelivered: true,
        ..BrokerSignals::default()
    };
    let mut mock = broker([delivery_with(1, "crashy", Headers::new(), redelivered)]);
    mock.expect_publish()
        .withf(|_, p| &*p.route.routing_key == "comments.retry.30s" && p.headers.crashes == 1)
        .times(1)
        .returning(|_, _| PublishResult::Confirmed);
    mock.expect_settle()
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

    let report = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .on_terminal(move |msg, t| e.lock().unwrap().push((msg.attempt(), *t)))
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap();

    assert_eq!(report.diverted, 1);
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
async fn exhausted_and_permanent_failures_are_parked_and_observed() {
    // Attempt 2 of 2 (one earlier failure in the headers), and a permanent failure.
    let headers: Headers = [(headers::ATTEMPTS, 1i64)].into_iter().collect();
    let mut mock = broker([
        delivery_with(1, "again", headers, BrokerSignals::default()),
        delivery(2, "poison"),
    ]);
    mock.expect_publish()
        .withf(|_, p| {
            &*p.route.routing_key == QUEUE && p.route.exchange.as_ref() == "comments.dead-letter"
        })
        .times(2)
        .returning(|_, _| PublishResult::Confirmed);
    mock.expect_settle()
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

    let report = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .on_terminal(move |msg, t| e.lock().unwrap().push((body(msg), msg.attempt(), *t)))
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

#[tokio::test(start_paused = true)]
async fn a_lost_connection_while_receiving_is_retried() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().returning(|_, _| Ok(()));
    let mut seq = Sequence::new();
    mock.expect_recv()
        .times(2)
        .in_sequence(&mut seq)
        .returning(|| Err(TransportError::Connection("connection reset".into())));
    mock.expect_recv()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Ok(Some(delivery(1, "a"))));
    mock.expect_recv()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Ok(None));
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(mock, policy(), succeeding).await;

    assert_eq!((report.receive_errors, report.handled), (2, 1));
}

#[tokio::test(start_paused = true)]
async fn an_unrecoverable_receive_error_finishes_held_work_then_stops() {
    let mut mock = MockBroker::new();
    virtual_clock(&mut mock);
    mock.expect_provision().returning(|_| Ok(()));
    mock.expect_consume().returning(|_, _| Ok(()));
    let mut seq = Sequence::new();
    mock.expect_recv()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| Ok(Some(delivery(1, "a"))));
    mock.expect_recv()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|| {
            Err(TransportError::MissingAddress {
                address: "/amq/queue/comments".into(),
                hint: "declare the queue".into(),
            })
        });
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));
    let handler = |_msg: Message| async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        Ok::<(), HandlerError>(())
    };

    let err = Consumer::builder(mock, policy(), handler)
        .queue(QUEUE)
        .build()
        .unwrap()
        .run(std::future::pending())
        .await
        .unwrap_err();
    assert!(matches!(err, ConsumerError::Receive { .. }), "{err:?}");
}

#[tokio::test(start_paused = true)]
async fn a_failed_settlement_is_counted_and_the_run_goes_on() {
    let mut mock = broker([delivery(1, "a"), delivery(2, "b")]);
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Err(TransportError::Connection("channel closed".into())));
    mock.expect_settle()
        .with(eq(2), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(mock, policy(), succeeding).await;

    assert_eq!((report.settle_errors, report.handled), (1, 1));
    assert_eq!(report.accounted(), report.received);
}

#[tokio::test(start_paused = true)]
async fn malformed_headers_do_not_stop_the_message() {
    let headers: Headers = [(headers::ATTEMPTS, HeaderValue::from("many"))]
        .into_iter()
        .collect();
    let mut mock = broker([delivery_with(1, "a", headers, BrokerSignals::default())]);
    mock.expect_settle()
        .with(eq(1), eq(Settlement::Ack))
        .times(1)
        .returning(|_, _| Ok(()));

    let report = run_to_end(mock, policy(), succeeding).await;
    assert_eq!(report.handled, 1);
}

fn assert_send<F: Future + Send>(f: F) -> F {
    f
}

#[tokio::test(start_paused = true)]
async fn the_consumer_is_one_send_future() {
    let mut mock = broker([delivery(1, "a")]);
    mock.expect_settle().times(1).returning(|_, _| Ok(()));
    let consumer = Consumer::builder(mock, policy(), succeeding)
        .queue(QUEUE)
        .build()
        .unwrap();
    let run = assert_send(consumer.run(std::future::pending()));
    let report: RunReport = tokio::spawn(run).await.unwrap().unwrap();
    assert_eq!(report.handled, 1);
}
