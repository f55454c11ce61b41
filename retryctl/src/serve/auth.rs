//! Who may use the console: the token, the sessions that `/login` starts with it, and the
//! CSRF token of a session.
//!
//! * A request is let in with `Authorization: Bearer TOKEN`, or with the cookie of a live
//!   session. Each login draws a new random session id and the cookie carries it: it does
//!   not hold the token, and no two logins share it. Sessions live in the console's memory
//!   ([`Sessions`]): one ends at logout, after [`SessionLimits::idle`] without a request,
//!   after [`SessionLimits::lifetime`] in any case, when [`SessionLimits::max`] newer ones
//!   push it out, and with the console's process.
//! * A browser sends a cookie of 127.0.0.1 to every port of 127.0.0.1, so any other local
//!   service may see it: that is why a session is short-lived and ends at logout, and why
//!   scripts should send the bearer token instead.
//! * A POST let in by the cookie must also carry the session's CSRF token (a form field
//!   `csrf`, or the header `X-CSRF-Token`), an HMAC of the session id under a key drawn at
//!   start: a page of another site cannot read it. A POST with a bearer header needs none:
//!   no browser sends that header by itself.
//!
//! Every comparison of a secret runs in constant time, and sessions are looked up by a
//! hash of their id, so the time a lookup takes says nothing of the ids.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The session cookie's name.
pub const COOKIE: &str = "retryctl_session";

/// The `Set-Cookie` value that makes a browser drop the session cookie.
pub const CLEAR_COOKIE: &str = "retryctl_session=; Max-Age=0; Path=/; HttpOnly; SameSite=Strict";

/// How long sessions live, and how many may.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLimits {
    /// A session without a request for this long ends (default 30 minutes).
    pub idle: Duration,
    /// A session this old ends, however busy (default 8 hours); the cookie's `Max-Age`.
    pub lifetime: Duration,
    /// The most live sessions; a login beyond it ends the oldest (default 1,000).
    pub max: usize,
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            idle: Duration::from_secs(30 * 60),
            lifetime: Duration::from_secs(8 * 60 * 60),
            max: 1000,
        }
    }
}

/// A session's id: random bytes, in the cookie as hex.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SessionId([u8; 32]);

impl SessionId {
    /// A new id from the system's random source.
    pub fn draw() -> std::io::Result<SessionId> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
        Ok(SessionId(bytes))
    }

    /// The id a cookie's value spells (64 hex digits), if it spells one.
    pub fn parse(text: &str) -> Option<SessionId> {
        if text.len() != 64 {
            return None;
        }
        let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(text.as_bytes().chunks(2)) {
            *byte = nibble(pair[0])? << 4 | nibble(pair[1])?;
        }
        Some(SessionId(bytes))
    }

    /// The id as the cookie carries it.
    pub fn hex(&self) -> String {
        crate::render::hex(&self.0)
    }

    /// The key a session is stored under: a hash of the id, so that a lookup's timing
    /// cannot be used to guess an id byte by byte.
    fn key(&self) -> [u8; 32] {
        Sha256::digest(self.0).into()
    }
}

/// When a live session started, and when it was last used.
#[derive(Clone, Copy, Debug)]
struct Live {
    started: Instant,
    seen: Instant,
}

impl Live {
    /// Whether the session has ended by `now`.
    fn expired(&self, limits: &SessionLimits, now: Instant) -> bool {
        now.saturating_duration_since(self.seen) >= limits.idle
            || now.saturating_duration_since(self.started) >= limits.lifetime
    }
}

/// The live sessions, bounded by [`SessionLimits`]. Time is given to every call, never
/// read, so that expiry is decided by the caller's clock (tests pass their own).
#[derive(Debug)]
pub struct Sessions {
    limits: SessionLimits,
    live: HashMap<[u8; 32], Live>,
}

impl Sessions {
    /// No sessions yet, with `limits`.
    pub fn new(limits: SessionLimits) -> Sessions {
        Sessions {
            limits,
            live: HashMap::new(),
        }
    }

    /// The limits.
    pub fn limits(&self) -> SessionLimits {
        self.limits
    }

    /// Starts session `id` at `now`. Expired sessions go first; if the store is still
    /// full, the oldest live session ends to make room.
    pub fn start(&mut self, id: SessionId, now: Instant) {
        let limits = self.limits;
        self.live.retain(|_, live| !live.expired(&limits, now));
        while self.live.len() >= self.limits.max.max(1) {
            let oldest = self
                .live
                .iter()
                .min_by_key(|(_, live)| live.started)
                .map(|(key, _)| *key);
            match oldest {
                Some(key) => self.live.remove(&key),
                None => break,
            };
        }
        self.live.insert(
            id.key(),
            Live {
                started: now,
                seen: now,
            },
        );
    }

