//! A node list: the URLs as given, each with its place in the list and its address with the
//! password redacted; the order the nodes are tried in.

use std::fmt;

use retry_core::{NodeListError, redact_url};

/// The URLs of the nodes a transport may connect to, as given: trimmed, in order.
///
/// [`new`](Self::new) reads a comma-separated string and leaves out empty pieces (a
/// trailing comma is harmless); [`from_urls`](Self::from_urls) takes one URL each and keeps
/// every one, so that a transport can refuse an empty URL at its place. Nothing is parsed
/// until [`parse_with`](Self::parse_with), which hands each URL to the transport's parser.
///
/// `Debug` and [`redacted`](Self::redacted) never show a password.
///
/// ```
/// use transport_kit::settings::NodeList;
///
/// let list = NodeList::new(" amqp://u:s3cret@h1:5672 ,, amqp://u:s3cret@h2:5672,");
/// assert_eq!(list.len(), 2);
/// assert_eq!(list.redacted(), "amqp://u:****@h1:5672,amqp://u:****@h2:5672");
/// assert!(!format!("{list:?}").contains("s3cret"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct NodeList {
    urls: Vec<String>,
}

impl NodeList {
    /// The nodes of `urls`, one URL or several separated by commas: each trimmed, empty
    /// pieces left out.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// assert_eq!(NodeList::new("amqp://h1, amqp://h2,,").len(), 2);
    /// assert!(NodeList::new(" , ").is_empty());
    /// ```
    pub fn new(urls: &str) -> Self {
        NodeList {
            urls: urls
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(str::to_owned)
                .collect(),
        }
    }

    /// The nodes `urls`, one URL each, each trimmed; an empty one is kept at its place, for
    /// the transport's parser to refuse.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::from_urls(["amqp://h1", " "]);
    /// assert_eq!(list.len(), 2);
    /// assert_eq!(list.urls().nth(1).unwrap().url(), "");
    /// ```
    pub fn from_urls<I>(urls: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        NodeList {
            urls: urls
                .into_iter()
                .map(|u| u.as_ref().trim().to_owned())
                .collect(),
        }
    }

    /// How many URLs there are.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// assert_eq!(NodeList::new("amqp://h1,amqp://h2").len(), 2);
    /// ```
    pub fn len(&self) -> usize {
        self.urls.len()
    }

    /// Whether there is no URL at all.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// assert!(NodeList::new("").is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// The URLs, in order, each with its place in the list (from 1).
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("amqp://h1,amqp://u:pw@h2");
    /// let second = list.urls().nth(1).unwrap();
    /// assert_eq!((second.position(), second.redacted().as_str()), (2, "amqp://u:****@h2"));
    /// ```
    pub fn urls(&self) -> impl ExactSizeIterator<Item = NodeUrl<'_>> {
        self.urls.iter().enumerate().map(|(i, url)| NodeUrl {
            position: i + 1,
            url,
        })
    }

    /// Every URL with its password replaced by `****`
    /// ([`PASSWORD_MASK`](retry_core::PASSWORD_MASK)), separated by commas.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("nats://a:pw@h1:4222,nats://h2:4222");
    /// assert_eq!(list.redacted(), "nats://a:****@h1:4222,nats://h2:4222");
    /// ```
    pub fn redacted(&self) -> String {
        self.urls
            .iter()
            .map(|u| redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Parses every URL with `parse`, in order, stopping at the first refusal: the nodes, or
    /// the [`NodeListError`] of the first node that cannot be used, or
    /// [`NodeListError::Empty`] for a list without a URL. `parse` is given each URL and the
    /// nodes parsed before it, to compare it with them (the same node twice, a node that
    /// disagrees with the first); [`NodeUrl::invalid`] and [`NodeUrl::check_scheme`] word
    /// its refusals, naming the node with its password redacted.
    ///
    /// ```
    /// use retry_core::NodeListError;
    /// use transport_kit::settings::NodeList;
    ///
    /// // A parser of `scheme://host:port` URLs that refuses the same port twice.
    /// let ports = |list: &NodeList| {
    ///     list.parse_with(|node, before: &[u16]| {
    ///         node.check_scheme(&["tcp"])?;
    ///         let port = node
    ///             .url()
    ///             .rsplit_once(':')
    ///             .and_then(|(_, p)| p.parse::<u16>().ok())
    ///             .ok_or_else(|| node.invalid("no port"))?;
    ///         if before.contains(&port) {
    ///             return Err(NodeListError::Duplicate { node: node.redacted() });
    ///         }
    ///         Ok(port)
    ///     })
    /// };
    /// assert_eq!(ports(&NodeList::new("tcp://h1:1, tcp://h2:2")), Ok(vec![1, 2]));
    /// assert_eq!(ports(&NodeList::new("")), Err(NodeListError::Empty));
    /// let err = ports(&NodeList::new("tcp://h1:1,udp://u:s3cret@h2:2")).unwrap_err();
    /// assert_eq!(
    ///     err,
    ///     NodeListError::UnsupportedScheme {
    ///         position: 2,
    ///         node: "udp://u:****@h2:2".into(),
    ///         scheme: "udp".into(),
    ///     }
    /// );
    /// assert!(matches!(
    ///     ports(&NodeList::new("tcp://h1:1,tcp://h2:1")),
    ///     Err(NodeListError::Duplicate { node }) if node == "tcp://h2:1"
    /// ));
    /// ```
    pub fn parse_with<N>(
        &self,
        mut parse: impl FnMut(NodeUrl<'_>, &[N]) -> Result<N, NodeListError>,
    ) -> Result<Vec<N>, NodeListError> {
        let mut nodes = Vec::with_capacity(self.urls.len());
        for url in self.urls() {
            let node = parse(url, &nodes)?;
            nodes.push(node);
        }
        if nodes.is_empty() {
            return Err(NodeListError::Empty);
        }
        Ok(nodes)
    }
}

impl fmt::Debug for NodeList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.urls.iter().map(|u| redact_url(u)))
            .finish()
    }
}

