//! Dead-lettering as RabbitMQ 3.10 does it: the `x-death` record, the first-death headers,
//! and the cycle check that stops messages looping between queues without a consumer's
//! involvement.

use std::time::Duration;

use retry_core::{HeaderValue, Headers, Timestamp};

use crate::broker::trace::DeathReason;

/// What one death records.
pub(crate) struct Death<'a> {
    pub(crate) queue: &'a str,
    pub(crate) reason: DeathReason,
    pub(crate) exchange: &'a str,
    pub(crate) routing_key: &'a str,
    pub(crate) time: Timestamp,
    pub(crate) original_expiration: Option<Duration>,
}

/// Updates `x-death` and the `x-first-death-*` headers for one more death.
///
/// `x-death` holds one table per {queue, reason}. A death that matches an entry increments
/// that entry's `count` and moves it to the front, keeping its other fields (they describe
/// the first such death); a new one is prepended with `count` 1. An `x-death` that is not an
/// array is replaced, as RabbitMQ resets it (a client that republished it as a string).
pub(crate) fn record_death(headers: &mut Headers, death: &Death<'_>) {
    let mut entries = match headers.remove("x-death") {
        Some(HeaderValue::Array(entries)) => entries,
        _ => Vec::with_capacity(1),
    };
    let matches = |v: &HeaderValue| match v {
        HeaderValue::Table(t) => {
            text(t, "queue") == Some(death.queue)
                && text(t, "reason") == Some(death.reason.as_str())
        }
        _ => false,
    };
    // Older brokers could leave several entries for one {queue, reason}; RabbitMQ groups
    // them, summing the counts, and so does this.
    let mut found: Option<(Headers, i64)> = None;
    entries.retain(|v| {
        if !matches(v) {
            return true;
        }
        if let HeaderValue::Table(t) = v {
            let n = count(t);
            match &mut found {
                Some((_, total)) => *total = total.saturating_add(n),
                None => found = Some((t.clone(), n)),
            }
        }
        false
    });
    let entry = match found {
        Some((mut table, total)) => {
            table.insert_static("count", HeaderValue::Int(total.saturating_add(1)));
            table
        }
        None => new_entry(death),
    };
    entries.insert(0, HeaderValue::Table(entry));
    headers.insert_static("x-death", HeaderValue::Array(entries));
    if headers.get("x-first-death-reason").is_none() {
        headers.insert_static("x-first-death-reason", death.reason.as_str());
        headers.insert_static("x-first-death-queue", death.queue);
        headers.insert_static("x-first-death-exchange", death.exchange);
    }
}

fn new_entry(death: &Death<'_>) -> Headers {
    // In name order, so that each entry is appended rather than placed.
    let mut t = Headers::with_capacity(7);
    t.insert_static("count", HeaderValue::Int(1));
    t.insert_static("exchange", death.exchange);
    if let Some(e) = death.original_expiration {
        t.insert_static("original-expiration", e.as_millis().to_string());
    }
    t.insert_static("queue", death.queue);
    t.insert_static("reason", death.reason.as_str());
    t.insert_static(
        "routing-keys",
        HeaderValue::Array(vec![HeaderValue::Str(death.routing_key.to_owned())]),
    );
    // AMQP timestamps have one-second resolution.
    let secs = death.time.as_millis() / 1000;
    t.insert_static(
        "time",
        HeaderValue::Timestamp(Timestamp::from_millis(secs * 1000)),
    );
    t
}

fn text<'a>(t: &'a Headers, name: &str) -> Option<&'a str> {
    match t.get(name) {
        Some(HeaderValue::Str(s)) => Some(s),
        _ => None,
    }
}

fn count(t: &Headers) -> i64 {
    match t.get("count") {
        Some(HeaderValue::Int(n)) => *n,
        Some(HeaderValue::UInt(n)) => i64::try_from(*n).unwrap_or(i64::MAX),
        _ => 1,
    }
}

/// Whether dead-lettering into `target` closes a cycle with no consumer rejection in it:
/// RabbitMQ drops the message for that queue instead of letting it loop forever. `headers`
/// already hold the current death at the front of `x-death`. Rejections break cycles, since
/// a consumer chose to send the message round again.
pub(crate) fn is_cycle(headers: &Headers, target: &str) -> bool {
    let Some(HeaderValue::Array(deaths)) = headers.get("x-death") else {
        return false;
    };
    let Some(at) = deaths.iter().position(|d| match d {
        HeaderValue::Table(t) => text(t, "queue") == Some(target),
        _ => false,
    }) else {
        return false;
    };
    deaths[..=at].iter().all(|d| match d {
        HeaderValue::Table(t) => text(t, "reason") != Some(DeathReason::Rejected.as_str()),
        // Something a client put there: not a fully automatic cycle.
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn death(queue: &str, reason: DeathReason, at: u64) -> Death<'_> {
        Death {
            queue,
            reason,
            exchange: "x",
            routing_key: "k",
            time: Timestamp::from_millis(at),
            original_expiration: None,
        }
    }

    fn entry_counts(h: &Headers) -> Vec<(String, i64)> {
        let Some(HeaderValue::Array(v)) = h.get("x-death") else {
            return Vec::new();
        };
        v.iter()
            .filter_map(|e| match e {
                HeaderValue::Table(t) => Some((text(t, "queue")?.to_owned(), count(t))),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn repeated_death_moves_to_front_and_keeps_first_time() {
        let mut h = Headers::new();
        record_death(&mut h, &death("a", DeathReason::Expired, 1_000));
        record_death(&mut h, &death("b", DeathReason::Expired, 2_000));
        record_death(&mut h, &death("a", DeathReason::Expired, 3_000));
        assert_eq!(entry_counts(&h), [("a".to_owned(), 2), ("b".to_owned(), 1)]);
        let Some(HeaderValue::Array(v)) = h.get("x-death") else {
            panic!("x-death missing")
        };
        let HeaderValue::Table(first) = &v[0] else {
            panic!("not a table")
        };
        assert_eq!(
            first.get("time"),
            Some(&HeaderValue::Timestamp(Timestamp::from_millis(1_000)))
        );
        assert_eq!(h.get("x-first-death-queue"), Some(&"a".into()));
    }

    #[test]
    fn non_array_x_death_is_reset() {
        let mut h: Headers = [("x-death", "garbage")].into_iter().collect();
        record_death(&mut h, &death("a", DeathReason::Rejected, 0));
        assert_eq!(entry_counts(&h), [("a".to_owned(), 1)]);
    }

    #[test]
    fn cycles_without_rejection_are_detected() {
        let mut h = Headers::new();
        record_death(&mut h, &death("work", DeathReason::Expired, 0));
        record_death(&mut h, &death("delay", DeathReason::Expired, 0));
        assert!(is_cycle(&h, "work"));
        assert!(!is_cycle(&h, "elsewhere"));
        let mut h = Headers::new();
        record_death(&mut h, &death("work", DeathReason::Rejected, 0));
        record_death(&mut h, &death("delay", DeathReason::Expired, 0));
        assert!(!is_cycle(&h, "work"));
    }
}
