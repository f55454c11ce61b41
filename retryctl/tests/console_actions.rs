//! `retryctl serve`'s replays and purges as a boundary, against the local broker: they take
//! exactly the messages the operator saw and confirmed (however many more arrive, whatever
//! their ids), only JSON `true` confirms, a list's whole filter reaches "all that match",
//! rates are bounded and a running replay can be cancelled, and parking queues holding
//! messages lapin cannot read are walked, listed and purged like any other.

#[path = "common/cli.rs"]
mod cli;
mod common;
#[path = "common/console.rs"]
mod console;

use std::time::{Duration, Instant};

use console::{Console, Parked, TOKEN, hidden};
use serde_json::Value;
use test_brokers::authority;
use test_brokers::rabbitmq::{RawProperties, RawPublisher, RawTable};

/// A work queue of its own with `messages` parked; `None` without a broker.
async fn queue_with(prefix: &str, messages: Vec<Parked<'_>>) -> Option<(String, common::Cleanup)> {
    let config = common::broker(prefix).await?;
    Some(console::parked_queue(&config, prefix, messages).await)
}

/// `n` messages of one failure group, ids `{prefix}-0`...
fn group(prefix: &str, n: usize) -> Vec<Parked<'static>> {
    (0..n)
        .map(|i| {
            let id: &'static str = Box::leak(format!("{prefix}-{i}").into_boxed_str());
            let error: &'static str = Box::leak(format!("order {i} not found").into_boxed_str());
            Parked::new(id, "permanent", error)
        })
        .collect()
}

