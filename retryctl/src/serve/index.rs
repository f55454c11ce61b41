//! The console's index of one parking queue: what a walk read, kept in memory so that pages
//! are served without reading the queue.
//!
//! Every message the walk reads is counted (by reason, by failure group, over time); its
//! headers, properties and the first [`IndexLimits::preview_bytes`] of its body are kept
//! while the index's estimate of its own heap stays under [`IndexLimits::memory_cap`]. What
//! does not fit is counted and said, never silently left out.
//!
//! Selections on the index use [`ParkedFilter::matches_summary`], the same test a walk of
//! the queue makes, so a count shown before an action is the count the action finds, as of
//! the index's walk.

use std::collections::{BTreeMap, HashMap};
use std::mem::size_of;
use std::sync::Arc;
use std::time::Duration;

use retry_core::{
    HeaderValue, Headers, Message, ParkedFilter, ParkedReason, ParkedSummary, Properties,
    Timestamp, error_fingerprint,
};

use super::packed;

/// Names one parked message for a replay or purge: a SHA-256 digest, cut to 128 bits, of
/// its properties, its headers and its whole body. The headers hold what the publish that
/// parked it stamped (its time, its publish id, the broker's `x-death`), so two messages
/// with one key are the same bytes; a requeue, which reorders a queue, does not change a
/// key. `x-delivery-count`, which a quorum queue raises at each redelivery, is left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key([u8; 16]);

/// The header a quorum queue raises at each redelivery: not part of a [`Key`].
const REDELIVERIES: &str = "x-delivery-count";

impl Key {
    /// The key of `message`.
    pub fn of(message: &Message) -> Key {
        let headers = message.headers();
        let packed = if headers.get(REDELIVERIES).is_some() {
            let mut kept = headers.clone();
            kept.remove(REDELIVERIES);
            packed::pack(message.properties(), &kept)
        } else {
            packed::pack(message.properties(), headers)
        };
        Key::of_packed(&packed, message.body())
    }

    fn of_packed(packed: &[u8], body: &[u8]) -> Key {
        use sha2::{Digest, Sha256};
        let mut digest = Sha256::new();
        digest.update((packed.len() as u64).to_le_bytes());
        digest.update(packed);
        digest.update(body);
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest.finalize()[..16]);
        Key(key)
    }

    /// In hex, as forms and the API carry it.
    pub fn hex(&self) -> String {
        crate::render::hex(&self.0)
    }

    /// The key written as [`hex`](Self::hex); `None` for anything else.
    pub fn parse(text: &str) -> Option<Key> {
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut key = [0u8; 16];
        for (i, byte) in key.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Key(key))
    }
}

/// How much an index keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexLimits {
    /// The most bytes of heap the kept messages may take, by the index's own estimate.
    pub memory_cap: usize,
    /// The bytes of each body kept for the message page.
    pub preview_bytes: usize,
    /// The most failure groups told apart; messages of any further group are counted in
    /// one group of their own, "other errors".
    pub max_groups: usize,
}

impl Default for IndexLimits {
    fn default() -> Self {
        IndexLimits {
            memory_cap: 64 << 20,
            preview_bytes: 256,
            max_groups: 10_000,
        }
    }
}

/// One parked message, as the index keeps it: what lists sort and filter on, read once,
/// and what its page shows, [`Held`].
#[derive(Debug)]
pub struct Entry {
    /// Its place in the walk, from 0: the queue's order.
    pub pos: u64,
    /// Its reason.
    pub reason: ParkedReason,
    /// When it was parked.
    pub parked_at: Option<Timestamp>,
    /// Its failure group: an index into [`Index::groups`].
    pub group: u32,
    /// Its attempts, as the list shows them.
    pub attempts: Option<u32>,
    /// What names it for an action.
    pub key: Key,
    // Read by every filter of a list, so held here, one pointer away, rather than in
    // `held`, two away: at 100,000 messages the second pointer made a filtered list 4
    // times slower. Shared with the previous index as `held` is.
    id: Option<Arc<str>>,
    last_error: Option<Arc<str>>,
    held: Arc<Held>,
}

