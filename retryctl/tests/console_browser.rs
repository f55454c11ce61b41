//! `retryctl serve` in a real browser: Debian's chromium, headless, driven through
//! chromedriver (WebDriver) with fantoccini, against a console on the local broker. An
//! operator's clicks from the overview to a group, a message and its replay, a purge and
//! its confirmation, the refusals without the token and from another site's page, and
//! hostile message content that must stay inert text; each checked on the broker.
//!
//! Without chromium and chromedriver the tests say so and pass, unless `REQUIRE_BROWSER=1`
//! (as `.ci/run` sets), when they fail.

mod common;
#[path = "common/console.rs"]
mod console;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use console::{Console, Parked, TOKEN};
use fantoccini::{Client, ClientBuilder, Locator};
use lapin::types::{AMQPValue, LongString};
use serde_json::{Value, json};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A chromedriver on a port of its own and a headless chromium session, ended when dropped.
struct Browser {
    driver: Child,
    client: Option<Client>,
    profile: std::path::PathBuf,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Browser {
    /// `None` (the test passes, saying why) when chromium or chromedriver is missing and
    /// `REQUIRE_BROWSER` is not set.
    async fn start(test: &str) -> Option<Browser> {
        if !std::path::Path::new(CHROMEDRIVER).exists() || !std::path::Path::new(CHROMIUM).exists()
        {
            let why = format!(
                "{test}: no {CHROMIUM} or {CHROMEDRIVER} (apt-get install chromium chromium-driver)"
            );
            assert!(
                std::env::var("REQUIRE_BROWSER").is_err(),
                "REQUIRE_BROWSER is set: {why}"
            );
            eprintln!("skipped: {why}");
            return None;
        }
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let profile = std::env::temp_dir().join(common::unique("console-chromium"));
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--window-size=1280,1000",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
            .expect("a chromium session");
        Some(Browser {
            driver,
            client: Some(client),
            profile,
        })
    }

    fn c(&self) -> &Client {
        self.client.as_ref().unwrap()
    }

    async fn goto(&self, url: &str) {
        self.c().goto(url).await.unwrap();
    }

    /// Waits for the element `css` on the page (a click's navigation may still be under
    /// way) and returns it.
    async fn find(&self, css: &str) -> fantoccini::elements::Element {
        let found = self
            .c()
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::Css(css))
            .await;
        match found {
            Ok(element) => element,
            Err(e) => panic!("no {css} on {}: {e}", self.path().await),
        }
    }

    async fn click(&self, css: &str) {
        self.find(css).await.click().await.unwrap();
    }

    async fn click_link(&self, text: &str) {
        self.c()
            .wait()
            .at_most(Duration::from_secs(20))
            .for_element(Locator::LinkText(text))
            .await
            .unwrap_or_else(|e| panic!("no link {text:?}: {e}"))
            .click()
            .await
            .unwrap();
    }

    async fn text(&self, css: &str) -> String {
        self.find(css).await.text().await.unwrap()
    }

    /// Waits until the page's path is `path`.
    async fn wait_path(&self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.path().await != path {
            assert!(
                Instant::now() < deadline,
                "never reached {path}: on {}",
                self.path().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn path(&self) -> String {
        self.c().current_url().await.unwrap().path().to_owned()
    }

    /// Runs `script` in the page (WebDriver runs it whatever the page's policy says).
    async fn eval(&self, script: &str) -> Value {
        self.c().execute(script, vec![]).await.unwrap()
    }

    /// Waits until the action's page says it is done (it reloads itself every second
    /// while running), and returns what it says. The state is read in one script, so a
    /// reload between two WebDriver calls cannot leave a stale element; a reload during
    /// the script is read again.
    async fn job_result(&self) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        let read = "const e = document.getElementById('job-state');
                    return e ? [e.className, e.innerText] : null;";
        loop {
            if let Ok(Value::Array(state)) = self.c().execute(read, vec![]).await
                && state[0] != "running"
            {
                return state[1].as_str().unwrap_or_default().to_owned();
            }
            assert!(Instant::now() < deadline, "the action did not end");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Logs in through the login form.
    async fn log_in(&self, console: &Console) {
        self.goto(&format!("{}/login", console.base)).await;
        self.find("input[name=token]")
            .await
            .send_keys(TOKEN)
            .await
            .unwrap();
        self.click("form.login button").await;
        self.wait_path("/").await;
    }

    async fn screenshot(&self, path: &std::path::Path) {
        let png = self.c().screenshot().await.unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // Closing the session ends chromium; the driver goes after it.
            let _ = futures_close(client);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Ends a session from `Drop`, on a thread of its own (the test's runtime may be ending).
fn futures_close(client: Client) -> std::thread::Result<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), client.close()).await
        });
    })
    .join()
}

