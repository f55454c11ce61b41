//! The local RabbitMQ: finding it (or skipping loudly), unique names, and an AMQP 0-9-1
//! side connection that declares topology, publishes test messages, inspects queues and
//! deletes what a scenario made.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use lapin::Channel;
use retry_core::{TopologyPlan, Transport};
use tokio::sync::OnceCell;
use transport_amqp10::{Amqp10Config, Amqp10Transport};
use transport_amqp091::{AmqpConfig, AmqpTransport, headers_from_table};

use crate::harness::{Harness, ParkedMessage, TestMessage, TopologyFaults};
use crate::suite::{Scenario, print_uncaptured, run_and_clean_up};
use crate::verdict::Verdict;
use test_brokers::no_broker;
use test_brokers::rabbitmq::{
    confirm_channel, get, message_count, probe, publish, redeclare, refusing,
};

/// How far below a delay an observed wait may fall on RabbitMQ: its TTL timers fire on
/// millisecond boundaries.
pub const SLACK: Duration = Duration::from_millis(10);

/// Where the broker is: `AMQP_URL` and `AMQP10_URL`, loopback by default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BrokerEnv {
    /// The AMQP 0-9-1 URL.
    pub amqp091_url: String,
    /// The AMQP 1.0 URL (the same broker, through its plugin).
    pub amqp10_url: String,
}

impl BrokerEnv {
    /// The URLs from the environment, or the local broker's.
    pub fn from_env() -> Self {
        BrokerEnv {
            amqp091_url: test_brokers::amqp_url(),
            amqp10_url: test_brokers::amqp10_url(),
        }
    }

    /// The broker, if it answers (over AMQP 1.0 too when `amqp10`). Without one, `what` is
    /// skipped with a loud message, unless `REQUIRE_BROKER` is set (as CI sets it): then it
    /// panics.
    pub async fn detect(what: &str, amqp10: bool) -> Option<Self> {
        let env = Self::from_env();
        let probe = async {
            probe(&env.amqp091_url)
                .await
                .map_err(|e| format!("AMQP 0-9-1: {e}"))?;
            if amqp10 {
                let t = Amqp10Transport::connect(Amqp10Config::new(&env.amqp10_url))
                    .await
                    .map_err(|e| format!("AMQP 1.0: {e} (is rabbitmq_amqp1_0 enabled?)"))?;
                t.close().await;
            }
            Ok::<(), String>(())
        };
        let why = match tokio::time::timeout(Duration::from_secs(15), probe).await {
            Ok(Ok(())) => return Some(env),
            Ok(Err(e)) => e,
            Err(_) => "no answer within 15 s".to_owned(),
        };
        no_broker(what, &why);
        None
    }

    /// [`detect`](Self::detect), once per test binary for each protocol: the first test of
    /// a binary probes the broker (and says loudly that it is missing, or panics under
    /// `REQUIRE_BROKER`), the others reuse its answer.
    pub async fn detect_once(what: &str, amqp10: bool) -> Option<Self> {
        static AMQP091: OnceCell<Option<BrokerEnv>> = OnceCell::const_new();
        static AMQP10: OnceCell<Option<BrokerEnv>> = OnceCell::const_new();
        let cell = if amqp10 { &AMQP10 } else { &AMQP091 };
        cell.get_or_init(|| Self::detect(what, amqp10))
            .await
            .clone()
    }
}

/// How long one scenario may take on the local RabbitMQ.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(150);

/// Runs `scenario` on the local RabbitMQ on a [`runtime`] of its own: finds the broker
/// ([`BrokerEnv::detect_once`], over AMQP 1.0 too when `amqp10`; `what` names the tests in
/// the notice), connects a harness with `connect`, runs the scenario within
/// [`SCENARIO_LIMIT`] and deletes what it declared, passed or failed
/// ([`run_and_clean_up`]). `None` when there is no broker and `REQUIRE_BROKER` is not set.
pub fn run_scenario<H, Fut>(
    what: &str,
    amqp10: bool,
    scenario: Scenario<H>,
    connect: impl FnOnce(BrokerEnv) -> Fut,
) -> Option<Verdict>
where
    H: Harness,
    Fut: Future<Output = H>,
{
    runtime().block_on(async {
        let env = BrokerEnv::detect_once(what, amqp10).await?;
        let h = connect(env).await;
        Some(run_and_clean_up(&h, scenario, SCENARIO_LIMIT).await)
    })
}

