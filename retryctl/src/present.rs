//! How parked messages read, for `retryctl parked` and the console alike: a record as a
//! line or JSON, a message in full, times, and what a replay or a failed walk says.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use retry_core::headers::{self, PREVIOUS_ERROR, PREVIOUS_REASON, REPLAYED_AT, REPLAYS};
use retry_core::{
    Headers, ParkedMessage, ParkedReason, ParkedRecord, ParkingReport, Properties, Timestamp,
};
use serde_json::{Value, json};

use crate::error::CliError;
use crate::render::{header_json, hex};

/// An RFC 3339 time, or a duration before now.
pub(crate) fn parse_when(text: &str) -> Result<Timestamp, String> {
    if let Ok(t) = humantime::parse_rfc3339_weak(text) {
        return Ok(Timestamp::from_system_time(t));
    }
    match humantime::parse_duration(text) {
        Ok(ago) => Ok(Timestamp::from_system_time(
            SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH),
        )),
        Err(_) => Err(
            "expected an RFC 3339 time (2026-12-01T09:30:00Z) or a duration ago (2h, 30m)".into(),
        ),
    }
}

/// What a replay did, as `retryctl parked replay` and the console say it: the messages the
/// transport could not copy (left parked) are named when there are some.
pub(crate) fn replay_line(report: &ParkingReport, work: &str, parking: &str) -> String {
    let mut line = format!(
        "replayed {} to {work}, left {} in {parking}",
        report.replayed, report.left
    );
    if report.uncopyable > 0 {
        line.push_str(&format!(
            " ({} of them could not be copied: messages the transport could not read as \
             they came; read or purge them)",
            report.uncopyable
        ));
    }
    line
}

/// The refusal of a replay that selects `hidden` messages whose headers the transport does
/// not show, if any: `why` is the transport's word on one of them
/// ([`Admin::hidden_headers`](retry_core::Admin::hidden_headers)).
pub(crate) fn hidden_headers_refusal(
    hidden: u64,
    parking: &str,
    why: Option<&str>,
) -> Result<(), CliError> {
    if hidden == 0 {
        return Ok(());
    }
    let why = why.unwrap_or(
        "may have headers this transport does not show, which a replayed copy would lose",
    );
    Err(CliError::usage(format!(
        "nothing replayed: {hidden} of the selected messages in {parking} {why}"
    )))
}

/// What a walk that failed after doing `done` says.
pub(crate) fn walk_error_text(what: &str, done: &ParkingReport) -> String {
    if *done == ParkingReport::default() {
        format!("{what} failed")
    } else {
        format!(
            "{what} stopped after {} replayed and {} purged; every other message is still parked",
            done.replayed, done.purged
        )
    }
}

/// A time as RFC 3339, to the millisecond, in UTC.
pub(crate) fn time_text(t: Timestamp) -> String {
    let system = UNIX_EPOCH.checked_add(Duration::from_millis(t.as_millis()));
    match system {
        Some(t) => humantime::format_rfc3339_millis(t).to_string(),
        None => format!("{} ms", t.as_millis()),
    }
}

/// Text cut to its first line, with control characters shown as spaces and `…` where
/// something was cut.
pub(crate) fn one_line(text: &str, max_chars: usize) -> String {
    let first = text.lines().next().unwrap_or("");
    let mut out: String = first
        .chars()
        .take(max_chars)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if first.chars().count() > max_chars || first.len() < text.trim_end().len() {
        out.push('…');
    }
    out
}

/// Whether a counter of the engine's record has a value on this message: its header is
/// there, or it is attempts or crashes and the message carries the engine's record at all
/// (clones leave out those counters when they are 0, see `EngineHeaders::write_into`).
fn counter_known(headers: &Headers, name: &str) -> bool {
    headers.get(name).is_some()
        || ([headers::ATTEMPTS, headers::CRASHES].contains(&name)
            && (headers.get(headers::ORIGIN_QUEUE).is_some()
                || headers.get(headers::REASON).is_some()))
}