/// What a parked message holds, kept by reference: the next walk's index shares it when it
/// reads the same message again, so that an index being rebuilt beside the one being
/// served costs only what changed.
#[derive(Debug, PartialEq, Eq)]
struct Held {
    /// Properties and headers, packed ([`packed`]): the id and the last
    /// error too.
    packed: Box<[u8]>,
    body_len: usize,
    /// The first bytes of the body.
    preview: Box<[u8]>,
}

impl Held {
    /// A hash of everything it holds, to find it again in the previous index.
    fn hash(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&self.packed, self.body_len, &self.preview).hash(&mut h);
        h.finish()
    }
}

impl Entry {
    /// Its `message-id`.
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Its last error (`x-retry-last-error`), when it is a string.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// Its properties and every header.
    pub fn unpack(&self) -> (Properties, Headers) {
        // Packed by this process: it always reads back.
        packed::unpack(&self.held.packed).unwrap_or_default()
    }

    /// The length of its body.
    pub fn body_len(&self) -> usize {
        self.held.body_len
    }

    /// The first bytes of its body.
    pub fn preview(&self) -> &[u8] {
        &self.held.preview
    }
}

/// A failure group: parked messages with one reason and one [`error_fingerprint`].
#[derive(Debug, Clone)]
pub struct Group {
    /// A stable name for links: a hash of the reason and the fingerprint, in hex.
    pub key: String,
    /// The reason its messages were parked for.
    pub reason: ParkedReason,
    /// The folded error; empty for messages with no last error.
    pub fingerprint: String,
    /// Whether this is the group of messages beyond [`IndexLimits::max_groups`].
    pub overflow: bool,
    /// How many messages are in it, indexed or not.
    pub count: u64,
    /// The earliest and latest parking time among them.
    pub first_seen: Option<Timestamp>,
    /// See `first_seen`.
    pub last_seen: Option<Timestamp>,
    /// The first message's id and full last error, as an example.
    pub example_id: Option<String>,
    /// See `example_id`.
    pub example_error: Option<String>,
}

impl Group {
    /// The filter that selects this group's messages on the queue; `None` for the overflow
    /// group, which no filter describes.
    pub fn filter(&self) -> Option<ParkedFilter> {
        (!self.overflow)
            .then(|| ParkedFilter::reason(self.reason).with_error_group(self.fingerprint.clone()))
    }
}

/// A finished index of one parking queue.
#[derive(Debug, Default)]
pub struct Index {
    /// Kept messages, in queue order.
    pub entries: Vec<Entry>,
    /// Failure groups, largest first.
    pub groups: Vec<Group>,
    /// Messages the walk read.
    pub total: u64,
    /// Messages counted but not kept, the memory cap being reached.
    pub not_kept: u64,
    /// Count by reason, in the reasons' spelling order.
    pub by_reason: BTreeMap<&'static str, u64>,
    /// The earliest and latest parking time.
    pub oldest: Option<Timestamp>,
    /// See `oldest`.
    pub newest: Option<Timestamp>,
    /// Messages with no parking time.
    pub no_time: u64,
    /// How many were parked in each minute (minutes since the Unix epoch).
    pub per_minute: BTreeMap<u64, u64>,
    /// The index's estimate of its heap, in bytes.
    pub bytes: usize,
    /// The limits it was built with.
    pub limits: IndexLimits,
    /// When the walk started, and how long it took.
    pub started: Option<Timestamp>,
    /// See `started`.
    pub took: Duration,
}

/// Builds an [`Index`] from a walk, one message at a time.
#[derive(Debug)]
pub struct IndexBuilder<'a> {
    index: Index,
    group_of: HashMap<(ParkedReason, String), u32>,
    overflow: Option<u32>,
    /// The index this one replaces, and its entries by [`Held::hash`].
    previous: Option<(&'a Index, HashMap<u64, u32>)>,
}

/// The heap an [`Entry`] takes, what it holds included (even when shared with the previous
/// index): what the cap is measured against.
fn entry_bytes(id: Option<&str>, last_error: Option<&str>, held: &Held) -> usize {
    size_of::<Entry>()
        + size_of::<Held>()
        + id.map_or(0, str::len)
        + last_error.map_or(0, str::len)
        + held.packed.len()
        + held.preview.len()
}