/// A work queue of its own with `messages` parked, a console showing it with its first
/// index built, and a browser; `None` when there is no broker or no browser.
async fn setup(
    prefix: &str,
    messages: Vec<Parked<'_>>,
) -> Option<(String, common::Cleanup, Console, Browser)> {
    let config = common::broker(prefix).await?;
    let browser = Browser::start(prefix).await?;
    let (queue, cleanup) = console::parked_queue(&config, prefix, messages).await;
    let console = Console::start(&[&queue], &[]);
    console.index_after(&queue, 0);
    Some((queue, cleanup, console, browser))
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_goes_from_the_overview_to_a_group_to_a_message_and_replays_it() {
    let Some((queue, _cleanup, console, browser)) = setup(
        "console-click",
        vec![
            Parked::new("c-1", "permanent", "order 1 not found"),
            Parked::new("c-2", "permanent", "order 22 not found"),
            Parked::new("c-3", "attempts-exhausted", "db timeout"),
        ],
    )
    .await
    else {
        return;
    };
    let (_conn, ch) = common::raw().await;
    let parking = format!("{queue}.parking");
    browser.log_in(&console).await;
    assert_eq!(browser.text("h1").await, "Parking lots");
    assert!(browser.text("section.queue h2").await.contains("3 parked"));

    browser.click_link("order <n> not found").await;
    assert_eq!(browser.text("#group-count").await, "2");
    // The group's example, then its message page.
    browser.click("table.facts a").await;
    let id = browser.text("h1.id").await;
    assert_eq!(id, "c-1");
    assert!(
        browser
            .text("table.headers")
            .await
            .contains("order 1 not found")
    );
    browser.click("form.replay button.replay").await;
    assert_eq!(
        browser.job_result().await,
        format!("replayed 1 to {queue}, left 2 in {parking}")
    );

    // On the broker: the copy is in the work queue with its replay counted, the original
    // gone, the others still parked.
    let copy = common::get(&ch, &queue).await.expect("the replayed copy");
    assert_eq!(copy.message_id.as_deref(), Some("c-1"));
    assert_eq!(
        copy.headers.get("x-retry-replays").and_then(|v| v.as_u64()),
        Some(1)
    );
    assert_eq!(console::held(&queue).await, 0);
    assert_eq!(console::held(&parking).await, 2);
    // The index is walked again after the replay: the overview says so.
    console.index_after(&queue, 1);
    browser.goto(&format!("{}/", console.base)).await;
    assert!(browser.text("section.queue h2").await.contains("2 parked"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_purge_shows_its_count_and_takes_nothing_until_confirmed() {
    let Some((queue, _cleanup, console, browser)) = setup(
        "console-purge",
        vec![
            Parked::new("p-1", "crash-loop", "killed by signal 9"),
            Parked::new("p-2", "crash-loop", "killed by signal 11"),
            Parked::new("p-3", "permanent", "bad input"),
        ],
    )
    .await
    else {
        return;
    };
    let (_conn, ch) = common::raw().await;
    let parking = format!("{queue}.parking");
    browser.log_in(&console).await;
    browser.click_link("killed by signal <n>").await;
    browser.click("form.purge button.purge").await;
    assert_eq!(browser.text("#confirm-count").await, "2");
    assert_eq!(
        console::held(&parking).await,
        3,
        "nothing is purged before the confirmation"
    );
    browser.click("button.purge-confirm").await;
    assert_eq!(
        browser.job_result().await,
        format!("purged 2, left 1 in {parking}")
    );
    assert_eq!(console::held(&parking).await, 1);
    // The purge's walk of the index is over before the queue is read here.
    console.index_after(&queue, 1);
    let left = common::get(&ch, &parking).await.unwrap();
    assert_eq!(left.message_id.as_deref(), Some("p-3"));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_browser_is_refused_without_the_token_and_from_another_sites_page() {
    let Some((queue, _cleanup, console, browser)) = setup(
        "console-refuse",
        vec![Parked::new("x-1", "permanent", "boom")],
    )
    .await
    else {
        return;
    };

    let parking = format!("{queue}.parking");
    // No session: every page sends to the login form; a wrong token is refused.
    browser
        .goto(&format!("{}/q/{queue}/messages", console.base))
        .await;
    browser.wait_path("/login").await;
    browser
        .find("input[name=token]")
        .await
        .send_keys("not-the-token")
        .await
        .unwrap();
    browser.click("form.login button").await;
    assert!(
        browser
            .text("#login-failed")
            .await
            .contains("not the console's token")
    );
    browser.log_in(&console).await;

    // Another site's page (another port) with a form that would purge everything: the
    // browser sends the session cookie, and the console refuses the POST all the same.
    let attacker = TcpListener::bind("127.0.0.1:0").unwrap();
    let attacker_addr = attacker.local_addr().unwrap();
    let form = format!(
        "<!doctype html><form method=\"post\" action=\"{}/q/{queue}/purge\">\
         <input type=\"hidden\" name=\"all\" value=\"1\"><input type=\"hidden\" name=\"confirm\" value=\"yes\">\
         <button id=\"go\" type=\"submit\">win a prize</button></form>",
        console.base
    );
    std::thread::spawn(move || {
        if let Ok((mut stream, _)) = attacker.accept() {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            );
        }
    });
    browser.goto(&format!("http://{attacker_addr}/")).await;
    browser.click("#go").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while browser.c().current_url().await.unwrap().port() == Some(attacker_addr.port()) {
        assert!(Instant::now() < deadline, "the form was not sent");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let page = browser.c().source().await.unwrap();
    assert!(page.contains("refused"), "{page}");
    assert_eq!(console::held(&parking).await, 1, "nothing was purged");
}

/// Parked content that would run or load something if it were not escaped.
const HOSTILE_ID: &str = "<script>alert('id')</script>";
const HOSTILE_ERROR: &str = "\"><img src=x onerror=alert(1)> failed";
const HOSTILE_BODY: &[u8] = b"<script>alert(5)</script><img src=x onerror=alert(6)><iframe src=\"javascript:alert(7)\"></iframe>";

#[tokio::test(flavor = "multi_thread")]
async fn hostile_message_content_renders_as_inert_text() {
    let Some((queue, _cleanup, console, browser)) = setup(
        "console-hostile",
        vec![Parked {
            body: HOSTILE_BODY,
            headers: vec![
                ("link", text("javascript:alert(3)")),
                (
                    "x-note",
                    text("<a href=\"javascript:alert(4)\">click me</a>"),
                ),
                ("x-attr", text("' onmouseover='alert(8)")),
            ],
            ..Parked::new(HOSTILE_ID, "permanent", HOSTILE_ERROR)
        }],
    )
    .await
    else {
        return;
    };
    browser.log_in(&console).await;
    let pages = [
        "/".to_owned(),
        format!("/q/{queue}"),
        format!("/q/{queue}/messages"),
        format!("/q/{queue}/messages?error={}", "%3Cimg"),
    ];
    for path in &pages {
        browser.goto(&format!("{}{path}", console.base)).await;
        inert(&browser, path).await;
    }
    // The group page and the message page, by clicking.
    browser.goto(&format!("{}/q/{queue}", console.base)).await;
    browser.click("table.groups td.err a").await;
    browser.find("table.facts").await;
    inert(&browser, "the group page").await;
    assert_eq!(
        browser.text("h1.err").await,
        "\"><img src=x onerror=alert(<n>)> failed"
    );
    browser.click("table.facts a").await;
    browser.find("article.message").await;
    inert(&browser, "the message page").await;
    // Shown as text, every one.
    let shown = browser.eval("return document.body.innerText").await;
    let shown = shown.as_str().unwrap();
    for text in [
        HOSTILE_ID,
        HOSTILE_ERROR,
        "javascript:alert(3)",
        "<a href=\"javascript:alert(4)\">click me</a>",
        "' onmouseover='alert(8)",
        "<script>alert(5)</script><img src=x onerror=alert(6)>",
    ] {
        assert!(
            shown.contains(text),
            "{text:?} is not shown as text: {shown}"
        );
    }
}

/// No element the hostile content could have made, no event handler attribute, no
/// `javascript:` link, no dialog.
async fn inert(browser: &Browser, page: &str) {
    let found = browser
        .eval(
            "const all = [...document.querySelectorAll('*')];
             return {
               script: document.querySelectorAll('script').length,
               img: document.querySelectorAll('img').length,
               iframe: document.querySelectorAll('iframe').length,
               handlers: all.filter(e => [...e.attributes].some(a => a.name.startsWith('on'))).length,
               js_links: [...document.querySelectorAll('[href],[src],[action]')].filter(e =>
                 ['href','src','action'].some(n => (e.getAttribute(n) || '').trim().toLowerCase().startsWith('javascript:'))).length,
             };",
        )
        .await;
    assert_eq!(
        found,
        json!({"script": 0, "img": 0, "iframe": 0, "handlers": 0, "js_links": 0}),
        "{page}: elements made from message content"
    );
    assert!(
        browser.c().get_alert_text().await.is_err(),
        "{page}: a dialog opened"
    );
}

/// Writes the guide's screenshots (`docs/img/console-overview.png`,
/// `docs/img/console-group.png`) from a console showing a realistic parking lot:
/// `CONSOLE_SCREENSHOTS=docs/img cargo test -p retryctl --test console_browser -- --ignored`.
#[tokio::test(flavor = "multi_thread")]
#[ignore = "writes the guide's screenshots; run with CONSOLE_SCREENSHOTS=DIR"]
async fn screenshots_for_the_guide() {
    let dir = std::path::PathBuf::from(
        std::env::var("CONSOLE_SCREENSHOTS").expect("CONSOLE_SCREENSHOTS=DIR"),
    );
    let errors = [
        (
            "permanent",
            "comment 4711 rejected: body is not valid JSON at line 1 column 17",
            6,
        ),
        (
            "attempts-exhausted",
            "POST https://moderation.internal/v1/check: timeout after 10000 ms",
            23,
        ),
        (
            "attempts-exhausted",
            "connect to 10.20.0.14:5432 refused (postgres)",
            9,
        ),
        (
            "crash-loop",
            "consumer process died 3 times running this message",
            2,
        ),
        (
            "max-elapsed",
            "rate limited by upstream, retry-after 120 s",
            4,
        ),
    ];
    let mut ids = Vec::new();
    let mut texts = Vec::new();
    for (kind, (_, error, n)) in errors.iter().enumerate() {
        for i in 0..*n {
            ids.push(format!("comment-{}", 4000 + kind * 100 + i));
            texts.push(
                error
                    .replace("4711", &(4000 + kind * 100 + i).to_string())
                    .replace("10.20.0.14", &format!("10.20.0.{}", 10 + i % 5)),
            );
        }
    }
    let mut messages = Vec::new();
    let mut k = 0;
    for (kind, (reason, _, n)) in errors.iter().enumerate() {
        for i in 0..*n {
            messages.push(Parked {
                minutes_ago: ((k * 37 + kind * 11 + i * 7) % 300) as i64 + 1,
                ..Parked::new(&ids[k], reason, &texts[k])
            });
            k += 1;
        }
    }
    let Some((queue, _cleanup, console, browser)) = setup("comments", messages).await else {
        return;
    };
    browser.log_in(&console).await;
    browser.screenshot(&dir.join("console-overview.png")).await;
    browser
        .click_link("POST https://moderation.internal/v<n>/check: timeout after <n> ms")
        .await;
    browser.screenshot(&dir.join("console-group.png")).await;
    let _ = queue;
}