    /// Whether `id` is a live session at `now`; if so, `now` counts as its latest use. An
    /// expired session found here is ended.
    pub fn touch(&mut self, id: &SessionId, now: Instant) -> bool {
        let key = id.key();
        let Some(live) = self.live.get(&key).copied() else {
            return false;
        };
        if live.expired(&self.limits, now) {
            self.live.remove(&key);
            return false;
        }
        if let Some(live) = self.live.get_mut(&key) {
            live.seen = live.seen.max(now);
        }
        true
    }

    /// Ends session `id`; whether it was live.
    pub fn end(&mut self, id: &SessionId) -> bool {
        self.live.remove(&id.key()).is_some()
    }

    /// How many sessions are stored (some may have expired since they were last seen).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.live.len()
    }
}

/// The request being answered, as the page header needs it: set by the HTTP layer around
/// a request it has let in, and read by [`super::html::page`].
#[derive(Clone, Debug, Default)]
pub struct Viewer {
    /// The session's CSRF token, for the logout form; `None` when let in by bearer token.
    pub csrf: Option<String>,
}

tokio::task_local! {
    /// The viewer of the request being answered, only while an authorized request is
    /// answered: every page renders its header from it, so a page served without one
    /// (the login page, a 404, a refusal) shows nothing of the broker.
    pub static VIEWER: Viewer;
}

/// The token, the key drawn at start, and the live sessions.
pub struct Auth {
    token: String,
    /// Whether the token was given (`RETRYCTL_TOKEN`, `--token-file`), not drawn at start.
    pub given: bool,
    /// The key of the CSRF tokens: drawn at start, so no token outlives the run.
    key: String,
    sessions: Mutex<Sessions>,
}

/// Random bytes as hex.
pub fn random_hex(bytes: usize) -> std::io::Result<String> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(crate::render::hex(&buf))
}

fn hmac_hex(key: &str, parts: &[&str]) -> String {
    // An HMAC takes a key of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("any key length");
    for part in parts {
        mac.update(part.as_bytes());
        mac.update(&[0]);
    }
    crate::render::hex(&mac.finalize().into_bytes())
}

/// Whether `a` and `b` are equal, in time that depends only on their lengths.
pub fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