/// A form POST with the bearer token (no CSRF token needed).
fn form(console: &Console, path: &str, body: &str) -> console::Response {
    let auth = format!("Bearer {TOKEN}");
    console.request(
        "POST",
        path,
        &[
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        body,
    )
}

/// A page's HTML, with the bearer token.
fn html(console: &Console, path: &str) -> String {
    let auth = format!("Bearer {TOKEN}");
    let r = console.request("GET", path, &[("Authorization", auth.as_str())], "");
    assert_eq!(r.status, 200, "GET {path}: {r:?}");
    r.body
}

/// Waits for the job a form POST was redirected to, and returns its JSON.
fn job_of(console: &Console, r: &console::Response) -> Value {
    assert_eq!(r.status, 303, "{r:?}");
    let location = r.header("location").expect("a redirect");
    let id = location.strip_prefix("/jobs/").expect("to a job");
    console.job_done(&format!("/api/jobs/{id}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_confirmed_purge_takes_the_messages_confirmed_and_not_those_parked_since() {
    let Some((queue, _cleanup)) = queue_with("console-exact", group("first", 50)).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let path = format!("/api/queues/{queue}/purge");
    let asked = console.api("POST", &path, Some(r#"{"reason": "permanent"}"#));
    assert_eq!(asked.status, 409, "{asked:?}");
    let asked = asked.json();
    assert_eq!(asked["would_purge"], 50, "{asked}");
    let selection = asked["selection"].as_str().unwrap().to_owned();

    // 70 more of the same group arrive before the operator confirms, and the index is read
    // again: they match the filter, but the operator never saw them.
    let (_conn, ch) = common::raw().await;
    console::park(&ch, &queue, &parking, group("later", 70)).await;
    assert_eq!(console.reindex(&queue)["parked"], 120);

    let body = format!(r#"{{"selection": "{selection}", "confirm": true}}"#);
    let job = console.act(&queue, "purge", &body);
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(job["selected"], 50, "{job}");
    assert_eq!(job["report"]["purged"], 50, "{job}");
    assert_eq!(console.reindex(&queue)["parked"], 70);

    // A selection that is not the console's is refused, and nothing is purged.
    let r = console.api(
        "POST",
        &path,
        Some(r#"{"selection": "0123456789abcdef0123456789abcdef", "confirm": true}"#),
    );
    assert_eq!(r.status, 410, "{r:?}");
    assert!(r.body.contains("expired"), "{r:?}");

    // What is left is what arrived after the confirmation was asked for.
    drop(console);
    assert_eq!(common::ready_and_unacked_settled(&parking).await, (70, 0));
    let mut ids = Vec::new();
    while let Some(got) = common::get(&ch, &parking).await {
        ids.push(got.message_id.unwrap_or_default());
    }
    assert_eq!(ids.len(), 70);
    assert!(
        ids.iter().all(|id| id.starts_with("later-")),
        "a message the operator never saw was purged: {ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_purge_of_one_message_takes_it_alone_when_its_id_repeats() {
    let mut twins = vec![
        Parked::new("twin", "permanent", "first failure"),
        Parked::new("twin", "permanent", "second failure"),
    ];
    twins[1].body = b"{\"comment\":\"the other twin\"}";
    let Some((queue, _cleanup)) = queue_with("console-twins", twins).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);

    // The message page shows both; each one's purge button names its key.
    let page = html(&console, &format!("/q/{queue}/message?id=twin"));
    let key = hidden(&page, "key").expect("the first twin's purge form names its key");
    let twins = console.get_json(&format!("/api/queues/{queue}/message?id=twin"));
    assert_eq!(twins.as_array().unwrap().len(), 2);
    assert_eq!(twins[0]["key"], key.as_str());
    assert_ne!(twins[1]["key"], key.as_str());

    // Its purge asks for a confirmation of 1 message, then purges that one only.
    let r = form(
        &console,
        &format!("/q/{queue}/purge"),
        &format!("key={key}"),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert!(r.body.contains("id=\"confirm-count\">1<"), "{}", r.body);
    let selection = hidden(&r.body, "selection").unwrap();
    assert_eq!(
        console::held(&parking).await,
        2,
        "nothing before the confirmation"
    );
    let r = form(
        &console,
        &format!("/q/{queue}/purge"),
        &format!("selection={selection}&confirm=yes"),
    );
    let job = job_of(&console, &r);
    assert_eq!(job["report"]["purged"], 1, "{job}");
    console.reindex(&queue);
    drop(console);
    common::ready_and_unacked_settled(&parking).await;
    let (_conn, ch) = common::raw().await;
    let left = common::get(&ch, &parking)
        .await
        .expect("the other twin stays");
    assert_eq!(left.message_id.as_deref(), Some("twin"));
    assert_eq!(left.body, b"{\"comment\":\"the other twin\"}");
    assert!(common::get(&ch, &parking).await.is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_all_that_match_carries_the_lists_whole_filter() {
    let mut messages = group("order", 12);
    messages.extend((0..3).map(|_| Parked::new("order-2", "attempts-exhausted", "db timeout")));
    let Some((queue, _cleanup)) = queue_with("console-filter", messages).await else {
        return;
    };
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let page = html(
        &console,
        &format!("/q/{queue}/messages?ids=order-2&reason=permanent"),
    );
    assert!(page.contains("id=\"matched\">1<"), "{page}");
    // The replay form of "all that match" is the last form on the page.
    let replay_form = &page[page.rfind("class=\"replay\" action=").unwrap()..];
    assert_eq!(hidden(replay_form, "ids").as_deref(), Some("order-2"));
    assert_eq!(hidden(replay_form, "reason").as_deref(), Some("permanent"));
    let generation = hidden(replay_form, "generation").unwrap();
    // Its dry run, posted as the page would: 1 message, as the list said.
    let r = form(
        &console,
        &format!("/q/{queue}/replay"),
        &format!("ids=order-2&reason=permanent&generation={generation}&dry_run=1"),
    );
    let job = job_of(&console, &r);
    assert_eq!(job["report"]["matched"], 1, "{job}");
}

#[tokio::test(flavor = "multi_thread")]
async fn only_json_true_confirms_a_purge() {
    let Some((queue, _cleanup)) = queue_with("console-confirm", group("c", 3)).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let path = format!("/api/queues/{queue}/purge");
    for confirm in [
        r#""false""#,
        "0",
        r#""no""#,
        r#""yes""#,
        "false",
        "1",
        "null",
    ] {
        let body = format!(r#"{{"all": true, "confirm": {confirm}}}"#);
        let r = console.api("POST", &path, Some(&body));
        assert_eq!(r.status, 400, "confirm {confirm}: {r:?}");
        assert!(r.body.contains("confirm"), "{r:?}");
        assert_eq!(console::held(&parking).await, 3, "confirm {confirm} purged");
    }
    let job = console.act(&queue, "purge", r#"{"all": true, "confirm": true}"#);
    assert_eq!(job["report"]["purged"], 3, "{job}");
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_rates_are_bounded_and_a_running_replay_can_be_cancelled() {
    let Some((queue, _cleanup)) = queue_with("console-cancel", group("slow", 5)).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let path = format!("/api/queues/{queue}/replay");
    for rate in ["1e-300", "0.001", "0", "-1", "1e9", "\"fast\""] {
        let body = format!(r#"{{"all": true, "rate": {rate}}}"#);
        let r = console.api("POST", &path, Some(&body));
        assert_eq!(r.status, 400, "rate {rate}: {r:?}");
        assert!(r.body.contains("rate"), "{r:?}");
    }
    // At the slowest rate, the first message goes at once and the next 10 s later.
    let r = console.api("POST", &path, Some(r#"{"all": true, "rate": 0.1}"#));
    assert_eq!(r.status, 202, "{r:?}");
    let url = r.json()["url"].as_str().unwrap().to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    while console.get_json(&url)["report"]["replayed"] != 1 {
        assert!(Instant::now() < deadline, "{}", console.get_json(&url));
        std::thread::sleep(Duration::from_millis(50));
    }
    let cancel = console.api("POST", &format!("{url}/cancel"), None);
    assert_eq!(cancel.status, 202, "{cancel:?}");
    let job = console.job_done(&url);
    assert_eq!(job["cancelled"], true, "{job}");
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(job["report"]["replayed"], 1, "{job}");
    assert!(
        job["summary"].as_str().unwrap().starts_with("cancelled: "),
        "{job}"
    );
    assert_eq!(console::held(&queue).await, 1);
    assert_eq!(console::held(&parking).await, 4);
    // An ended job cannot be cancelled.
    let again = console.api("POST", &format!("{url}/cancel"), None);
    assert_eq!(again.status, 409, "{again:?}");
}

/// Parking queues holding messages lapin cannot read (an id and a header name that are not
/// UTF-8, headers nested 200 and 15,000 deep): the console walks past them and lists them, a
/// replay of everything leaves them and goes on, and one is purged by its key; `retryctl
/// parked list` lists them.
#[tokio::test(flavor = "multi_thread")]
async fn messages_lapin_cannot_read_are_listed_passed_over_by_replays_and_purged() {
    let Some((queue, _cleanup)) = queue_with("console-hostile", group("good", 4)).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let hostile = [
        RawProperties::new().message_id(b"bad-\xff\xfe-id"),
        RawProperties::new()
            .headers(&RawTable::new().entry(b"na\xffme", &RawTable::long_string(b"v"))),
        RawProperties::new()
            .headers(&RawTable::new().entry(b"deep", &RawTable::nested_tables(200))),
        RawProperties::new()
            .headers(&RawTable::new().entry(b"deeper", &RawTable::nested_tables(15_000))),
    ];
    let mut publisher =
        RawPublisher::connect(&authority(&common::amqp_url()), "guest", "guest", "/").unwrap();
    for (i, properties) in hostile.iter().enumerate() {
        publisher
            .publish(
                b"",
                parking.as_bytes(),
                &properties.encode(),
                format!("hostile {i}").as_bytes(),
            )
            .unwrap();
    }
    publisher.close().unwrap();
    let (_conn, ch) = common::raw().await;
    console::park(&ch, &queue, &parking, group("after", 2)).await;

    let console = Console::start(&[&queue], &[]);
    let q = console.index_after(&queue, 0);
    assert_eq!(q["index"]["error"], Value::Null, "{q}");
    assert_eq!(q["parked"], 10, "{q}");
    let listed = console.get_json(&format!("/api/queues/{queue}/messages?per_page=100"));
    let messages = listed["messages"].as_array().unwrap();
    let unread: Vec<&Value> = messages.iter().filter(|m| m["id"].is_null()).collect();
    assert_eq!(unread.len(), 4, "{listed}");
    // Each one's page shows why it could not be read, and its bytes.
    let key = unread[2]["key"].as_str().unwrap();
    let shown = console.get_json(&format!("/api/queues/{queue}/message?key={key}"));
    let headers = &shown[0]["headers"];
    assert!(
        headers["x-amqp091-undecodable"]
            .as_str()
            .unwrap()
            .contains("deeper than 64 levels"),
        "{shown}"
    );
    assert!(!headers["x-amqp091-raw-properties"].is_null(), "{shown}");
    assert_eq!(shown[0]["body"]["text"], "hostile 2");
    // The page renders.
    assert!(html(&console, &format!("/q/{queue}/message?key={key}")).contains("hostile 2"));

    // A replay of everything replays the six it can copy, leaves the four it cannot, and
    // goes on past each of them.
    let job = console.act(&queue, "replay", r#"{"all": true}"#);
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(
        (&job["report"]["replayed"], &job["report"]["uncopyable"]),
        (&6.into(), &4.into()),
        "{job}"
    );
    assert!(
        job["summary"]
            .as_str()
            .unwrap()
            .contains("4 of them could not be copied"),
        "{job}"
    );
    assert_eq!(console::held(&queue).await, 6);
    assert_eq!(console.reindex(&queue)["parked"], 4);

    // Purged by its key: that one goes, the other three stay.
    let job = console.act(
        &queue,
        "purge",
        &format!(r#"{{"key": "{key}", "confirm": true}}"#),
    );
    assert_eq!(
        (job["error"].clone(), job["report"]["purged"].clone()),
        (Value::Null, 1.into()),
        "{job}"
    );
    assert_eq!(console.reindex(&queue)["parked"], 3);

    // The CLI lists them too, and ends. The console is stopped first: the purge job's own
    // refresh may start one more walk after the reindex, and a walk holds the queue's
    // messages unacknowledged, where the CLI's walk cannot see them.
    drop(console);
    assert_eq!(common::ready_and_unacked_settled(&parking).await, (3, 0));
    let run = cli::retryctl(&["parked", "list", &queue, "--json"]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.stdout.lines().count(), 3, "{run:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_from_a_page_read_before_the_index_changed_asks_first() {
    let Some((queue, _cleanup)) = queue_with("console-stale", group("s", 3)).await else {
        return;
    };
    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let page = html(&console, &format!("/q/{queue}/messages"));
    let seen = hidden(&page, "generation").unwrap();
    // Two more are parked and the index read again before the button is pressed.
    let (_conn, ch) = common::raw().await;
    console::park(&ch, &queue, &parking, group("t", 2)).await;
    console.reindex(&queue);
    let r = form(
        &console,
        &format!("/q/{queue}/replay"),
        &format!("all=1&generation={seen}"),
    );
    assert_eq!(r.status, 200, "a confirmation, not a replay: {r:?}");
    assert!(r.body.contains("id=\"changed\""), "{}", r.body);
    assert!(r.body.contains("id=\"confirm-count\">5<"), "{}", r.body);
    assert_eq!(console::held(&queue).await, 0, "nothing replayed yet");
    let selection = hidden(&r.body, "selection").unwrap();
    let r = form(
        &console,
        &format!("/q/{queue}/replay"),
        &format!("selection={selection}&confirm=yes"),
    );
    let job = job_of(&console, &r);
    assert_eq!(job["report"]["replayed"], 5, "{job}");
}
