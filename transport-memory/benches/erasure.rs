//! What a `DynTransport` costs against the concrete transport, in the same run: one
//! consumer, the same messages, on transport-memory as `MemoryTransport` and as the
//! `DynTransport` a `Registry` hands out. The in-memory broker does no IO, so the
//! difference is the erasure's whole cost (a shared allocation per delivery tag, one more
//! boxed future per `recv`), not hidden under a network's.
//!
//! ```text
//! cargo bench -p transport-memory --bench erasure
//! BENCH_MESSAGES=5000 BENCH_ROUNDS=5 cargo bench -p transport-memory --bench erasure
//! ```
//!
//! Two paths, prefetch 50: success (every handler succeeds at once) and retry (every
//! message fails once, is retried through its delay queue after 1 s of virtual time and
//! succeeds). The two types run interleaved, round by round; each figure is the median
//! of the rounds in messages per second, with the lowest and highest beside it, and the
//! ratio is erased against concrete.

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use retry_core::{
    Consumer, DynTransport, HandlerError, Message, RetryPolicy, TopologyPlan, Transport,
};
use transport_memory::{Broker, MemoryTransport, Outgoing};

const QUEUE: &str = "erasure";

fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs one consumer on `transport` (connected to `broker`) until `n` messages, published
/// first, have each been handled; returns the wall time of the run.
fn run<T: Transport>(broker: &Broker, transport: T, n: usize, fail_once: bool) -> Duration {
    let policy = RetryPolicy::delays([Duration::from_secs(1)])
        .build()
        .expect("a policy");
    let plan = TopologyPlan::new(QUEUE, &policy).expect("a plan");
    broker.block_on(async {
        transport.provision(&plan).await.expect("provision");
    });
    for i in 0..n {
        broker
            .publish(Outgoing::to_queue(QUEUE, i.to_string().into()))
            .expect("publish");
    }
    let handled = Arc::new(Mutex::new(0usize));
    let (done, finished) = futures::channel::oneshot::channel::<()>();
    let done = Mutex::new(Some(done));
    let handler = move |msg: Message| async move {
        if fail_once && msg.attempt() == 1 {
            return Err(HandlerError::transient("first attempt fails"));
        }
        black_box(msg.body().len());
        Ok(())
    };
    let consumer = Consumer::builder(transport, QUEUE, policy, handler)
        .with_prefetch(50)
        .with_on_terminal({
            let handled = Arc::clone(&handled);
            move |_msg, terminal| {
                if terminal.is_final() {
                    let mut handled = handled.lock().unwrap();
                    *handled += 1;
                    if *handled == n {
                        done.lock().unwrap().take().map(|tx| tx.send(()));
                    }
                }
            }
        })
        .build()
        .expect("a consumer");
    let start = Instant::now();
    let report = broker
        .block_on(consumer.run(async {
            let _ = finished.await;
        }))
        .expect("the run");
    let took = start.elapsed();
    assert_eq!(report.handled as usize, n, "every message handled");
    took
}

fn fresh() -> (Broker, MemoryTransport) {
    let broker = Broker::builder().with_trace(false).build();
    let transport = broker.connect();
    (broker, transport)
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not used.
    let n = env("BENCH_MESSAGES", 20_000);
    let rounds = env("BENCH_ROUNDS", 7).max(1);
    println!("erasure: {n} messages a run, prefetch 50, {rounds} rounds, interleaved");
    for (path, fail_once) in [("success", false), ("retry", true)] {
        let (mut concrete, mut erased) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            // Alternate which goes first, so neither always runs on a warmer machine.
            for erase in if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            } {
                let (broker, transport) = fresh();
                let took = if erase {
                    run(&broker, DynTransport::new(transport), n, fail_once)
                } else {
                    run(&broker, transport, n, fail_once)
                };
                let rate = n as f64 / took.as_secs_f64();
                if erase {
                    erased.push(rate)
                } else {
                    concrete.push(rate)
                }
            }
        }
        let ratios: Vec<f64> = erased.iter().zip(&concrete).map(|(e, c)| e / c).collect();
        let (c, c_lo, c_hi) = median(concrete);
        let (e, e_lo, e_hi) = median(erased);
        let (r, r_lo, r_hi) = median(ratios);
        println!(
            "{path:<8} concrete {c:>9.0} msg/s ({c_lo:.0}–{c_hi:.0})   erased {e:>9.0} msg/s \
             ({e_lo:.0}–{e_hi:.0})   erased/concrete {r:.3} ({r_lo:.3}–{r_hi:.3})"
        );
    }
}