/// One URL of a [`NodeList`], with its place in the list.
///
/// `Debug` shows the place and the URL with its password redacted.
///
/// ```
/// use transport_kit::settings::NodeList;
///
/// let list = NodeList::new("amqp://app:s3cret@h1:5672");
/// let node = list.urls().next().unwrap();
/// assert_eq!(node.position(), 1);
/// assert_eq!(node.url(), "amqp://app:s3cret@h1:5672");
/// assert!(!format!("{node:?}").contains("s3cret"));
/// ```
#[derive(Clone, Copy)]
pub struct NodeUrl<'a> {
    position: usize,
    url: &'a str,
}

impl<'a> NodeUrl<'a> {
    /// Its place in the list, from 1.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("amqp://h1,amqp://h2");
    /// assert_eq!(list.urls().last().unwrap().position(), 2);
    /// ```
    pub fn position(&self) -> usize {
        self.position
    }

    /// The URL as given, password included: for the broker client's parser, never for a
    /// log line or an error ([`redacted`](Self::redacted) is for those).
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new(" amqp://h1 ");
    /// assert_eq!(list.urls().next().unwrap().url(), "amqp://h1");
    /// ```
    pub fn url(&self) -> &'a str {
        self.url
    }

    /// The URL with its password replaced by `****`.
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("amqp://u:pw@h1");
    /// assert_eq!(list.urls().next().unwrap().redacted(), "amqp://u:****@h1");
    /// ```
    pub fn redacted(&self) -> String {
        redact_url(self.url)
    }

    /// The URL's scheme, in lower case: what stands before `://`. `None` for a URL without
    /// one (`h1:5672`).
    ///
    /// ```
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("AMQPS://h1,h2:4222");
    /// let schemes: Vec<_> = list.urls().map(|n| n.scheme()).collect();
    /// assert_eq!(schemes, [Some("amqps".to_owned()), None]);
    /// ```
    pub fn scheme(&self) -> Option<String> {
        let (scheme, rest) = self.url.split_once(':')?;
        rest.starts_with("//").then(|| scheme.to_ascii_lowercase())
    }

    /// Refuses a scheme other than those `accepted` (lower case) with
    /// [`NodeListError::UnsupportedScheme`]. A URL without a scheme passes: the parser
    /// decides.
    ///
    /// ```
    /// use retry_core::NodeListError;
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("amqps://h1,HTTP://u:pw@h2,h3:5672");
    /// let checked: Vec<_> = list.urls().map(|n| n.check_scheme(&["amqp", "amqps"])).collect();
    /// assert_eq!(checked[0], Ok(()));
    /// assert_eq!(
    ///     checked[1],
    ///     Err(NodeListError::UnsupportedScheme {
    ///         position: 2,
    ///         node: "HTTP://u:****@h2".into(),
    ///         scheme: "http".into(),
    ///     })
    /// );
    /// assert_eq!(checked[2], Ok(()));
    /// ```
    pub fn check_scheme(&self, accepted: &[&str]) -> Result<(), NodeListError> {
        match self.scheme() {
            Some(scheme) if !accepted.contains(&scheme.as_str()) => {
                Err(NodeListError::UnsupportedScheme {
                    position: self.position,
                    node: self.redacted(),
                    scheme,
                })
            }
            _ => Ok(()),
        }
    }

    /// The refusal of this URL for `reason` ([`NodeListError::Invalid`]), naming it with its
    /// place and its password redacted. `reason` must not quote the URL.
    ///
    /// ```
    /// use retry_core::NodeListError;
    /// use transport_kit::settings::NodeList;
    ///
    /// let list = NodeList::new("amqp://u:s3cret@");
    /// let err = list.urls().next().unwrap().invalid("it names no host");
    /// assert_eq!(
    ///     err,
    ///     NodeListError::Invalid {
    ///         position: 1,
    ///         node: "amqp://u:****@".into(),
    ///         reason: "it names no host".into(),
    ///     }
    /// );
    /// ```
    pub fn invalid(&self, reason: impl Into<String>) -> NodeListError {
        NodeListError::Invalid {
            position: self.position,
            node: self.redacted(),
            reason: reason.into(),
        }
    }
}