/// A short, stable name for a group: FNV-1a of its reason and fingerprint.
fn group_key(reason: ParkedReason, fingerprint: &str) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in reason
        .as_str()
        .bytes()
        .chain([0])
        .chain(fingerprint.bytes())
    {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// A counter header as the list shows it: absent or unusable is `None`.
fn counter(headers: &Headers, name: &str) -> Option<u32> {
    headers
        .get(name)
        .and_then(HeaderValue::as_u64)
        .and_then(|n| u32::try_from(n).ok())
}

impl<'a> IndexBuilder<'a> {
    /// An empty index that keeps what `limits` allow; the walk started at `started`. It
    /// shares with `previous`, the index it will replace, what a message it reads again
    /// unchanged holds.
    pub fn new(limits: IndexLimits, started: Timestamp, previous: Option<&'a Index>) -> Self {
        let previous = previous.map(|index| {
            let mut by_hash = HashMap::with_capacity(index.entries.len());
            for (i, entry) in index.entries.iter().enumerate() {
                by_hash.entry(entry.held.hash()).or_insert(i as u32);
            }
            (index, by_hash)
        });
        IndexBuilder {
            index: Index {
                limits,
                started: Some(started),
                ..Index::default()
            },
            group_of: HashMap::new(),
            overflow: None,
            previous,
        }
    }

    /// The entry of the previous index that holds the same as `held`, if any.
    fn previous_holding(&self, held: &Held) -> Option<&'a Entry> {
        let (index, by_hash) = self.previous.as_ref()?;
        let old = index.entries.get(*by_hash.get(&held.hash())? as usize)?;
        (*old.held == *held).then_some(old)
    }

    /// Counts a parked message, and keeps it if it fits.
    pub fn add(&mut self, message: &Message) {
        let headers = message.headers();
        let reason = ParkedReason::of(headers);
        let parked_at = retry_core::parked_at(headers);
        // As `ParkedRecord` reads it: a string, or none.
        let last_error = match headers.get(retry_core::headers::LAST_ERROR) {
            Some(HeaderValue::Str(e)) => Some(e.as_str()),
            _ => None,
        };
        let id = message.properties().message_id.as_deref();
        let index = &mut self.index;
        let pos = index.total;
        index.total += 1;
        *index.by_reason.entry(reason.as_str()).or_default() += 1;
        match parked_at {
            Some(t) => {
                index.oldest = Some(index.oldest.map_or(t, |o| o.min(t)));
                index.newest = Some(index.newest.map_or(t, |n| n.max(t)));
                *index.per_minute.entry(t.as_millis() / 60_000).or_default() += 1;
            }
            None => index.no_time += 1,
        }
        let group = self.group_for(reason, last_error, id, parked_at);
        let body = message.body();
        let packed = packed::pack(message.properties(), headers);
        let key = match headers.get(REDELIVERIES) {
            None => Key::of_packed(&packed, body),
            Some(_) => Key::of(message),
        };
        let held = Held {
            packed,
            body_len: body.len(),
            preview: body[..body.len().min(self.index.limits.preview_bytes)].into(),
        };
        let bytes = entry_bytes(id, last_error, &held);
        if self.index.bytes + bytes > self.index.limits.memory_cap {
            self.index.not_kept += 1;
            return;
        }
        self.index.bytes += bytes;
        let (id, last_error, held) = match self.previous_holding(&held) {
            Some(old) => (
                old.id.clone(),
                old.last_error.clone(),
                Arc::clone(&old.held),
            ),
            None => (
                id.map(Into::into),
                last_error.map(Into::into),
                Arc::new(held),
            ),
        };
        let entry = Entry {
            pos,
            reason,
            parked_at,
            group,
            attempts: counter(headers, retry_core::headers::ATTEMPTS),
            key,
            id,
            last_error,
            held,
        };
        self.index.entries.push(entry);
    }

    fn group_for(
        &mut self,
        reason: ParkedReason,
        error: Option<&str>,
        id: Option<&str>,
        at: Option<Timestamp>,
    ) -> u32 {
        let fingerprint = error_fingerprint(error);
        let groups = &mut self.index.groups;
        let found = self.group_of.get(&(reason, fingerprint.clone())).copied();
        let n = match found {
            Some(n) => n,
            None if groups.len() < self.index.limits.max_groups => {
                let n = groups.len() as u32;
                self.index.bytes += size_of::<Group>()
                    + 2 * fingerprint.len()
                    + 16
                    + id.map_or(0, str::len)
                    + error.map_or(0, str::len);
                groups.push(Group {
                    key: group_key(reason, &fingerprint),
                    reason,
                    fingerprint: fingerprint.clone(),
                    overflow: false,
                    count: 0,
                    first_seen: None,
                    last_seen: None,
                    example_id: id.map(str::to_owned),
                    example_error: error.map(str::to_owned),
                });
                self.group_of.insert((reason, fingerprint), n);
                n
            }
            None => *self.overflow.get_or_insert_with(|| {
                groups.push(Group {
                    key: "other".into(),
                    reason: ParkedReason::Unknown,
                    fingerprint: String::new(),
                    overflow: true,
                    count: 0,
                    first_seen: None,
                    last_seen: None,
                    example_id: id.map(str::to_owned),
                    example_error: error.map(str::to_owned),
                });
                (groups.len() - 1) as u32
            }),
        };
        let group = &mut groups[n as usize];
        group.count += 1;
        if let Some(t) = at {
            group.first_seen = Some(group.first_seen.map_or(t, |f| f.min(t)));
            group.last_seen = Some(group.last_seen.map_or(t, |l| l.max(t)));
        }
        n
    }

    /// How many messages it has read so far.
    pub fn seen(&self) -> u64 {
        self.index.total
    }

    /// The finished index; the walk took `took`. Groups are sorted largest first, and the
    /// entries' group numbers follow.
    pub fn finish(mut self, took: Duration) -> Index {
        let index = &mut self.index;
        index.took = took;
        let mut order: Vec<usize> = (0..index.groups.len()).collect();
        order.sort_by(|&a, &b| {
            let (ga, gb) = (&index.groups[a], &index.groups[b]);
            gb.count
                .cmp(&ga.count)
                .then_with(|| ga.overflow.cmp(&gb.overflow))
                .then_with(|| ga.key.cmp(&gb.key))
        });
        let mut new_number = vec![0u32; order.len()];
        for (new, &old) in order.iter().enumerate() {
            new_number[old] = new as u32;
        }
        let mut groups: Vec<Option<Group>> = index.groups.drain(..).map(Some).collect();
        index.groups = order.iter().filter_map(|&old| groups[old].take()).collect();
        for entry in &mut index.entries {
            entry.group = new_number[entry.group as usize];
        }
        self.index
    }
}

