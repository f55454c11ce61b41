//! Who may use the console: the token, the session cookie made from it, and the CSRF token
//! of a session.
//!
//! * A request is let in with `Authorization: Bearer TOKEN`, or with the session cookie
//!   that `/login` sets once it is given the token. The cookie's value is an HMAC of a
//!   random value drawn when the console starts, keyed by the token: it does not hold the
//!   token, and it stops working when the console restarts or the token changes.
//! * A POST let in by the cookie must also carry the session's CSRF token (a form field
//!   `csrf`, or the header `X-CSRF-Token`), an HMAC of the session under the token: a page
//!   of another site cannot read it. A POST with a bearer header needs none: no browser
//!   sends that header by itself.
//!
//! Every comparison of a secret runs in constant time.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The session cookie's name.
pub const COOKIE: &str = "retryctl_session";

/// The token, and what this run of the console derives from it.
pub struct Auth {
    token: String,
    /// Whether the token was given (`--token`, `--token-file`), not drawn at start.
    pub given: bool,
    session: String,
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
    /// `token` (given by the operator when `given`), with a session drawn now.
    pub fn new(token: String, given: bool) -> std::io::Result<Auth> {
        let nonce = random_hex(32)?;
        let session = hmac_hex(&token, &["retryctl-session", &nonce]);
        Ok(Auth {
            token,
            given,
            session,
        })
    }

    /// The token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Whether `candidate` is the token.
    pub fn is_token(&self, candidate: &str) -> bool {
        same(candidate, &self.token)
    }

    /// The session cookie's value.
    #[cfg(test)]
    pub fn session(&self) -> &str {
        &self.session
    }

    /// Whether `candidate` is this run's session.
    pub fn is_session(&self, candidate: &str) -> bool {
        same(candidate, &self.session)
    }

    /// The CSRF token of the session.
    pub fn csrf(&self) -> String {
        hmac_hex(&self.token, &["retryctl-csrf", &self.session])
    }

    /// Whether `candidate` is the session's CSRF token.
    pub fn is_csrf(&self, candidate: &str) -> bool {
        same(candidate, &self.csrf())
    }

    /// The `Set-Cookie` value that starts a session: `HttpOnly`, `SameSite=Strict`, for
    /// the whole console, ending with the browser.
    pub fn set_cookie(&self) -> String {
        format!(
            "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict",
            self.session
        )
    }
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_and_csrf_tokens_are_derived_and_checked() {
        let auth = Auth::new("s3cret".into(), true).unwrap();
        assert!(auth.is_token("s3cret"));
        assert!(!auth.is_token("s3cre"));
        assert!(!auth.is_token("s3cret "));
        assert!(!auth.session().contains("s3cret"));
        assert!(auth.is_session(auth.session()));
        assert!(!auth.is_session("s3cret"));
        assert!(auth.is_csrf(&auth.csrf()));
        assert!(!auth.is_csrf(auth.session()));
        // Another run of the console, same token: another session.
        let again = Auth::new("s3cret".into(), true).unwrap();
        assert!(!again.is_session(auth.session()));
        assert!(!again.is_csrf(&auth.csrf()));
        let cookie_line = auth.set_cookie();
        assert!(cookie_line.contains("HttpOnly") && cookie_line.contains("SameSite=Strict"));
    }

    #[test]
    fn a_cookie_is_found_by_name() {
        let header = "a=1; retryctl_session=abc; b=2";
        assert_eq!(cookie(header, COOKIE), Some("abc"));
        assert_eq!(cookie(header, "c"), None);
        assert_eq!(cookie("retryctl_session_x=1", COOKIE), None);
    }
}