impl Auth {
    /// `token` (given by the operator when `given`), no session yet, sessions bounded by
    /// `limits`.
    pub fn new(token: String, given: bool, limits: SessionLimits) -> std::io::Result<Auth> {
        Ok(Auth {
            token,
            given,
            key: random_hex(32)?,
            sessions: Mutex::new(Sessions::new(limits)),
        })
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Whether `candidate` is the token.
    pub fn is_token(&self, candidate: &str) -> bool {
        same(candidate, &self.token)
    }

    /// Starts a new session at `now` (the caller has checked the token).
    pub fn log_in(&self, now: Instant) -> std::io::Result<SessionId> {
        let id = SessionId::draw()?;
        self.sessions().start(id, now);
        Ok(id)
    }

    /// The live session that cookie value `candidate` names at `now`, if any.
    pub fn session(&self, candidate: &str, now: Instant) -> Option<SessionId> {
        let id = SessionId::parse(candidate)?;
        self.sessions().touch(&id, now).then_some(id)
    }

    /// Ends session `id`.
    pub fn log_out(&self, id: &SessionId) {
        self.sessions().end(id);
    }

    /// The CSRF token of session `id`.
    pub fn csrf(&self, id: &SessionId) -> String {
        hmac_hex(&self.key, &["retryctl-csrf", &id.hex()])
    }

    /// Whether `candidate` is the CSRF token of session `id`.
    pub fn is_csrf(&self, id: &SessionId, candidate: &str) -> bool {
        same(candidate, &self.csrf(id))
    }

    /// The `Set-Cookie` value of session `id`: `HttpOnly`, `SameSite=Strict`, for the
    /// whole console, kept by the browser no longer than the session's lifetime.
    pub fn set_cookie(&self, id: &SessionId) -> String {
        format!(
            "{COOKIE}={}; Max-Age={}; Path=/; HttpOnly; SameSite=Strict",
            id.hex(),
            self.sessions().limits().lifetime.as_secs()
        )
    }
}

/// Every value of cookie `name` in a `Cookie` header: a browser may send several, as
/// another port of the same host may have set one of that name.
pub fn cookies<'a>(header: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    header.split(';').filter_map(move |pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn id(n: u8) -> SessionId {
        SessionId([n; 32])
    }

    #[test]
    fn each_login_is_a_session_of_its_own_with_its_own_csrf_token() {
        let auth = Auth::new("s3cret-0123456789".into(), true, SessionLimits::default()).unwrap();
        assert!(auth.is_token("s3cret-0123456789"));
        assert!(!auth.is_token("s3cret-012345678"));
        let now = Instant::now();
        let (a, b) = (auth.log_in(now).unwrap(), auth.log_in(now).unwrap());
        assert!(a != b);
        assert!(auth.session(&a.hex(), now).is_some());
        assert!(auth.session(&b.hex(), now).is_some());
        assert!(auth.session("s3cret-0123456789", now).is_none());
        assert!(auth.session(&id(7).hex(), now).is_none());
        assert!(auth.is_csrf(&a, &auth.csrf(&a)));
        assert!(!auth.is_csrf(&b, &auth.csrf(&a)));
        assert!(!auth.is_csrf(&a, &a.hex()));
        auth.log_out(&a);
        assert!(auth.session(&a.hex(), now).is_none());
        assert!(auth.session(&b.hex(), now).is_some());
        // Another run of the console, same token: neither the session nor its CSRF token.
        let again = Auth::new("s3cret-0123456789".into(), true, SessionLimits::default()).unwrap();
        assert!(again.session(&b.hex(), now).is_none());
        assert!(!again.is_csrf(&b, &auth.csrf(&b)));
    }

    #[test]
    fn the_cookie_holds_the_session_id_and_lives_as_long_as_the_session() {
        let auth = Auth::new("s3cret-0123456789".into(), true, SessionLimits::default()).unwrap();
        let a = auth.log_in(Instant::now()).unwrap();
        let line = auth.set_cookie(&a);
        assert_eq!(
            line,
            format!(
                "retryctl_session={}; Max-Age=28800; Path=/; HttpOnly; SameSite=Strict",
                a.hex()
            )
        );
        assert!(!line.contains("s3cret"));
        assert!(
            CLEAR_COOKIE.starts_with("retryctl_session=;") && CLEAR_COOKIE.contains("Max-Age=0")
        );
    }

    #[test]
    fn a_session_ends_when_idle_for_too_long_or_too_old() {
        let mut sessions = Sessions::new(SessionLimits {
            idle: 30 * MIN,
            lifetime: 8 * 60 * MIN,
            max: 10,
        });
        let t0 = Instant::now();
        sessions.start(id(1), t0);
        sessions.start(id(2), t0);
        // Used every 29 minutes, session 1 lives on; session 2, unused, ends at 30.
        assert!(sessions.touch(&id(1), t0 + 29 * MIN));
        assert!(!sessions.touch(&id(2), t0 + 30 * MIN));
        assert!(!sessions.touch(&id(2), t0), "ended for good");
        let mut t = t0 + 29 * MIN;
        while t + 29 * MIN < t0 + 8 * 60 * MIN {
            t += 29 * MIN;
            assert!(sessions.touch(&id(1), t), "{:?}", t - t0);
        }
        // However busy, it ends 8 hours after it started.
        assert!(!sessions.touch(&id(1), t0 + 8 * 60 * MIN));
        assert_eq!(sessions.len(), 0);
    }

    #[test]
    fn the_store_is_bounded_and_the_oldest_session_goes_first() {
        let mut sessions = Sessions::new(SessionLimits {
            max: 3,
            ..SessionLimits::default()
        });
        let t0 = Instant::now();
        for n in 1..=3 {
            sessions.start(id(n), t0 + u32::from(n) * MIN);
        }
        // Session 1 is the oldest, however recently used.
        assert!(sessions.touch(&id(1), t0 + 4 * MIN));
        sessions.start(id(4), t0 + 5 * MIN);
        assert_eq!(sessions.len(), 3);
        assert!(!sessions.touch(&id(1), t0 + 5 * MIN));
        for n in 2..=4 {
            assert!(sessions.touch(&id(n), t0 + 5 * MIN), "session {n}");
        }
        // Expired sessions make room before a live one is pushed out.
        sessions.start(id(5), t0 + 5 * MIN + 30 * MIN);
        assert_eq!(sessions.len(), 1);
    }

    #[test]
    fn an_id_is_read_back_from_its_hex_and_nothing_else() {
        let a = SessionId::draw().unwrap();
        assert!(SessionId::parse(&a.hex()) == Some(a));
        assert!(SessionId::parse(&a.hex()[1..]).is_none());
        assert!(SessionId::parse(&"g".repeat(64)).is_none());
        assert!(SessionId::parse(&"é".repeat(32)).is_none());
        assert!(SessionId::parse("").is_none());
        // Hex digits only: no sign.
        assert!(SessionId::parse(&"+0".repeat(32)).is_none());
    }

    #[test]
    fn every_cookie_of_the_name_is_found() {
        let header = "a=1; retryctl_session=abc; b=2; retryctl_session=def";
        assert_eq!(cookies(header, COOKIE).collect::<Vec<_>>(), ["abc", "def"]);
        assert_eq!(cookies(header, "c").count(), 0);
        assert_eq!(cookies("retryctl_session_x=1", COOKIE).count(), 0);
    }
}