/// How a list is ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Sort {
    /// Queue order.
    #[default]
    Position,
    /// By parking time (no time first).
    ParkedAt,
    /// By message id (no id first).
    Id,
    /// By reason.
    Reason,
    /// By attempts (none first).
    Attempts,
}

impl Sort {
    /// Every order, with its name in URLs.
    pub const ALL: [(Sort, &'static str); 5] = [
        (Sort::Position, "position"),
        (Sort::ParkedAt, "parked_at"),
        (Sort::Id, "id"),
        (Sort::Reason, "reason"),
        (Sort::Attempts, "attempts"),
    ];

    /// The order named `name`.
    pub fn parse(name: &str) -> Option<Sort> {
        Sort::ALL.iter().find(|(_, n)| *n == name).map(|(s, _)| *s)
    }

    /// Its name in URLs.
    pub fn name(self) -> &'static str {
        Sort::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map_or("position", |(_, n)| n)
    }
}

/// One page of a list.
#[derive(Debug)]
pub struct Page<'a> {
    /// The kept messages the filter matches, in all.
    pub matched: u64,
    /// This page's messages.
    pub entries: Vec<&'a Entry>,
}

impl Index {
    /// Whether `entry` matches `filter`, as a walk of the queue would find it.
    pub fn matches(&self, filter: &ParkedFilter, entry: &Entry) -> bool {
        let group = &self.groups[entry.group as usize];
        filter.matches_summary(&ParkedSummary {
            id: entry.id(),
            reason: entry.reason,
            parked_at: entry.parked_at,
            last_error: entry.last_error(),
            fingerprint: &group.fingerprint,
        })
    }