/// A counter of the engine's record as a list shows it: `malformed` when its header is
/// unusable, `-` when the message has none.
fn counter_field(headers: &Headers, record: &ParkedRecord<'_>, name: &str, n: u32) -> String {
    if record.malformed.contains(name) {
        "malformed".into()
    } else if counter_known(headers, name) {
        n.to_string()
    } else {
        "-".into()
    }
}

pub(crate) fn record_line(parked: &ParkedMessage) -> String {
    let headers = parked.message().headers();
    let record = parked.record();
    let attempts = counter_field(headers, &record, headers::ATTEMPTS, record.attempts);
    let crashes = counter_field(headers, &record, headers::CRASHES, record.crashes);
    let parked_at = match parked.parked_at() {
        Some(t) => time_text(t),
        None if record.malformed.contains(headers::LAST_FAILURE) => "malformed".into(),
        None => "-".into(),
    };
    let error = match record.last_error {
        Some(e) => one_line(e, 120),
        None if record.malformed.contains(headers::LAST_ERROR) => "malformed".into(),
        None => "-".into(),
    };
    format!(
        "{:<24} {:<18} {:>8} {:>7}  {:<24}  {error}",
        id_text(parked),
        parked.reason().as_str(),
        attempts,
        crashes,
        parked_at
    )
}

pub(crate) fn id_text(parked: &ParkedMessage) -> String {
    parked
        .id()
        .map_or_else(|| "(no id)".to_owned(), |id| one_line(id, 64))
}

/// Every diagnostic field of a parked message.
pub(crate) fn record_json(parked: &ParkedMessage) -> Value {
    record_json_of(parked.id(), parked.message().headers())
}

/// Every diagnostic field of a parked message with message id `id` and `headers`: a field is
/// `"malformed"` when its header is unusable and `null` when the message has no value for
/// it (a header left out because it held its default has one: see `ParkedRecord`).
pub(crate) fn record_json_of(id: Option<&str>, headers: &Headers) -> Value {
    let r = ParkedRecord::decode(headers);
    let time = |t: Option<Timestamp>| t.map_or(Value::Null, |t| json!(time_text(t)));
    let f = |name: &str, value: Value| {
        if r.malformed.contains(name) {
            json!("malformed")
        } else {
            value
        }
    };
    let count = |name: &str, n: u32| {
        f(
            name,
            if counter_known(headers, name) {
                json!(n)
            } else {
                Value::Null
            },
        )
    };
    json!({
        "id": id,
        "reason": ParkedReason::of(headers).as_str(),
        "attempts": count(headers::ATTEMPTS, r.attempts),
        "crashes": count(headers::CRASHES, r.crashes),
        "parked_at": time(retry_core::parked_at(headers)),
        "first_failure": f(headers::FIRST_FAILURE, time(r.first_failure)),
        "last_failure": f(headers::LAST_FAILURE, time(r.last_failure)),
        "last_error": f(headers::LAST_ERROR, json!(r.last_error)),
        "origin_queue": f(headers::ORIGIN_QUEUE, json!(r.origin_queue)),
        "origin_exchange": f(headers::ORIGIN_EXCHANGE, json!(r.origin_exchange)),
        "origin_routing_key": f(headers::ORIGIN_ROUTING_KEY, json!(r.origin_routing_key)),
        "replays": count(REPLAYS, r.replays),
        "replayed_at": f(REPLAYED_AT, time(r.replayed_at)),
        "previous_reason": f(PREVIOUS_REASON, json!(r.previous_reason)),
        "previous_error": f(PREVIOUS_ERROR, json!(r.previous_error)),
        "malformed": r.malformed.names().collect::<Vec<_>>(),
    })
}

pub(crate) fn properties_json(p: &Properties) -> Value {
    json!({
        "content_type": p.content_type,
        "content_encoding": p.content_encoding,
        "message_id": p.message_id,
        "correlation_id": p.correlation_id,
        "reply_to": p.reply_to,
        "timestamp": p.timestamp.map(time_text),
        "priority": p.priority,
        "type": p.kind,
        "app_id": p.app_id,
        "persistent": p.persistent,
    })
}

