//! The consumer's metrics, scraped by Prometheus: the `comments` workload in a loop on the
//! local broker, with `/metrics` served until Ctrl-C.
//!
//! ```sh
//! cargo run -p examples --example 05_metrics
//! curl -s 127.0.0.1:9898/metrics | grep retry_terminals_total
//! ```
//!
//! Environment: `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), `PORT` (default
//! 9898), `QUEUE` (default `comments-metrics`). The queue and its retry topology are deleted
//! on exit.
//!
//! The recorder is `metrics-exporter-prometheus`'s, installed before the consumer starts:
//! the consumer registers its metrics when its run begins. Any other `metrics` recorder
//! works the same way.

use std::error::Error;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Connection};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use retry_core::{Consumer, HandlerError, Message, RetryPolicy, StormControl, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use transport_amqp091::{AmqpConfig, AmqpTransport};

/// One round of the workload: a comment for each path through the retry topology.
const COMMENTS: [&str; 5] = [
    "great post",
    "flaky: fails once",
    "flaky: fails twice",
    "spam",
    "broken: always fails",
];

/// The `comments` handler: succeed, fail a few times, refuse spam for good, or always fail.
async fn handle_comment(msg: Message) -> Result<(), HandlerError> {
    match (msg.body(), msg.attempt()) {
        (b"spam", _) => Err(HandlerError::permanent("spam is never accepted")),
        (b"flaky: fails once", 1) | (b"flaky: fails twice", 1 | 2) => {
            Err(HandlerError::transient("db timeout"))
        }
        (b"broken: always fails", _) => Err(HandlerError::transient("cannot render comment")),
        _ => Ok(()),
    }
}

/// The Prometheus recorder, with histogram buckets for seconds and attempts.
fn recorder() -> Result<PrometheusHandle, Box<dyn Error>> {
    let seconds = [
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
    let attempts = [1.0, 2.0, 3.0, 4.0, 5.0, 10.0];
    Ok(PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)?
        .set_buckets_for_metric(Matcher::Full("retry_handled_attempt".into()), &attempts)?
        .install_recorder()?)
}

/// Serves `handle`'s rendering at `/metrics` on `listener`, one connection at a time.
async fn serve(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            continue;
        };
        let mut request = vec![0; 4096];
        let n = stream.read(&mut request).await.unwrap_or(0);
        let request = String::from_utf8_lossy(&request[..n]);
        let response = if request.starts_with("GET /metrics ") {
            handle.run_upkeep();
            let body = handle.render();
            format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
        } else {
            "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
        };
        let _ = stream.write_all(response.as_bytes()).await;
    }
}

/// Runs the consumer of `queue` with storm control on, publishes a round of comments every
/// second, and serves the metrics on `listener`, until `stop` resolves. Deletes the queue
/// and its topology at the end.
async fn run(
    url: &str,
    queue: &str,
    listener: TcpListener,
    handle: PrometheusHandle,
    stop: impl Future<Output = ()>,
) -> Result<(), Box<dyn Error>> {
    let transport = Arc::new(AmqpTransport::connect(AmqpConfig::new(url)).await?);
    let policy = RetryPolicy::delays([500, 1000, 2000].map(Duration::from_millis)).build()?;
    let consumer = Consumer::builder(Arc::clone(&transport), queue, policy, handle_comment)
        .with_prefetch(10)
        .with_storm_control(StormControl::consecutive_failures(20))
        .build()?;
    let plan = consumer.plan().clone();
    transport.provision(&plan).await?;

    let producer = Connection::connect(url, Default::default()).await?;
    let channel = producer.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let publishing = async {
        for round in 1u64.. {
            for (i, text) in COMMENTS.iter().enumerate() {
                let properties = BasicProperties::default()
                    .with_message_id(format!("comment-{round}-{}", i + 1).into())
                    .with_delivery_mode(2);
                channel
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions::default(),
                        text.as_bytes(),
                        properties,
                    )
                    .await?
                    .await?;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Ok::<(), lapin::Error>(())
    };
    // Histogram samples wait in the recorder until upkeep drains them: run it even when
    // nobody scrapes, so memory stays bounded.
    let upkeep = {
        let handle = handle.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                handle.run_upkeep();
            }
        }
    };
    let serving = serve(listener, handle);
    let consuming = consumer.run(stop);
    tokio::select! {
        report = consuming => println!("consumer stopped: {:?}", report?),
        published = publishing => published?,
        () = serving => {}
        () = upkeep => {}
    }
    transport.teardown(&plan).await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let queue = std::env::var("QUEUE").unwrap_or_else(|_| "comments-metrics".into());
    let port: u16 = match std::env::var("PORT") {
        Ok(port) => port.parse().map_err(|e| format!("PORT={port:?}: {e}"))?,
        Err(_) => 9898,
    };
    let handle = recorder()?;
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    println!("serving http://127.0.0.1:{port}/metrics for queue {queue}; Ctrl-C stops");
    let stop = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    run(&url, &queue, listener, handle, stop).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scrapes `/metrics` once.
    async fn scrape(port: u16) -> String {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        response
    }

    /// The value of the sample `line_start` (a name with its labels), if it is there.
    fn sample(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(name) && labels.iter().all(|label| l.contains(label)))
            .find_map(|l| l.rsplit(' ').next()?.parse().ok())
    }

    /// Runs the example on the local broker, on a queue and a port of its own, until every
    /// path of the workload shows in the scraped counters.
    #[tokio::test]
    async fn serves_the_consumers_counters() {
        let url = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
        if let Err(e) = Connection::connect(&url, Default::default()).await {
            test_brokers::no_broker("the metrics example", &e.to_string());
            return;
        }
        let queue = format!("metrics-example-{}", std::process::id());
        let handle = recorder().unwrap();
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn({
            let url = url.clone();
            let queue = queue.clone();
            async move {
                let stop = async {
                    let _ = stopped.await;
                };
                run(&url, &queue, listener, handle, stop)
                    .await
                    .map_err(|e| e.to_string())
            }
        });
        let q = format!("queue=\"{queue}\",lane=\"work\"");
        let mut text = String::new();
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            text = scrape(port).await;
            let parked = |reason: &str| {
                sample(
                    &text,
                    "retry_terminals_total",
                    &[&q, "terminal=\"parked\"", reason],
                )
            };
            if parked("reason=\"attempts-exhausted\"").unwrap_or(0.0) >= 1.0 {
                break;
            }
        }
        stop.send(()).unwrap();
        running.await.unwrap().unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        for (terminal, reason) in [
            ("handled", None),
            ("retried", None),
            ("parked", Some("reason=\"permanent\"")),
            ("parked", Some("reason=\"attempts-exhausted\"")),
        ] {
            let terminal = format!("terminal=\"{terminal}\"");
            let mut labels = vec![q.as_str(), terminal.as_str()];
            labels.extend(reason);
            let n = sample(&text, "retry_terminals_total", &labels);
            assert!(
                n.is_some_and(|n| n >= 1.0),
                "{labels:?} missing from:\n{text}"
            );
        }
        assert!(
            text.contains("# TYPE retry_handler_seconds histogram"),
            "{text}"
        );
        let paused = format!("retry_storm_paused{{queue=\"{queue}\"}} 0");
        assert!(text.contains(&paused), "{text}");
    }
}
