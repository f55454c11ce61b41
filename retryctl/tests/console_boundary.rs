//! `retryctl serve` at its boundary, over real TCP against the built binary: sessions (one
//! per login, ended by logout, bound to one run of the console), clients that send too
//! slowly, what a page shows before login, and how the token may be given.

mod common;
#[path = "common/console.rs"]
mod console;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use console::{Console, TOKEN};

/// A work queue of its own with nothing parked; `None` without a broker.
async fn empty_queue(prefix: &str) -> Option<(String, common::Cleanup)> {
    let config = common::broker(prefix).await?;
    Some(console::parked_queue(&config, prefix, Vec::new()).await)
}

const FORM: (&str, &str) = ("Content-Type", "application/x-www-form-urlencoded");

/// Logs in with the token; returns the `Set-Cookie` line and the `name=value` pair.
fn log_in(console: &Console) -> (String, String) {
    let r = console.request("POST", "/login", &[FORM], &format!("token={TOKEN}"));
    assert_eq!(r.status, 303, "{r:?}");
    let line = r.header("set-cookie").expect("a session cookie").to_owned();
    let pair = line.split(';').next().unwrap().trim().to_owned();
    (line, pair)
}

/// The CSRF field of a page.
fn csrf_of(body: &str) -> String {
    console::hidden(body, "csrf").expect("a CSRF field")
}