impl fmt::Debug for NodeUrl<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeUrl")
            .field("position", &self.position)
            .field("url", &self.redacted())
            .finish()
    }
}

/// The order the nodes of a list are tried in.
///
/// ```
/// use transport_kit::settings::{ConnectionSettings, NodeOrder};
///
/// let settings = ConnectionSettings::new("amqp://app:s3cret@10.0.0.1:5672/%2f,amqp://app:s3cret@10.0.0.2:5672/%2f")
///     .with_node_order(NodeOrder::Shuffled);
/// assert_eq!(settings.node_order(), NodeOrder::Shuffled);
/// assert_eq!(NodeOrder::default(), NodeOrder::InOrder);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NodeOrder {
    /// In the order given: the first node that answers, the others only while it is down.
    #[default]
    InOrder,
    /// Shuffled, so that many consumers with the same list spread over the nodes.
    Shuffled,
}

impl NodeOrder {
    /// The places (from 0) of `n` nodes in the order to try them in: `0..n`, or a
    /// permutation of it drawn from the process's random hasher keys.
    ///
    /// ```
    /// use transport_kit::settings::NodeOrder;
    ///
    /// assert_eq!(NodeOrder::InOrder.arrange(3), [0, 1, 2]);
    /// let mut shuffled = NodeOrder::Shuffled.arrange(3);
    /// shuffled.sort_unstable();
    /// assert_eq!(shuffled, [0, 1, 2]);
    /// ```
    pub fn arrange(self, n: usize) -> Vec<usize> {
        match self {
            NodeOrder::InOrder => (0..n).collect(),
            NodeOrder::Shuffled => shuffled(n),
        }
    }
}