/// A name no other test, scenario or run uses: `cf-<scenario>-<pid>-<time>-<n>`, short
/// enough that every name derived from it stays far below AMQP's 255 bytes.
pub fn unique_name(scenario: &str) -> String {
    test_brokers::unique(&format!("cf-{scenario}"))
}

/// An AMQP 0-9-1 connection for everything around the transport under test: declaring and
/// deleting topology, publishing test messages, reading queues.
pub struct Admin {
    transport: AmqpTransport,
    channel: Channel,
    plans: Mutex<Vec<TopologyPlan>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").finish_non_exhaustive()
    }
}

impl Admin {
    /// Connects, with a confirm-mode channel for publishing.
    pub async fn connect(url: &str) -> Self {
        let transport =
            AmqpTransport::connect(AmqpConfig::new(url).with_connection_name(unique_name("admin")))
                .await
                .expect("the admin connection opens");
        let channel = confirm_channel(&transport.connection())
            .await
            .expect("a confirm-mode admin channel");
        Admin {
            transport,
            channel,
            plans: Mutex::new(Vec::new()),
        }
    }

    /// What transport-amqp091 declares it can do, asked of this connection.
    pub fn capabilities(&self) -> retry_core::Capabilities {
        self.transport.capabilities()
    }

    /// Remembers `plan` for [`cleanup`](Self::cleanup).
    pub fn track(&self, plan: &TopologyPlan) {
        self.plans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(plan.clone());
    }

    /// Declares `plan` through transport-amqp091, then redeclares each queue in `faults`
    /// with the fault's arguments, and remembers the plan for cleanup.
    pub async fn provision(&self, plan: &TopologyPlan, faults: &TopologyFaults) {
        self.track(plan);
        self.transport
            .provision(plan)
            .await
            .expect("provision over AMQP 0-9-1");
        for queue in plan
            .queues()
            .iter()
            .filter(|q| faults.refuse_publishes_to.contains(&q.name))
        {
            redeclare(&self.channel, plan, &queue.name, refusing)
                .await
                .expect("redeclare the queue to refuse publishes");
        }
    }

    /// Publishes a persistent test message to `queue` through the default exchange and
    /// waits for the confirm.
    pub async fn publish(&self, queue: &str, message: &TestMessage) {
        publish(&self.channel, queue, &message.body, &message.id).await;
    }

    /// Messages ready in `queue`; panics if it does not exist.
    pub async fn ready(&self, queue: &str) -> usize {
        let count = message_count(&self.channel, queue).await;
        count.unwrap_or_else(|e| panic!("queue {queue} does not exist: {e}")) as usize
    }

    /// Takes every message out of `queue` with `basic.get`.
    pub async fn take_all(&self, queue: &str) -> Vec<ParkedMessage> {
        let mut out = Vec::new();
        // Bounded: a queue someone keeps filling must not keep a scenario here.
        for _ in 0..100_000 {
            let Some(d) = get(&self.channel, queue).await else {
                return out;
            };
            out.push(ParkedMessage {
                id: d.properties.message_id().as_ref().map(|s| s.to_string()),
                headers: d
                    .properties
                    .headers()
                    .as_ref()
                    .map(headers_from_table)
                    .unwrap_or_default(),
                body: d.data,
            });
        }
        panic!("{queue} never ran dry");
    }

    /// Deletes every tracked plan's queues and exchanges, and its delay cascade (scenarios
    /// give each cascade a prefix of their own), and closes the connection.
    pub async fn cleanup(&self) {
        let plans = std::mem::take(&mut *self.plans.lock().unwrap_or_else(|e| e.into_inner()));
        for plan in plans {
            let deleted = match self.transport.teardown(&plan).await {
                Ok(()) => match plan.cascade() {
                    Some(cascade) => self.transport.teardown_cascade(cascade).await,
                    None => Ok(()),
                },
                Err(e) => Err(e),
            };
            if let Err(e) = deleted {
                print_uncaptured(&format!(
                    "warning: deleting the topology of {} failed: {e}\n",
                    plan.work_queue()
                ));
            }
        }
        let _ = self.transport.close().await;
    }
}

/// A multi-threaded tokio runtime for the broker tests: the lapin and fe2o3 transports
/// spawn their IO on it.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}
