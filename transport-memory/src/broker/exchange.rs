//! Exchanges and routing: direct, fanout and topic, as RabbitMQ routes them, with bindings
//! to queues and to other exchanges.

use std::sync::Arc;

use retry_core::ExchangeKind;

use crate::broker::hash::FastMap;
use crate::broker::queues::QueueIndex;

/// Index of an exchange in the broker's table.
pub(crate) type ExchangeIndex = usize;

/// Where a binding leads: a queue, or another exchange (an exchange-to-exchange binding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Destination {
    Queue(QueueIndex),
    Exchange(ExchangeIndex),
}

#[derive(Debug)]
struct Binding {
    destination: Destination,
    key: Arc<str>,
}

/// An exchange and its bindings.
#[derive(Debug)]
pub(crate) struct Exchange {
    kind: ExchangeKind,
    bindings: Vec<Binding>,
    /// Direct exchanges route by exact key; this avoids scanning every binding on the hot path.
    by_key: FastMap<Arc<str>, Vec<Destination>>,
}

impl Exchange {
    pub(crate) fn new(kind: ExchangeKind) -> Self {
        Exchange {
            kind,
            bindings: Vec::new(),
            by_key: FastMap::default(),
        }
    }

    pub(crate) fn kind(&self) -> ExchangeKind {
        self.kind
    }

    /// Adds a binding; binding the same destination with the same key twice is a no-op, as
    /// on RabbitMQ.
    pub(crate) fn bind(&mut self, destination: Destination, key: &str) {
        if self
            .bindings
            .iter()
            .any(|b| b.destination == destination && &*b.key == key)
        {
            return;
        }
        let key: Arc<str> = Arc::from(key);
        self.by_key
            .entry(key.clone())
            .or_default()
            .push(destination);
        self.bindings.push(Binding { destination, key });
    }

    /// What a message with `routing_key` reaches through this exchange's own bindings, in
    /// binding order: the queues added to `queues` and the exchanges to `exchanges`, each
    /// once. The exchanges' own bindings are for the caller to follow.
    pub(crate) fn route(
        &self,
        routing_key: &str,
        queues: &mut Vec<QueueIndex>,
        exchanges: &mut Vec<ExchangeIndex>,
    ) {
        let mut reach = |d: Destination| match d {
            Destination::Queue(q) => push_unique(queues, q),
            Destination::Exchange(x) => push_unique(exchanges, x),
        };
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(destinations) = self.by_key.get(routing_key) {
                    for d in destinations {
                        reach(*d);
                    }
                }
            }
            ExchangeKind::Fanout => {
                for b in &self.bindings {
                    reach(b.destination);
                }
            }
            ExchangeKind::Topic => {
                for b in &self.bindings {
                    if topic_matches(&b.key, routing_key) {
                        reach(b.destination);
                    }
                }
            }
        }
    }
}

fn push_unique(out: &mut Vec<usize>, i: usize) {
    if !out.contains(&i) {
        out.push(i);
    }
}

/// Whether a topic binding pattern matches a routing key. Words are separated by `.`; `*`
/// matches exactly one word and `#` zero or more.
///
/// ```
/// use transport_memory::topic_matches;
///
/// assert!(topic_matches("orders.*.created", "orders.eu.created"));
/// assert!(!topic_matches("orders.*.created", "orders.created"));
/// assert!(topic_matches("orders.#", "orders"));
/// assert!(topic_matches("#.created", "orders.eu.created"));
/// assert!(topic_matches("#", ""));
/// ```
pub fn topic_matches(pattern: &str, routing_key: &str) -> bool {
    let pattern = words(pattern);
    let key = words(routing_key);
    // A table over (pattern position, key position): iterative, so hostile patterns with many
    // `#` words cannot blow the stack or take exponential time.
    let (p, k) = (pattern.len(), key.len());
    let mut reach = vec![false; (p + 1) * (k + 1)];
    let at = |i: usize, j: usize| i * (k + 1) + j;
    reach[at(0, 0)] = true;
    for i in 0..p {
        for j in 0..=k {
            if !reach[at(i, j)] {
                continue;
            }
            match pattern[i] {
                "#" => {
                    for j2 in j..=k {
                        reach[at(i + 1, j2)] = true;
                    }
                }
                "*" => {
                    if j < k {
                        reach[at(i + 1, j + 1)] = true;
                    }
                }
                word => {
                    if j < k && key[j] == word {
                        reach[at(i + 1, j + 1)] = true;
                    }
                }
            }
        }
    }
    reach[at(p, k)]
}

/// RabbitMQ splits the empty key into no words at all, not one empty word.
fn words(s: &str) -> Vec<&str> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('.').collect()
    }
}

#[cfg(test)]
mod tests {
    use super::topic_matches;

    #[test]
    fn topic_patterns() {
        let cases = [
            ("a.b.c", "a.b.c", true),
            ("a.b.c", "a.b", false),
            ("a.*", "a.b", true),
            ("a.*", "a", false),
            ("a.*", "a.b.c", false),
            ("a.#", "a", true),
            ("a.#", "a.b.c", true),
            ("#.c", "c", true),
            ("#.c", "a.b.c", true),
            ("#.c", "a.b", false),
            ("*.#.*", "a", false),
            ("*.#.*", "a.b", true),
            ("a.#.#.b", "a.b", true),
            ("#", "anything.at.all", true),
            ("", "", true),
            ("", "a", false),
            ("*", "", false),
        ];
        for (pattern, key, want) in cases {
            assert_eq!(topic_matches(pattern, key), want, "{pattern:?} vs {key:?}");
        }
    }
}
