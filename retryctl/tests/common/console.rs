//! Running `retryctl serve` for the console tests: the built binary on a port of its own,
//! a plain HTTP/1.1 client, and parked messages to show.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Channel};
use serde_json::Value;

const RETRYCTL: &str = env!("CARGO_BIN_EXE_retryctl");

/// The token the tests' consoles use.
pub const TOKEN: &str = "console-test-token-0123456789abcdef";

/// A running console, stopped when dropped.
pub struct Console {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Everything it wrote to standard error so far.
    pub log: Arc<Mutex<String>>,
}

impl Console {
    /// `retryctl serve QUEUES... --listen 127.0.0.1:0` plus `extra`, with `TOKEN` in
    /// `RETRYCTL_TOKEN`, against the test broker; returns once it listens.
    pub fn start(queues: &[&str], extra: &[&str]) -> Console {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        args.extend_from_slice(queues);
        let mut child = Command::new(RETRYCTL)
            .args(&args)
            .env("AMQP_URL", super::common::amqp_url())
            .env_remove("RETRYCTL_PROTOCOL")
            .env("RETRYCTL_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("retryctl serve starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let kept = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or("").to_owned());
                }
                let mut log = kept.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                panic!("retryctl serve did not listen: {}", log.lock().unwrap());
            }
        };
        Console {
            child,
            base: format!("http://{addr}"),
            addr,
            log,
        }
    }

    /// A request with the bearer token.
    pub fn api(&self, method: &str, path: &str, body: Option<&str>) -> Response {
        let auth = format!("Bearer {TOKEN}");
        let mut headers = vec![("Authorization", auth.as_str())];
        if body.is_some() {
            headers.push(("Content-Type", "application/json"));
        }
        self.request(method, path, &headers, body.unwrap_or(""))
    }

    /// The JSON of a GET with the bearer token, which must answer 200.
    pub fn get_json(&self, path: &str) -> Value {
        let response = self.api("GET", path, None);
        assert_eq!(response.status, 200, "GET {path}: {response:?}");
        response.json()
    }

    /// Any request.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Response {
        request(&self.addr, method, path, headers, body)
    }

    /// Waits until the index of `queue` has been built more than `after` times, and
    /// returns the queue's JSON.
    pub fn index_after(&self, queue: &str, after: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let q = self.get_json(&format!("/api/queues/{queue}"));
            if q["index"]["generation"].as_u64().unwrap_or(0) > after {
                return q;
            }
            assert!(Instant::now() < deadline, "no walk of {queue} ended: {q}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Walks `queue` again and waits for the new index.
    pub fn reindex(&self, queue: &str) -> Value {
        let before = self.get_json(&format!("/api/queues/{queue}"))["index"]["generation"]
            .as_u64()
            .unwrap();
        let asked = self.api("POST", &format!("/api/queues/{queue}/refresh"), None);
        assert_eq!(asked.status, 202, "{asked:?}");
        self.index_after(queue, before)
    }

    /// Starts `verb` (`replay` or `purge`) on `queue` through the API with `body`, which
    /// must answer 202, and returns the action's JSON once it has ended.
    pub fn act(&self, queue: &str, verb: &str, body: &str) -> Value {
        let r = self.api("POST", &format!("/api/queues/{queue}/{verb}"), Some(body));
        assert_eq!(r.status, 202, "{verb} {body}: {r:?}");
        self.job_done(r.json()["url"].as_str().unwrap())
    }

    /// Waits for job `url` (`/api/jobs/N`) to end, and returns its JSON.
    pub fn job_done(&self, url: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let job = self.get_json(url);
            if job["done"] == true {
                return job;
            }
            assert!(Instant::now() < deadline, "job did not end: {job}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One HTTP/1.1 request on a connection of its own.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Response {
    let mut stream = TcpStream::connect(addr).expect("the console accepts");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut text = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str("\r\n");
    text.push_str(body);
    stream.write_all(text.as_bytes()).unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Response {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// The value of the first field `name` in a page's `html` (`name="NAME" value="..."`).
pub fn hidden(html: &str, name: &str) -> Option<String> {
    let marker = format!("name=\"{name}\" value=\"");
    let at = html.find(&marker)? + marker.len();
    Some(html[at..].split('"').next()?.to_owned())
}

/// A message to park.
pub struct Parked<'a> {
    pub id: &'a str,
    pub reason: &'a str,
    pub error: &'a str,
    /// Minutes before now that it was parked.
    pub minutes_ago: i64,
    pub body: &'a [u8],
    /// More headers.
    pub headers: Vec<(&'a str, AMQPValue)>,
}

impl<'a> Parked<'a> {
    pub fn new(id: &'a str, reason: &'a str, error: &'a str) -> Self {
        Parked {
            id,
            reason,
            error,
            minutes_ago: 5,
            body: b"{\"comment\":\"hello\"}",
            headers: Vec::new(),
        }
    }
}

/// Publishes each message into `parking` as the engine parks it, with a confirm each.
pub async fn park(ch: &Channel, work: &str, parking: &str, messages: Vec<Parked<'_>>) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for m in messages {
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        let at = now - m.minutes_ago * 60_000;
        let mut headers = vec![
            ("x-retry-reason", text(m.reason)),
            ("x-retry-attempts", AMQPValue::LongLongInt(3)),
            ("x-retry-first-failure", AMQPValue::LongLongInt(at - 30_000)),
            ("x-retry-last-failure", AMQPValue::LongLongInt(at)),
            ("x-retry-last-error", text(m.error)),
            ("x-retry-origin-queue", text(work)),
        ];
        headers.extend(m.headers);
        let properties = BasicProperties::default()
            .with_message_id(m.id.into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(super::common::table(headers));
        super::common::publish_with(ch, parking, m.body, properties).await;
    }
}

/// The messages `queue` holds, ready or delivered and unacknowledged: the console's own
/// walks hold a parking queue's messages unacknowledged while they read it.
pub async fn held(queue: &str) -> u64 {
    let (ready, unacked) = super::common::ready_and_unacked(queue).await;
    ready + unacked
}

/// A work queue of its own (classic), provisioned, with `messages` parked in its parking
/// queue; its guard deletes it.
pub async fn parked_queue(
    config: &transport_amqp091::AmqpConfig,
    prefix: &str,
    messages: Vec<Parked<'_>>,
) -> (String, super::common::Cleanup) {
    use retry_core::Transport as _;
    let queue = super::common::unique(prefix);
    let plan = super::common::classic_plan(&queue);
    let mut cleanup = super::common::Cleanup::new(super::common::amqp_url());
    cleanup.plan(&plan);
    let transport = super::common::transport(config).await;
    transport.provision(&plan).await.unwrap();
    let _ = transport.close().await;
    let (_conn, ch) = super::common::raw().await;
    park(&ch, &queue, plan.parking_queue(), messages).await;
    (queue, cleanup)
}