/// A permutation of `0..n` from the process's random hasher keys (no random-number crate).
fn shuffled(n: usize) -> Vec<usize> {
    use std::hash::{BuildHasher, Hasher};
    let mut order: Vec<usize> = (0..n).collect();
    let seed = std::collections::hash_map::RandomState::new();
    for i in (1..n).rev() {
        let mut h = seed.build_hasher();
        h.write_usize(i);
        let j = (h.finish() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parser that takes the host and port of `amqp://user:password@host:port/...`, as a
    /// transport's parser would, and refuses what has no host.
    fn hosts(list: &NodeList) -> Result<Vec<(String, u16)>, NodeListError> {
        list.parse_with(|node, _: &[(String, u16)]| {
            node.check_scheme(&["amqp", "amqps"])?;
            let rest = node
                .url()
                .split_once("://")
                .map(|(_, rest)| rest)
                .ok_or_else(|| node.invalid("it has no scheme"))?;
            let authority = rest.split('/').next().unwrap_or_default();
            let host_port = authority.rsplit('@').next().unwrap_or_default();
            let (host, port) = match host_port.split_once(':') {
                Some((h, p)) => (h, p.parse().map_err(|_| node.invalid("a bad port"))?),
                None => (host_port, 5672),
            };
            if host.is_empty() {
                return Err(node.invalid("it names no host"));
            }
            Ok((host.to_owned(), port))
        })
    }

    #[test]
    fn a_list_is_split_trimmed_and_numbered_without_its_empty_pieces() {
        let list =
            NodeList::new("amqp://u:p@h1:5672/%2f, amqp://u:p@h2:5673/%2f,,amqp://u:p@h3/%2f");
        assert_eq!(
            hosts(&list).unwrap(),
            [
                ("h1".into(), 5672),
                ("h2".into(), 5673),
                ("h3".into(), 5672)
            ]
        );
        let second = list.urls().nth(1).unwrap();
        assert_eq!(second.redacted(), "amqp://u:****@h2:5673/%2f");
        assert_eq!(second.position(), 2);
        let places: Vec<usize> = list.urls().map(|n| n.position()).collect();
        assert_eq!(places, [1, 2, 3], "the empty piece takes no place");
        assert_eq!(
            hosts(&NodeList::new(" , ")).unwrap_err(),
            NodeListError::Empty
        );
        assert_eq!(
            hosts(&NodeList::from_urls(Vec::<String>::new())).unwrap_err(),
            NodeListError::Empty
        );
    }

    #[test]
    fn every_refusal_names_its_node_by_place_without_the_password() {
        let err = hosts(&NodeList::new(
            "amqp://u:secret@h1/%2f,amqp://u:secret@:5672",
        ))
        .unwrap_err();
        assert_eq!(
            err,
            NodeListError::Invalid {
                position: 2,
                node: "amqp://u:****@:5672".into(),
                reason: "it names no host".into(),
            }
        );
        assert!(!err.to_string().contains("secret"), "{err}");
        let err = hosts(&NodeList::new(
            "amqp://u:secret@h1/%2f,HTTP://u:secret@h2/%2f",
        ))
        .unwrap_err();
        assert_eq!(
            err,
            NodeListError::UnsupportedScheme {
                position: 2,
                node: "HTTP://u:****@h2/%2f".into(),
                scheme: "http".into(),
            }
        );
        assert!(!err.to_string().contains("secret"), "{err}");
        // A URL without a scheme is the parser's to refuse.
        let err = hosts(&NodeList::new("amqp://u:secret@h1/%2f,h2:5672")).unwrap_err();
        assert!(
            matches!(err, NodeListError::Invalid { position: 2, .. }),
            "{err:?}"
        );
        // One URL each: an empty one keeps its place, and is the parser's to refuse.
        let err = hosts(&NodeList::from_urls(["amqp://h1", " ", "amqp://h3"])).unwrap_err();
        assert!(
            matches!(err, NodeListError::Invalid { position: 2, ref node, .. } if node.is_empty()),
            "{err:?}"
        );
    }

    #[test]
    fn parsing_stops_at_the_first_refusal_and_sees_the_nodes_before() {
        let mut seen = Vec::new();
        let err = NodeList::new("a://1,a://2,a://3,a://4")
            .parse_with(|node, before: &[usize]| {
                seen.push(before.len());
                if node.position() == 3 {
                    return Err(node.invalid("the third"));
                }
                Ok(node.position())
            })
            .unwrap_err();
        assert!(matches!(err, NodeListError::Invalid { position: 3, .. }));
        assert_eq!(seen, [0, 1, 2]);
    }

    #[test]
    fn debug_never_shows_a_password() {
        let list = NodeList::from_urls(["amqp://u:hunter2@h1", "nats://v:hunter2@h2"]);
        let node = list.urls().next().unwrap();
        for shown in [format!("{list:?}"), format!("{node:?}"), list.redacted()] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
    }

    #[test]
    fn a_shuffle_is_a_permutation() {
        for n in 0..6 {
            let mut order = shuffled(n);
            order.sort_unstable();
            assert_eq!(order, (0..n).collect::<Vec<_>>());
            assert_eq!(NodeOrder::InOrder.arrange(n), (0..n).collect::<Vec<_>>());
        }
    }
}