    /// The keys of the kept messages that `filter` matches, and, when `keys` names any,
    /// whose key is among them: the exact set a replay or purge of this selection takes.
    /// A key appears once for each message that has it.
    pub fn select(&self, filter: &ParkedFilter, keys: &[Key]) -> Vec<Key> {
        self.entries
            .iter()
            .filter(|e| keys.is_empty() || keys.contains(&e.key))
            .filter(|e| filter.is_all() || self.matches(filter, e))
            .map(|e| e.key)
            .collect()
    }

    /// The kept messages `filter` matches, ordered by `sort` (`descending` reverses it),
    /// `per_page` from `page` (from 0).
    pub fn page(
        &self,
        filter: &ParkedFilter,
        sort: Sort,
        descending: bool,
        page: usize,
        per_page: usize,
    ) -> Page<'_> {
        let mut hits: Vec<&Entry> = if filter.is_all() {
            self.entries.iter().collect()
        } else {
            self.entries
                .iter()
                .filter(|e| self.matches(filter, e))
                .collect()
        };
        let matched = hits.len() as u64;
        match sort {
            Sort::Position => {}
            Sort::ParkedAt => hits.sort_by_key(|e| e.parked_at),
            Sort::Id => hits.sort_by(|a, b| a.id().cmp(&b.id())),
            Sort::Reason => hits.sort_by_key(|e| e.reason.as_str()),
            Sort::Attempts => hits.sort_by_key(|e| e.attempts),
        }
        if descending {
            hits.reverse();
        }
        let entries = hits
            .into_iter()
            .skip(page.saturating_mul(per_page))
            .take(per_page)
            .collect();
        Page { matched, entries }
    }

    /// The kept messages with message id `id`, at position `pos`, and with key `key`
    /// (each condition when given).
    pub fn find(&self, id: Option<&str>, pos: Option<u64>, key: Option<Key>) -> Vec<&Entry> {
        self.entries
            .iter()
            .filter(|e| {
                id.is_none_or(|id| e.id() == Some(id))
                    && pos.is_none_or(|p| e.pos == p)
                    && key.is_none_or(|k| e.key == k)
            })
            .collect()
    }

    /// The group with key `key`.
    pub fn group(&self, key: &str) -> Option<&Group> {
        self.groups.iter().find(|g| g.key == key)
    }

    /// Parked messages over time: `bars` counts of equal spans from the oldest to the
    /// newest parking time (one bar when they are all in one minute), and each span's
    /// start.
    pub fn histogram(&self, bars: usize) -> Vec<(Timestamp, u64)> {
        let (Some(first), Some(last)) = (
            self.per_minute.keys().next(),
            self.per_minute.keys().next_back(),
        ) else {
            return Vec::new();
        };
        let minutes = last - first + 1;
        let bars = (bars.max(1) as u64).min(minutes);
        let span = minutes.div_ceil(bars);
        let mut out: Vec<(Timestamp, u64)> = (0..bars)
            .map(|i| (Timestamp::from_millis((first + i * span) * 60_000), 0))
            .collect();
        for (&minute, &n) in &self.per_minute {
            let bar = ((minute - first) / span) as usize;
            if let Some(slot) = out.get_mut(bar) {
                slot.1 += n;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use retry_core::{DeadLetterReason, MessageParts};

    use super::*;

    fn parked(id: &str, reason: &str, error: Option<&str>, at: i64, body: &[u8]) -> Message {
        let mut headers: Headers = [
            ("x-retry-reason", HeaderValue::from(reason)),
            ("x-retry-attempts", HeaderValue::Int(3)),
            ("x-retry-last-failure", HeaderValue::Int(at)),
        ]
        .into_iter()
        .collect();
        if let Some(e) = error {
            headers.insert("x-retry-last-error", e);
        }
        Message::new(MessageParts {
            properties: Properties {
                message_id: Some(id.into()),
                ..Properties::default()
            },
            headers,
            body: body.to_vec(),
            ..MessageParts::default()
        })
    }

    const T0: i64 = 1_796_117_400_000;

    fn build(messages: &[Message], limits: IndexLimits) -> Index {
        let mut b = IndexBuilder::new(limits, Timestamp::from_millis(0), None);
        for m in messages {
            b.add(m);
        }
        b.finish(Duration::ZERO)
    }

    #[test]
    fn messages_are_counted_and_grouped_by_reason_and_folded_error() {
        let index = build(
            &[
                parked("a", "permanent", Some("order 1 not found"), T0, b"a"),
                parked(
                    "b",
                    "permanent",
                    Some("order 22 not found"),
                    T0 + 60_000,
                    b"b",
                ),
                parked(
                    "c",
                    "attempts-exhausted",
                    Some("order 3 not found"),
                    T0,
                    b"c",
                ),
                parked("d", "attempts-exhausted", None, T0 + 120_000, b"d"),
            ],
            IndexLimits::default(),
        );
        assert_eq!(index.total, 4);
        assert_eq!(index.entries.len(), 4);
        assert_eq!(index.by_reason["permanent"], 2);
        assert_eq!(index.groups.len(), 3);
        let top = &index.groups[0];
        assert_eq!(
            (top.count, top.fingerprint.as_str()),
            (2, "order <n> not found")
        );
        assert_eq!(top.first_seen, Some(Timestamp::from_millis(T0 as u64)));
        assert_eq!(
            top.last_seen,
            Some(Timestamp::from_millis(T0 as u64 + 60_000))
        );
        assert_eq!(top.example_error.as_deref(), Some("order 1 not found"));
        // The group's filter selects its messages, as it would on the queue.
        let filter = top.filter().unwrap();
        let ids: Vec<_> = index
            .page(&filter, Sort::Position, false, 0, 10)
            .entries
            .iter()
            .map(|e| e.id().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(
            index
                .select(&ParkedFilter::all().with_error_group(""), &[])
                .len(),
            1
        );
        assert_eq!(
            index
                .select(
                    &ParkedFilter::reason(ParkedReason::Known(DeadLetterReason::AttemptsExhausted)),
                    &[]
                )
                .len(),
            2
        );
        assert_eq!(index.oldest, Some(Timestamp::from_millis(T0 as u64)));
        assert_eq!(
            index.newest,
            Some(Timestamp::from_millis(T0 as u64 + 120_000))
        );
        assert_eq!(
            index.histogram(60).iter().map(|b| b.1).collect::<Vec<_>>(),
            [2, 1, 1]
        );
        assert_eq!(
            index.histogram(2).iter().map(|b| b.1).collect::<Vec<_>>(),
            [3, 1]
        );
    }

    #[test]
    fn what_does_not_fit_the_cap_is_counted_not_kept() {
        let body = vec![b'x'; 10_000];
        let messages: Vec<_> = (0..100)
            .map(|i| parked(&format!("m{i}"), "permanent", Some("boom"), T0, &body))
            .collect();
        let limits = IndexLimits {
            memory_cap: 20_000,
            preview_bytes: 1000,
            max_groups: 10,
        };
        let index = build(&messages, limits);
        assert_eq!(index.total, 100);
        assert!(index.bytes <= limits.memory_cap, "{}", index.bytes);
        assert!(!index.entries.is_empty() && index.entries.len() < 100);
        assert_eq!(index.entries.len() as u64 + index.not_kept, 100);
        assert!(
            index
                .entries
                .iter()
                .all(|e| e.preview().len() == 1000 && e.body_len() == 10_000)
        );
        // Counts cover every message, kept or not.
        assert_eq!(index.groups[0].count, 100);
    }

    #[test]
    fn groups_beyond_the_limit_are_counted_together() {
        let messages: Vec<_> = (0..5)
            .map(|i| {
                parked(
                    "m",
                    "permanent",
                    Some(&format!("error kind {}", "x".repeat(i))),
                    T0,
                    b"",
                )
            })
            .collect();
        let limits = IndexLimits {
            max_groups: 2,
            ..IndexLimits::default()
        };
        let index = build(&messages, limits);
        assert_eq!(index.groups.len(), 3);
        let other = index.groups.iter().find(|g| g.overflow).unwrap();
        assert_eq!(other.count, 3);
        assert!(other.filter().is_none());
    }

    #[test]
    fn a_rebuilt_index_shares_what_an_unchanged_message_holds() {
        let first = build(
            &[
                parked("a", "permanent", Some("boom"), T0, b"same"),
                parked("b", "permanent", Some("boom"), T0, b"before"),
            ],
            IndexLimits::default(),
        );
        let mut b = IndexBuilder::new(
            IndexLimits::default(),
            Timestamp::from_millis(1),
            Some(&first),
        );
        // Read again: a unchanged but now second, b changed, c new.
        b.add(&parked("c", "permanent", Some("boom"), T0, b"new"));
        b.add(&parked("a", "permanent", Some("boom"), T0, b"same"));
        b.add(&parked("b", "permanent", Some("boom"), T0, b"after"));
        let second = b.finish(Duration::ZERO);
        let shared =
            |i: usize, j: usize| Arc::ptr_eq(&first.entries[i].held, &second.entries[j].held);
        assert!(shared(0, 1), "a is shared");
        assert!(!shared(1, 2), "b changed");
        assert_eq!(second.entries[1].pos, 1);
        assert_eq!(second.entries[2].preview(), b"after");
        // Shared or not, every entry counts in full against the cap.
        assert!(second.bytes > first.bytes);
    }

    #[test]
    fn a_key_names_the_bytes_of_one_message_whatever_its_place_or_redeliveries() {
        let a = parked("same-id", "permanent", Some("boom"), T0, b"one");
        let b = parked("same-id", "permanent", Some("boom"), T0, b"two");
        let later = parked("same-id", "permanent", Some("boom"), T0 + 1, b"one");
        assert_ne!(
            Key::of(&a),
            Key::of(&b),
            "ids repeat: the body tells them apart"
        );
        assert_ne!(
            Key::of(&a),
            Key::of(&later),
            "so does the time it was parked"
        );
        let mut redelivered = a.parts().clone();
        redelivered
            .headers
            .insert(REDELIVERIES, HeaderValue::Int(4));
        assert_eq!(Key::of(&Message::new(redelivered)), Key::of(&a));
        assert_eq!(Key::parse(&Key::of(&a).hex()), Some(Key::of(&a)));
        assert_eq!(Key::parse("zz"), None);
        assert_eq!(Key::parse(&"g".repeat(32)), None);
        // The index computes the same key as a walk does, and selects by it.
        let index = build(&[a.clone(), b.clone(), a.clone()], IndexLimits::default());
        assert_eq!(index.entries[0].key, Key::of(&a));
        assert_eq!(
            index.select(&ParkedFilter::all(), &[Key::of(&a)]),
            [Key::of(&a), Key::of(&a)],
            "a key is selected once for each message that has it"
        );
        assert_eq!(index.select(&ParkedFilter::ids(["same-id"]), &[]).len(), 3);
    }

    #[test]
    fn a_page_is_sorted_and_cut() {
        let index = build(
            &[
                parked("b", "permanent", None, T0 + 2, b""),
                parked("c", "permanent", None, T0 + 1, b""),
                parked("a", "permanent", None, T0 + 3, b""),
            ],
            IndexLimits::default(),
        );
        let ids = |sort, desc, page, per| -> Vec<String> {
            index
                .page(&ParkedFilter::all(), sort, desc, page, per)
                .entries
                .iter()
                .map(|e| e.id().unwrap().to_owned())
                .collect()
        };
        assert_eq!(ids(Sort::Position, false, 0, 10), ["b", "c", "a"]);
        assert_eq!(ids(Sort::Id, false, 0, 10), ["a", "b", "c"]);
        assert_eq!(ids(Sort::ParkedAt, true, 0, 10), ["a", "b", "c"]);
        assert_eq!(ids(Sort::ParkedAt, false, 1, 2), ["a"]);
        assert_eq!(ids(Sort::Id, false, 5, 2), Vec::<String>::new());
        assert_eq!(index.find(Some("c"), None, None)[0].pos, 1);
        assert_eq!(Sort::parse("parked_at"), Some(Sort::ParkedAt));
        assert_eq!(Sort::parse("nope"), None);
    }
}