/// The body as JSON: text when it is UTF-8, hex otherwise.
fn body_json(body: &[u8]) -> Value {
    match std::str::from_utf8(body) {
        Ok(text) => json!({ "length": body.len(), "text": text }),
        Err(_) => json!({ "length": body.len(), "hex": hex(body) }),
    }
}

pub(crate) fn message_json(parked: &ParkedMessage) -> Value {
    let message = parked.message();
    json!({
        "record": record_json(parked),
        "properties": properties_json(message.properties()),
        "headers": Value::Object(
            message
                .headers()
                .iter()
                .map(|(k, v)| (k.to_owned(), header_json(v)))
                .collect(),
        ),
        "body": body_json(message.body()),
    })
}

/// A message in full, as text.
pub(crate) fn message_text(parked: &ParkedMessage, parking: &str) -> String {
    use std::fmt::Write as _;
    let message = parked.message();
    let mut out = String::new();
    let _ = writeln!(out, "message {} in {parking}", id_text(parked));
    let _ = writeln!(out, "\nrecord");
    if let Value::Object(fields) = record_json(parked) {
        for (name, value) in fields {
            if !value.is_null() && value != json!([]) {
                let _ = writeln!(out, "  {name:<19} {}", value_text(&value));
            }
        }
    }
    let _ = writeln!(out, "\nproperties");
    if let Value::Object(fields) = properties_json(message.properties()) {
        for (name, value) in fields {
            if !value.is_null() {
                let _ = writeln!(out, "  {name:<19} {}", value_text(&value));
            }
        }
    }
    let _ = writeln!(out, "\nheaders");
    let width = message.headers().iter().map(|(k, _)| k.len()).max();
    for (name, value) in message.headers().iter() {
        let mut text = value_text(&header_json(value));
        if [headers::FIRST_FAILURE, headers::LAST_FAILURE, REPLAYED_AT].contains(&name)
            && let Some(ms) = value.as_u64()
        {
            text = format!("{text} ({})", time_text(Timestamp::from_millis(ms)));
        }
        let _ = writeln!(out, "  {name:<w$}  {text}", w = width.unwrap_or(0));
    }
    let body = message.body();
    match std::str::from_utf8(body) {
        Ok(text) => {
            let _ = writeln!(out, "\nbody ({} bytes, UTF-8)", body.len());
            for line in text.lines() {
                let _ = writeln!(out, "  {line}");
            }
        }
        Err(_) => {
            let _ = writeln!(out, "\nbody ({} bytes, not UTF-8, in hex)", body.len());
            for (i, chunk) in body.chunks(16).enumerate() {
                let _ = writeln!(out, "  {:08x}  {}", i * 16, hex(chunk));
            }
        }
    }
    out
}

/// A JSON value as a line of text: strings without their quotes, but for the empty one.
fn value_text(value: &Value) -> String {
    match value {
        Value::String(s) if s.is_empty() => "\"\"".into(),
        Value::String(s) => one_line(s, 200),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(", "),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_cuts_at_the_first_line_and_marks_the_cut() {
        assert_eq!(one_line("timeout", 120), "timeout");
        assert_eq!(one_line("first\nsecond", 120), "first…");
        assert_eq!(one_line("tab\there", 120), "tab here");
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(one_line("", 3), "");
        assert_eq!(one_line("trailing newline\n", 120), "trailing newline");
    }

    #[test]
    fn when_reads_a_time_or_a_duration_ago() {
        assert_eq!(
            parse_when("2026-12-01T09:30:00Z"),
            Ok(Timestamp::from_millis(1_796_117_400_000))
        );
        let two_hours_ago = parse_when("2h").unwrap();
        let now = Timestamp::from_system_time(SystemTime::now());
        let ago = now.saturating_duration_since(two_hours_ago);
        assert!(
            ago >= Duration::from_secs(7199) && ago <= Duration::from_secs(7201),
            "{ago:?}"
        );
        assert!(parse_when("yesterday").is_err());
    }

    #[test]
    fn time_text_is_rfc3339_in_utc() {
        assert_eq!(
            time_text(Timestamp::from_millis(1_796_117_400_123)),
            "2026-12-01T09:30:00.123Z"
        );
    }
}
