//! [`LogRecorder`]: a `tracing` subscriber that keeps what was logged, for tests to check.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};

/// A `tracing` subscriber that keeps every event and span, at every level and from every
/// crate, as a line of text: to check what reaches the logs, such as that no password does.
///
/// ```
/// use test_brokers::LogRecorder;
///
/// let recorder = LogRecorder::default();
/// tracing::subscriber::with_default(recorder.clone(), || {
///     tracing::warn!(url = "amqp://app:****@broker", "connection lost");
/// });
/// assert_eq!(recorder.containing("connection lost").len(), 1);
/// assert!(recorder.containing("secret").is_empty());
/// assert_eq!(recorder.at_least(tracing::Level::WARN).len(), 1);
/// assert!(recorder.at_least(tracing::Level::ERROR).is_empty());
/// ```
#[derive(Clone, Debug, Default)]
pub struct LogRecorder {
    lines: Arc<Mutex<Vec<Recorded>>>,
    /// The most verbose level kept; `None` keeps every level, and spans.
    verbosity: Option<Level>,
}

/// One recorded line, with its event's level (`None` for a span).
#[derive(Debug)]
struct Recorded {
    level: Option<Level>,
    text: String,
    at: std::time::SystemTime,
}

impl LogRecorder {
    /// A recorder of events at `level` or more severe only, and no spans: for a whole test
    /// process, where lapin's frame-by-frame TRACE lines would be too many.
    ///
    /// ```
    /// use test_brokers::LogRecorder;
    ///
    /// let recorder = LogRecorder::up_to(tracing::Level::INFO);
    /// tracing::subscriber::with_default(recorder.clone(), || {
    ///     tracing::debug!("frame sent");
    ///     tracing::info!("connected");
    /// });
    /// assert_eq!(recorder.len(), 1);
    /// ```
    pub fn up_to(level: Level) -> Self {
        LogRecorder {
            verbosity: Some(level),
            ..LogRecorder::default()
        }
    }

    /// How many lines were recorded.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The recorded lines that contain `text`.
    pub fn containing(&self, text: &str) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.text.contains(text))
            .map(|line| line.text.clone())
            .collect()
    }

    /// The recorded events at `level` or more severe (`WARN` gives warnings and errors).
    pub fn at_least(&self, level: Level) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.level.is_some_and(|l| l <= level))
            .map(|line| line.text.clone())
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Recorded>> {
        self.lines.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The recorded events at `level` or more severe, each after the UTC time of day it was
    /// recorded at (`HH:MM:SS.mmm`), for a failing test's message.
    ///
    /// ```
    /// use test_brokers::LogRecorder;
    ///
    /// let recorder = LogRecorder::up_to(tracing::Level::INFO);
    /// tracing::subscriber::with_default(recorder.clone(), || tracing::warn!("node down"));
    /// let lines = recorder.timed(tracing::Level::WARN);
    /// // "12:34:56.789 WARN <module> message=node down"
    /// let (time, rest) = lines[0].split_once(' ').unwrap();
    /// assert_eq!((time.len(), &time[2..3], &time[8..9]), (12, ":", "."), "{lines:?}");
    /// assert!(rest.starts_with("WARN ") && rest.ends_with(" message=node down"), "{lines:?}");
    /// ```
    pub fn timed(&self, level: Level) -> Vec<String> {
        self.lock()
            .iter()
            .filter(|line| line.level.is_some_and(|l| l <= level))
            .map(|line| {
                let ms = line
                    .at
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() % 86_400_000);
                format!(
                    "{:02}:{:02}:{:02}.{:03} {}",
                    ms / 3_600_000,
                    ms / 60_000 % 60,
                    ms / 1_000 % 60,
                    ms % 1_000,
                    line.text
                )
            })
            .collect()
    }

    fn keep(&self, level: Option<Level>, line: Line) {
        self.lock().push(Recorded {
            level,
            text: line.0,
            at: std::time::SystemTime::now(),
        });
    }
}

/// One line being written: a prefix, then ` name=value` per field.
struct Line(String);

impl Visit for Line {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }

    /// An error with its whole chain of causes, as a subscriber that prints sources does.
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let _ = write!(self.0, " {}={value}", field.name());
        let mut cause = value.source();
        while let Some(e) = cause {
            let _ = write!(self.0, ": {e}");
            cause = e.source();
        }
    }
}

impl Subscriber for LogRecorder {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        match self.verbosity {
            None => true,
            Some(level) => metadata.is_event() && *metadata.level() <= level,
        }
    }

    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let mut line = Line(format!("span {}", span.metadata().name()));
        span.record(&mut line);
        self.keep(None, line);
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, values: &Record<'_>) {
        let mut line = Line("record".into());
        values.record(&mut line);
        self.keep(None, line);
    }

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = Line(format!("{} {}", meta.level(), meta.target()));
        event.record(&mut line);
        self.keep(Some(*meta.level()), line);
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}
