//! `rabbitmqctl`, for faults and for what the broker knows that a client cannot ask:
//! arguments and bindings as declared, unacknowledged messages, connections by name.

use std::time::Duration;

use serde_json::Value;

use crate::poll_until;

/// Runs `rabbitmqctl` (as on the machine the broker runs on) with `args` and returns what it
/// printed; panics, naming the command and its error output, if it cannot run or fails.
/// Blocking: the helpers below call it from `spawn_blocking`.
///
/// ```no_run
/// let users = test_brokers::rabbitmq::rabbitmqctl(&["list_users", "-q"]);
/// assert!(users.contains("guest"));
/// ```
pub fn rabbitmqctl(args: &[&str]) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `rabbitmqctl args` as JSON rows (`--formatter json` is added), off the runtime's threads.
async fn rows(args: Vec<String>) -> Vec<Value> {
    tokio::task::spawn_blocking(move || {
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        args.extend(["--formatter", "json"]);
        let listing = rabbitmqctl(&args);
        let rows: Value = serde_json::from_str(&listing)
            .unwrap_or_else(|e| panic!("rabbitmqctl {args:?} printed no JSON ({e}): {listing}"));
        rows.as_array().cloned().unwrap_or_default()
    })
    .await
    .expect("rabbitmqctl's thread")
}

/// Closes, from the broker's side, every connection whose client-provided name is `name`.
/// Returns how many were closed.
pub async fn close_connection(name: &str) -> usize {
    let needle = format!("{{\"connection_name\",\"{name}\"}}");
    tokio::task::spawn_blocking(move || {
        // The table form prints pids in the full syntax close_connection accepts.
        let listing = rabbitmqctl(&["list_connections", "-q", "pid", "client_properties"]);
        let mut closed = 0;
        for line in listing.lines().filter(|l| l.contains(&needle)) {
            let pid = line.split('\t').next().unwrap_or_default();
            rabbitmqctl(&["close_connection", pid, "test: forced close"]);
            closed += 1;
        }
        if closed == 0 {
            eprintln!("no connection named {needle} in:\n{listing}");
        }
        closed
    })
    .await
    .expect("rabbitmqctl's thread")
}

/// `rabbitmqctl list_queues` rows for queues whose names start with `prefix`: name,
/// arguments (as JSON), durable, type.
pub async fn list_queues(prefix: &str) -> Vec<Value> {
    list_queues_with(prefix, &["arguments", "durable", "type"]).await
}

/// `rabbitmqctl list_queues` rows with the name and these columns, for queues whose names
/// start with `prefix`.
///
/// ```no_run
/// # async fn f() {
/// let rows = test_brokers::rabbitmq::list_queues_with("orders", &["messages_ready"]).await;
/// for row in rows {
///     println!("{}: {}", row["name"], row["messages_ready"]);
/// }
/// # }
/// ```
pub async fn list_queues_with(prefix: &str, columns: &[&str]) -> Vec<Value> {
    let mut args: Vec<String> = ["list_queues", "name"].map(String::from).to_vec();
    args.extend(columns.iter().map(|c| (*c).to_owned()));
    let mut rows = rows(args).await;
    rows.retain(|r| r["name"].as_str().is_some_and(|n| n.starts_with(prefix)));
    rows
}

/// Ready and unacknowledged messages of `queue`, as the broker counts them: unlike a passive
/// declare, this sees a delivery whose ack never came. Panics if there is no such queue.
pub async fn ready_and_unacked(queue: &str) -> (u64, u64) {
    let rows = list_queues_with(queue, &["messages_ready", "messages_unacknowledged"]).await;
    let row = rows
        .iter()
        .find(|r| r["name"] == queue)
        .unwrap_or_else(|| panic!("no queue {queue} in {rows:?}"));
    let count = |column: &str| {
        row[column]
            .as_u64()
            .unwrap_or_else(|| panic!("no {column} for {queue} in {row}"))
    };
    (count("messages_ready"), count("messages_unacknowledged"))
}

/// [`ready_and_unacked`] once nothing of `queue` is unacknowledged, or after 5 s: a closed
/// channel's deliveries go back to the queue a moment after the close returns.
pub async fn ready_and_unacked_settled(queue: &str) -> (u64, u64) {
    let (within, every) = (Duration::from_secs(5), Duration::from_millis(100));
    poll_until(within, every, || ready_and_unacked(queue), |c| c.1 == 0).await
}

/// `rabbitmqctl list_bindings` rows (source, destination, routing key) whose source starts
/// with `prefix`, sorted.
pub async fn list_bindings(prefix: &str) -> Vec<(String, String, String)> {
    let columns = ["source_name", "destination_name", "routing_key"];
    let mut args = vec!["list_bindings".to_owned()];
    args.extend(columns.map(String::from));
    let text = |row: &Value, column: &str| row[column].as_str().unwrap_or_default().to_owned();
    let mut bindings: Vec<_> = rows(args)
        .await
        .iter()
        .filter(|r| {
            r["source_name"]
                .as_str()
                .is_some_and(|n| n.starts_with(prefix))
        })
        .map(|r| {
            (
                text(r, columns[0]),
                text(r, columns[1]),
                text(r, columns[2]),
            )
        })
        .collect();
    bindings.sort();
    bindings
}
