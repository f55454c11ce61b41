//! `retryctl serve` over HTTP, against the local broker: the JSON API and its answers, the
//! token, the session cookie and CSRF refusals, replays and purges checked on the broker,
//! and no password anywhere. The browser tests are in `console_browser.rs`.

mod common;
#[path = "common/console.rs"]
mod console;

use std::process::Command;

use console::{Console, Parked, TOKEN};
use serde_json::Value;

/// A work queue of its own with `messages` parked; `None` without a broker.
async fn queue_with(prefix: &str, messages: Vec<Parked<'_>>) -> Option<(String, common::Cleanup)> {
    let config = common::broker(prefix).await?;
    Some(console::parked_queue(&config, prefix, messages).await)
}

fn ids(messages: &Value) -> Vec<&str> {
    messages["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_lists_groups_and_messages_from_the_index() {
    let Some((queue, _cleanup)) = queue_with(
        "console-api",
        vec![
            Parked {
                minutes_ago: 30,
                ..Parked::new("a-1", "permanent", "order 17 not found")
            },
            Parked {
                minutes_ago: 20,
                ..Parked::new("a-2", "permanent", "order 4242 not found")
            },
            Parked {
                minutes_ago: 10,
                ..Parked::new("a-3", "attempts-exhausted", "DB timeout after 30000 ms")
            },
            Parked {
                minutes_ago: 40,
                body: &[0xff, 0, 1],
                ..Parked::new("a-4", "crash-loop", "")
            },
        ],
    )
    .await
    else {
        return;
    };
    let console = Console::start(&[&queue], &[]);
    let q = console.index_after(&queue, 0);
    assert_eq!(q["parked"], 4, "{q}");
    assert_eq!(q["index"]["kept"], 4);
    assert_eq!(q["by_reason"]["permanent"], 2);
    assert_eq!(q["depths"][0]["queue"], queue.as_str());
    assert_eq!(q["depths"][0]["ready"], 0);
    assert!(q["as_of"].is_string());
    // The two "order N not found" fold into one group, the largest.
    let group = &q["groups"][0];
    assert_eq!(
        (group["count"].as_u64(), group["error"].as_str()),
        (Some(2), Some("order <n> not found"))
    );
    assert_eq!(group["reason"], "permanent");

    let list = console.get_json(&format!(
        "/api/queues/{queue}/messages?sort=parked_at&dir=desc"
    ));
    assert_eq!(ids(&list), ["a-3", "a-2", "a-1", "a-4"]);
    let list = console.get_json(&format!("/api/queues/{queue}/messages?error=TIMEOUT"));
    assert_eq!(ids(&list), ["a-3"]);
    let list = console.get_json(&format!("/api/queues/{queue}/messages?after=25m"));
    assert_eq!(ids(&list), ["a-2", "a-3"]);
    let list = console.get_json(&format!("/api/queues/{queue}/messages?per_page=1&page=2"));
    assert_eq!(
        (ids(&list), list["matched"].as_u64()),
        (vec!["a-2"], Some(4))
    );

    let message = console.get_json(&format!("/api/queues/{queue}/message?id=a-4"));
    assert_eq!(message[0]["body"]["kind"], "binary, in hex");
    assert_eq!(message[0]["headers"]["x-retry-reason"], "crash-loop");
    let message = console.get_json(&format!("/api/queues/{queue}/message?id=a-1"));
    assert_eq!(message[0]["body"]["kind"], "JSON");
    assert_eq!(message[0]["properties"]["content_type"], "application/json");

    // Bad input is refused, naming the culprit.
    for (path, status, says) in [
        (
            format!("/api/queues/{queue}/messages?reason=crashed"),
            400,
            "crashed",
        ),
        (
            format!("/api/queues/{queue}/messages?sort=size"),
            400,
            "size",
        ),
        (
            format!("/api/queues/{queue}/messages?per_page=0"),
            400,
            "per_page",
        ),
        (
            format!("/api/queues/{queue}/messages?after=yesterday"),
            400,
            "yesterday",
        ),
        (
            format!("/api/queues/{queue}/message?id=nope"),
            404,
            "no parked message",
        ),
        ("/api/queues/not-shown".to_owned(), 404, "not-shown"),
    ] {
        let r = console.api("GET", &path, None);
        assert_eq!(r.status, status, "{path}: {r:?}");
        assert!(
            r.json()["error"].as_str().unwrap().contains(says),
            "{path}: {r:?}"
        );
    }
    let r = console.api("POST", &format!("/api/queues/{queue}/replay"), Some("{}"));
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("nothing selected"), "{r:?}");
    let r = console.api(
        "POST",
        &format!("/api/queues/{queue}/replay"),
        Some(r#"{"all": true, "rate": -1}"#),
    );
    assert_eq!(r.status, 400, "{r:?}");
    assert!(r.body.contains("rate"), "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn replays_and_purges_act_on_the_queue_and_report_as_the_cli_does() {
    let Some((queue, _cleanup)) = queue_with(
        "console-act",
        vec![
            Parked::new("r-1", "permanent", "order 1 not found"),
            Parked::new("r-2", "permanent", "order 2 not found"),
            Parked::new("r-3", "attempts-exhausted", "db timeout"),
            Parked::new("r-4", "attempts-exhausted", "db timeout"),
            Parked::new("r-5", "crash-loop", "killed"),
        ],
    )
    .await
    else {
        return;
    };
    let parking = format!("{queue}.parking");
    let (_conn, ch) = common::raw().await;
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);

    // A dry run counts and takes nothing.
    let job = console.act(
        &queue,
        "replay",
        r#"{"reason": "permanent", "group": "order <n> not found", "dry_run": true}"#,
    );
    assert_eq!(job["report"]["matched"], 2, "{job}");
    assert_eq!(job["report"]["replayed"], 0);
    assert_eq!(console::held(&parking).await, 5);

    // The group is replayed: copies confirmed into the work queue, originals gone.
    let job = console.act(
        &queue,
        "replay",
        r#"{"reason": "permanent", "group": "order <n> not found"}"#,
    );
    assert_eq!(job["error"], Value::Null, "{job}");
    assert_eq!(job["report"]["replayed"], 2);
    assert_eq!(job["report"]["left"], 3);
    assert_eq!(
        job["summary"],
        format!("replayed 2 to {queue}, left 3 in {parking}")
    );
    let mut replayed = Vec::new();
    while let Some(got) = common::get(&ch, &queue).await {
        replayed.push(got);
    }
    let mut replayed_ids: Vec<_> = replayed.iter().map(|g| g.message_id.clone()).collect();
    replayed_ids.sort();
    assert_eq!(
        replayed_ids,
        [Some("r-1".to_owned()), Some("r-2".to_owned())]
    );
    assert_eq!(console::held(&parking).await, 3);

    // A purge without "confirm" says how many it would take, and takes none.
    let r = console.api(
        "POST",
        &format!("/api/queues/{queue}/purge"),
        Some(r#"{"error": "timeout"}"#),
    );
    assert_eq!(r.status, 409, "{r:?}");
    let q = console.index_after(&queue, 1);
    assert_eq!(
        q["parked"], 3,
        "the index is walked again after a replay: {q}"
    );
    let r = console.api(
        "POST",
        &format!("/api/queues/{queue}/purge"),
        Some(r#"{"error": "timeout"}"#),
    );
    assert_eq!(r.json()["would_purge"], 2, "{r:?}");
    assert_eq!(console::held(&parking).await, 3);
    let job = console.act(&queue, "purge", r#"{"error": "timeout", "confirm": true}"#);
    assert_eq!(
        job["summary"],
        format!("purged 2, left 1 in {parking}"),
        "{job}"
    );
    assert_eq!(console::held(&parking).await, 1);
    assert_eq!(console::held(&queue).await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_token_the_session_cookie_and_csrf_guard_every_page_and_action() {
    let Some((queue, _cleanup)) = queue_with(
        "console-auth",
        vec![Parked::new("t-1", "permanent", "boom")],
    )
    .await
    else {
        return;
    };

    let parking = format!("{queue}.parking");
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    let replay_path = format!("/api/queues/{queue}/replay");

    // Without the token: the API says 401, a page sends to /login, an action is refused.
    let r = console.request("GET", &format!("/api/queues/{queue}"), &[], "");
    assert_eq!(
        (r.status, r.header("www-authenticate")),
        (401, Some("Bearer")),
        "{r:?}"
    );
    let r = console.request("GET", "/", &[], "");
    assert_eq!(
        (r.status, r.header("location")),
        (303, Some("/login")),
        "{r:?}"
    );
    let r = console.request(
        "POST",
        &format!("/q/{queue}/replay"),
        &[("Content-Type", "application/x-www-form-urlencoded")],
        "all=1",
    );
    assert_eq!(r.status, 401, "{r:?}");
    let wrong = "Bearer not-the-token-at-all-0000";
    let r = console.request(
        "POST",
        &replay_path,
        &[("Authorization", wrong)],
        r#"{"all":true}"#,
    );
    assert_eq!(r.status, 401, "{r:?}");
    // Every answer carries the policy that forbids script, and forbids framing.
    for path in ["/", "/login", "/static/console.css", "/api/queues"] {
        let r = console.request("GET", path, &[], "");
        let csp = r.header("content-security-policy").unwrap_or_default();
        assert!(
            csp.contains("script-src 'none'") && csp.contains("frame-ancestors 'none'"),
            "{path}: {r:?}"
        );
        assert_eq!(
            r.header("x-content-type-options"),
            Some("nosniff"),
            "{path}"
        );
    }

    // Logging in: a wrong token is refused; the right one sets the session cookie.
    let form = [("Content-Type", "application/x-www-form-urlencoded")];
    let r = console.request("POST", "/login", &form, "token=wrong");
    assert_eq!(r.status, 401, "{r:?}");
    assert!(r.header("set-cookie").is_none());
    let r = console.request("POST", "/login", &form, &format!("token={TOKEN}"));
    assert_eq!(r.status, 303, "{r:?}");
    let set_cookie = r.header("set-cookie").unwrap().to_owned();
    assert!(
        set_cookie.contains("HttpOnly") && set_cookie.contains("SameSite=Strict"),
        "{set_cookie}"
    );
    assert!(
        !set_cookie.contains(TOKEN),
        "the cookie does not hold the token: {set_cookie}"
    );
    let cookie = set_cookie.split(';').next().unwrap().to_owned();

    // The cookie opens pages; a page's forms carry the CSRF token.
    let r = console.request(
        "GET",
        &format!("/q/{queue}/messages"),
        &[("Cookie", &cookie)],
        "",
    );
    assert_eq!(r.status, 200, "{r:?}");
    let csrf = console::hidden(&r.body, "csrf").expect("a CSRF field");
    // And the walk whose index they were drawn from.
    let generation = console::hidden(&r.body, "generation").expect("a generation field");

    // A POST with the cookie and no CSRF token, or a wrong one, is refused; so is one
    // whose Origin is another site; nothing is replayed.
    let with_cookie = [
        ("Cookie", cookie.as_str()),
        ("Content-Type", "application/x-www-form-urlencoded"),
    ];
    for body in ["ids=t-1".to_owned(), "ids=t-1&csrf=0000".to_owned()] {
        let r = console.request("POST", &format!("/q/{queue}/replay"), &with_cookie, &body);
        assert_eq!(r.status, 403, "{body}: {r:?}");
    }
    let mut cross_site = with_cookie.to_vec();
    cross_site.push(("Origin", "http://evil.example"));
    let r = console.request(
        "POST",
        &format!("/q/{queue}/replay"),
        &cross_site,
        &format!("ids=t-1&csrf={csrf}"),
    );
    assert_eq!(r.status, 403, "{r:?}");
    let r = console.request(
        "POST",
        &replay_path,
        &[("Cookie", &cookie)],
        r#"{"ids":["t-1"]}"#,
    );
    assert_eq!(
        r.status, 403,
        "the API with a cookie needs X-CSRF-Token: {r:?}"
    );
    assert_eq!(console::held(&parking).await, 1);
    assert_eq!(console::held(&queue).await, 0);

    // With the CSRF token the same form replays.
    let r = console.request(
        "POST",
        &format!("/q/{queue}/replay"),
        &with_cookie,
        &format!("ids=t-1&csrf={csrf}&generation={generation}"),
    );
    assert_eq!(r.status, 303, "{r:?}");
    let job = r
        .header("location")
        .unwrap()
        .replace("/jobs/", "/api/jobs/");
    assert_eq!(console.job_done(&job)["report"]["replayed"], 1);
    assert_eq!(console::held(&queue).await, 1);
}

#[test]
fn a_console_on_another_address_or_with_a_short_token_is_refused() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_retryctl"))
            .args(args)
            .env_remove("RETRYCTL_TOKEN")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&["serve", "q", "--listen", "0.0.0.0:0"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("0.0.0.0:0 is not a loopback address") && err.contains("--token"),
        "{err}"
    );
    // A token on the command line is refused whatever it is; the shapes of a token are
    // checked in console_boundary.rs.
    let (code, err) = run(&["serve", "q", "--token", "short"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("RETRYCTL_TOKEN"), "{err}");
    let (code, err) = run(&["serve", "q", "--index-memory", "12 parsecs"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("parsecs"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn no_password_reaches_a_page_an_api_answer_or_the_log() {
    let Some((queue, _cleanup)) = queue_with(
        "console-secret",
        vec![Parked::new("s-1", "permanent", "boom")],
    )
    .await
    else {
        return;
    };
    // A user of its own, whose password is nowhere else.
    let user = common::unique("console-user");
    let password = format!("pw-{}", common::unique("secret"));
    common::rabbitmqctl(&["add_user", &user, &password]);
    common::rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]);
    struct DropUser(String);
    impl Drop for DropUser {
        fn drop(&mut self) {
            common::rabbitmqctl(&["delete_user", &self.0]);
        }
    }
    let _user = DropUser(user.clone());
    let url = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    let mut child = Command::new(env!("CARGO_BIN_EXE_retryctl"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            &queue,
            "nope-not-a-queue",
        ])
        .env("AMQP_URL", &url)
        .env("RETRYCTL_TOKEN", TOKEN)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut first).unwrap();
    let addr = first
        .split("http://")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let get = |path: &str| {
        console::request(
            &addr,
            "GET",
            path,
            &[("Authorization", &format!("Bearer {TOKEN}"))],
            "",
        )
    };
    // Wait for both walks (the second queue's fails: it does not exist).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while get("/api/queues")
        .json()
        .as_array()
        .unwrap()
        .iter()
        .any(|q| q["index"]["generation"] == 0)
    {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut seen = String::new();
    for path in [
        "/",
        "/api/queues",
        &format!("/q/{queue}/messages"),
        "/q/nope-not-a-queue",
        &format!("/api/queues/{queue}/message?id=s-1"),
    ] {
        let r = get(path);
        assert_eq!(r.status, 200, "{path}: {r:?}");
        seen.push_str(&r.body);
    }
    assert!(
        seen.contains(&format!("amqp://{user}:****@127.0.0.1:5672")),
        "the URL is shown, masked"
    );
    assert!(
        seen.contains("nope-not-a-queue.parking"),
        "the failed walk is shown"
    );
    let _ = child.kill();
    let _ = child.wait();
    let mut log = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut log);
    for text in [&seen, &first, &log] {
        assert!(!text.contains(&password), "the password leaked: {text}");
    }
}