/// Whether `cookie` still opens a page and the API: both, or neither (asserted).
fn opens(console: &Console, cookie: &str) -> bool {
    let page = console.request("GET", "/", &[("Cookie", cookie)], "");
    let api = console.request("GET", "/api/queues", &[("Cookie", cookie)], "");
    match (page.status, api.status) {
        (200, 200) => true,
        (303, 401) => {
            assert_eq!(page.header("location"), Some("/login"), "{page:?}");
            false
        }
        _ => panic!("the page and the API disagree: {page:?} {api:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn each_login_draws_a_session_of_its_own_and_logging_out_ends_it() {
    let Some((queue, _cleanup)) = empty_queue("console-session").await else {
        return;
    };
    let console = Console::start(&[&queue], &[]);

    let (line, first) = log_in(&console);
    let (_, second) = log_in(&console);
    assert_ne!(first, second, "two logins, two sessions");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/", "Max-Age=28800"] {
        assert!(
            line.split(';').any(|a| a.trim() == attribute),
            "{attribute}: {line}"
        );
    }
    assert!(opens(&console, &first) && opens(&console, &second));

    // The page header of a logged-in page has the logout form, with the session's CSRF
    // token; each session has its own.
    let page = console.request("GET", "/", &[("Cookie", &first)], "");
    assert!(page.body.contains("action=\"/logout\""), "{}", page.body);
    let csrf = csrf_of(&page.body);
    let other = csrf_of(&console.request("GET", "/", &[("Cookie", &second)], "").body);
    assert_ne!(csrf, other, "a CSRF token per session");

    // Logging out needs the CSRF token of the session, like every form.
    for body in [String::new(), "csrf=0000".into(), format!("csrf={other}")] {
        let r = console.request("POST", "/logout", &[("Cookie", &first), FORM], &body);
        assert_eq!(r.status, 403, "{body}: {r:?}");
    }
    assert!(opens(&console, &first));
    let r = console.request(
        "POST",
        "/logout",
        &[("Cookie", &first), FORM],
        &format!("csrf={csrf}"),
    );
    assert_eq!(
        (r.status, r.header("location")),
        (303, Some("/login")),
        "{r:?}"
    );
    let cleared = r.header("set-cookie").expect("the cookie is cleared");
    assert!(
        cleared.starts_with("retryctl_session=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );

    // The old cookie, sent again, is refused on a page and on the API; the other session
    // lives on.
    assert!(!opens(&console, &first));
    assert!(opens(&console, &second));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_is_refused_by_another_run_of_the_console_and_after_its_idle_time() {
    let Some((queue, _cleanup)) = empty_queue("console-session-run").await else {
        return;
    };
    let one = Console::start(&[&queue], &["--session-idle", "1s"]);
    let two = Console::start(&[&queue], &[]);
    let (_, cookie) = log_in(&one);
    assert!(opens(&one, &cookie));
    assert!(!opens(&two, &cookie), "the same token, another run");

    std::thread::sleep(Duration::from_millis(2500));
    assert!(!opens(&one, &cookie), "idle for longer than --session-idle");
}

#[test]
fn nothing_of_the_broker_is_shown_before_login() {
    let user = common::unique("probe-user");
    let vhost = common::unique("probe-vhost");
    // Nothing listens on port 1: the walks fail at once, the pages are served all the same.
    let url = format!("amqp://{user}:pw@localhost:1/{vhost}");
    let queue = common::unique("console-broker-shown");
    let console = Console::start(&[&queue], &["--url", &url]);
    let leaks = |what: &str, body: &str| {
        for secret in [user.as_str(), "localhost", vhost.as_str()] {
            assert!(!body.contains(secret), "{what} shows {secret}: {body}");
        }
    };
    let login = console.request("GET", "/login", &[], "");
    assert_eq!(login.status, 200);
    leaks("GET /login", &login.body);
    let r = console.request("POST", "/login", &[FORM], "token=wrong");
    assert_eq!(r.status, 401);
    leaks("a failed login", &r.body);
    let r = console.request("GET", "/no/such/page", &[], "");
    assert_eq!(r.status, 404);
    leaks("a 404", &r.body);
    let r = console.request("POST", &format!("/q/{queue}/replay"), &[FORM], "all=1");
    assert_eq!(r.status, 401);
    leaks("a refused form", &r.body);
    let wrong = [("Authorization", "Bearer not-the-token-at-all-0000")];
    let r = console.request("GET", &format!("/q/{queue}"), &wrong, "");
    assert_eq!(r.status, 401);
    leaks("a refused page", &r.body);

    // An authorized page may show it.
    let bearer = format!("Bearer {TOKEN}");
    let r = console.request("GET", "/", &[("Authorization", &bearer)], "");
    assert_eq!(r.status, 200);
    assert!(
        r.body.contains(&user) && r.body.contains(&vhost),
        "{}",
        r.body
    );
}

/// Opens a connection and sends `text`.
fn send(addr: &str, text: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("the console accepts");
    stream.write_all(text.as_bytes()).unwrap();
    stream
}

/// Reads `stream` until the server closes it; returns what was read, or `None` if it was
/// still open at `deadline`.
fn until_closed(stream: &mut TcpStream, deadline: Instant) -> Option<String> {
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return Some(String::from_utf8_lossy(&read).into_owned()),
            Ok(n) => read.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return None;
            }
            // Closed with data unread: a reset.
            Err(_) => return Some(String::from_utf8_lossy(&read).into_owned()),
        }
    }
}

#[test]
fn clients_that_stall_are_cut_off_after_the_client_timeout() {
    let queue = common::unique("console-slow");
    let console = Console::start(
        &[&queue],
        &[
            "--url",
            "amqp://u:p@localhost:1/v",
            "--client-timeout",
            "1s",
        ],
    );
    let addr = console.addr.as_str();

    // Half a request header, on 50 connections: each is closed soon after the timeout.
    let started = Instant::now();
    let mut halves: Vec<TcpStream> = (0..50)
        .map(|_| send(addr, "GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "))
        .collect();
    let deadline = started + Duration::from_secs(4);
    for (n, stream) in halves.iter_mut().enumerate() {
        assert!(
            until_closed(stream, deadline).is_some(),
            "connection {n} still open after {:?}",
            started.elapsed()
        );
    }
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "closed before the timeout: {:?}",
        started.elapsed()
    );

    // A body that stalls: 408, and the connection is closed.
    let started = Instant::now();
    let mut stalled = send(
        addr,
        "POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=",
    );
    let answer = until_closed(&mut stalled, started + Duration::from_secs(4))
        .unwrap_or_else(|| panic!("a stalled body still open after {:?}", started.elapsed()));
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // A connection kept alive and idle is closed after the same timeout.
    let mut kept = send(addr, "GET /login HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let answer = until_closed(&mut kept, Instant::now() + Duration::from_secs(4))
        .expect("an idle connection is closed");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // A request sent whole is answered.
    let r = console.request("GET", "/login", &[], "");
    assert_eq!(r.status, 200, "{r:?}");
    let bearer = format!("Bearer {TOKEN}");
    let r = console.request("GET", "/api/queues", &[("Authorization", &bearer)], "");
    assert_eq!(r.status, 200, "{r:?}");
}

/// `retryctl serve` with `args`, and `RETRYCTL_TOKEN` when given: its exit code and
/// standard error; it must exit within 10 s.
fn serve_refused(args: &[&str], env_token: Option<&str>) -> (Option<i32>, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_retryctl"));
    command
        .args(["serve", "q", "--listen", "127.0.0.1:0"])
        .args(["--url", "amqp://u:p@localhost:1/v"])
        .args(args)
        .env_remove("RETRYCTL_TOKEN")
        .env_remove("RETRYCTL_PROTOCOL")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(token) = env_token {
        command.env("RETRYCTL_TOKEN", token);
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("retryctl serve {args:?} was not refused: it runs");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_token_on_the_command_line_is_refused_and_told_where_to_go() {
    let token = "cmdline-token-0123456789abcdef";
    for args in [vec!["--token", token], vec![&format!("--token={token}")]] {
        let (code, err) = serve_refused(&args, None);
        assert_eq!(code, Some(2), "{err}");
        assert!(
            err.contains("RETRYCTL_TOKEN") && err.contains("--token-file") && err.contains("ps"),
            "{err}"
        );
        assert!(!err.contains("cmdline-token"), "the token is echoed: {err}");
    }
}

#[test]
fn a_weak_or_mangled_token_is_refused_naming_the_problem_not_the_token() {
    let dir = std::env::temp_dir().join(common::unique("console-token"));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, &str); 6] = [
        (&" ".repeat(16), "whitespace"),
        (" lead-0123456789abcdef", "whitespace"),
        ("trail-0123456789abcdef\t", "whitespace"),
        ("ctrl-0123456789\u{7}abcdef", "control character"),
        ("shortish  tok en", "16"),
        ("", "empty"),
    ];
    for (n, (token, problem)) in cases.iter().enumerate() {
        let file = dir.join(format!("token-{n}"));
        std::fs::write(&file, format!("{token}\n")).unwrap();
        let path = file.to_str().unwrap();
        for (how, args, env) in [
            ("RETRYCTL_TOKEN", vec![], Some(*token)),
            ("--token-file", vec!["--token-file", path], None),
        ] {
            let (code, err) = serve_refused(&args, env);
            assert_eq!(code, Some(2), "{how} {token:?}: {err}");
            assert!(
                err.contains(how) && err.contains(problem),
                "{token:?}: {err}"
            );
            let visible = token.trim();
            assert!(
                visible.len() < 4 || !err.contains(visible),
                "the token is echoed: {err}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
