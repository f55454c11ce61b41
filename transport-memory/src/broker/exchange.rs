//! Exchanges and routing: direct, fanout and topic, as RabbitMQ routes them.

use std::sync::Arc;

use retry_core::ExchangeKind;

use crate::broker::hash::FastMap;
use crate::broker::queues::QueueIndex;

#[derive(Debug)]
struct Binding {
    queue: QueueIndex,
    key: Arc<str>,
}

/// An exchange and its bindings.
#[derive(Debug)]
pub(crate) struct Exchange {
    kind: ExchangeKind,
    bindings: Vec<Binding>,
    /// Direct exchanges route by exact key; this avoids scanning every binding on the hot path.
    by_key: FastMap<Arc<str>, Vec<QueueIndex>>,
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

    /// Adds a binding; binding the same queue with the same key twice is a no-op, as on
    /// RabbitMQ.
    pub(crate) fn bind(&mut self, queue: QueueIndex, key: &str) {
        if self
            .bindings
            .iter()
            .any(|b| b.queue == queue && &*b.key == key)
        {
            return;
        }
        let key: Arc<str> = Arc::from(key);
        self.by_key.entry(key.clone()).or_default().push(queue);
        self.bindings.push(Binding { queue, key });
    }

    /// The queues a message with `routing_key` reaches, each once, in binding order.
    pub(crate) fn route(&self, routing_key: &str, out: &mut Vec<QueueIndex>) {
        match self.kind {
            ExchangeKind::Direct => {
                if let Some(queues) = self.by_key.get(routing_key) {
                    for q in queues {
                        push_unique(out, *q);
                    }
                }
            }
            ExchangeKind::Fanout => {
                for b in &self.bindings {
                    push_unique(out, b.queue);
                }
            }
            ExchangeKind::Topic => {
                for b in &self.bindings {
                    if topic_matches(&b.key, routing_key) {
                        push_unique(out, b.queue);
                    }
                }
            }
        }
    }
}

fn push_unique(out: &mut Vec<QueueIndex>, q: QueueIndex) {
    if !out.contains(&q) {
        out.push(q);
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
