//! How the plan's queue names become JetStream subjects, streams and consumers.
//!
//! A queue `Q` of the plan is a stream of its own that captures exactly the subject `Q`.
//! A stream's name cannot hold `.`, so the stream is named after the queue with every `.`
//! turned into `_`: `comments.retry.30s` is the subject of the stream `comments_retry_30s`.
//! Two queues whose names differ only there (`a.b` and `a_b`) would want one stream; the
//! second one's provisioning then fails with a conflict on the stream's `subjects`, never
//! silently. Every stream but a parking one has one durable pull consumer,
//! [`CONSUMER`].

use retry_core::TransportError;

/// The name of the durable pull consumer on every work, isolation and delay stream.
pub const CONSUMER: &str = "retry-engine";

/// Longest stream name accepted: JetStream keeps streams in directories named after them.
pub const MAX_STREAM_NAME: usize = 255;

/// Checks that `queue` can be a JetStream subject that names one queue: not empty, no
/// wildcard (`*`, `>`), no whitespace or control character, and no empty token (a leading,
/// trailing or doubled `.`).
///
/// ```
/// use transport_nats::check_queue_name;
///
/// assert!(check_queue_name("comments.retry.30s").is_ok());
/// let err = check_queue_name("orders.*").unwrap_err();
/// assert!(err.to_string().contains("wildcard"), "{err}");
/// ```
pub fn check_queue_name(queue: &str) -> Result<(), TransportError> {
    let refuse = |why: &str| {
        Err(TransportError::Unsupported {
            what: format!("the queue name {queue:?} as a NATS subject"),
            why: why.to_owned(),
        })
    };
    if queue.is_empty() {
        return refuse("it is empty");
    }
    if queue.len() > MAX_STREAM_NAME {
        return refuse("its stream name would be longer than 255 bytes");
    }
    if queue.contains(['*', '>']) {
        return refuse(
            "`*` and `>` are wildcards in a subject, and a queue needs a name that matches itself only",
        );
    }
    if queue.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return refuse("a subject cannot hold whitespace or control characters");
    }
    if queue.split('.').any(str::is_empty) {
        return refuse("a subject's tokens cannot be empty (a leading, trailing or doubled `.`)");
    }
    if queue.contains(['/', '\\']) {
        return refuse("its stream would be named after a path (`/` or `\\`)");
    }
    Ok(())
}

/// The stream that holds queue `queue`: its name with every `.` turned into `_`.
///
/// ```
/// assert_eq!(transport_nats::stream_name("comments.retry.30s"), "comments_retry_30s");
/// ```
pub fn stream_name(queue: &str) -> String {
    queue.replace('.', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_cannot_be_one_subject_are_refused_by_name() {
        for bad in ["", "a.*", "a.>", "a b", "a..b", ".a", "a.", "a\tb", "a/b"] {
            let err = check_queue_name(bad).expect_err(bad);
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
        for good in ["comments", "comments.retry.1m30s", "a-b_c.d"] {
            check_queue_name(good).expect(good);
        }
    }
}
