//! What the transports share about broker URLs: how a password is hidden, and why a list of
//! nodes cannot be used.

/// What a URL's password is replaced by wherever a transport shows the URL: logs, errors,
/// `Debug` output.
pub const PASSWORD_MASK: &str = "****";

/// `url` with the password of its user-info replaced by [`PASSWORD_MASK`], without parsing
/// it (so a URL that does not parse is redacted too): everything between the first `:` after
/// `//` and the last `@` before the path. A URL without a password is returned as it is.
///
/// ```
/// use retry_core::redact_url;
///
/// assert_eq!(
///     redact_url("amqp://app:s3cret@10.0.0.1:5672/%2f"),
///     "amqp://app:****@10.0.0.1:5672/%2f"
/// );
/// assert_eq!(redact_url("amqps://u:a@b@host"), "amqps://u:****@host");
/// assert_eq!(redact_url("amqp://app@host"), "amqp://app@host");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some(rest_start) = url.find("//").map(|i| i + 2) else {
        return url.to_owned();
    };
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return url.to_owned();
    };
    format!(
        "{}{}:{PASSWORD_MASK}{}",
        &url[..rest_start],
        &userinfo[..colon],
        &rest[at..]
    )
}

/// Why the broker URL, or the list of a cluster's node URLs, a transport was given cannot be
/// used. A single URL is a list of one node.
///
/// Every message names the node at fault, its password replaced by [`PASSWORD_MASK`]. Not
/// every transport finds every fault: one that moves a connection between nodes with one
/// handshake (transport-amqp091) needs the nodes to agree ([`Differs`](Self::Differs)), to
/// be distinct ([`Duplicate`](Self::Duplicate)) and of one cluster
/// ([`DifferentClusters`](Self::DifferentClusters)); one that connects to each node on its
/// own terms (transport-amqp10) does not.
///
/// ```
/// use retry_core::NodeListError;
///
/// let err = NodeListError::UnsupportedScheme {
///     position: 2,
///     node: "http://app:****@10.0.0.2".into(),
///     scheme: "http".into(),
/// };
/// assert_eq!(
///     err.to_string(),
///     "node 2 of the list (http://app:****@10.0.0.2): the scheme must be amqp or amqps, not \"http\""
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NodeListError {
    /// No node at all: an empty list, or a URL string with nothing between its commas (on
    /// transport-amqp10 also an empty URL in a list given one URL each; transport-amqp091
    /// reports that one as [`Invalid`](Self::Invalid) at its position).
    #[error(
        "the node list is empty or has an empty URL: give at least one amqp:// or amqps:// URL"
    )]
    Empty,
    /// A node that is not an AMQP URL: it does not parse, names no host, or its user or
    /// password is not valid percent-encoded UTF-8.
    #[error("node {position} of the list ({node}) is not an AMQP URL: {reason}")]
    Invalid {
        /// Its place in the list, from 1.
        position: usize,
        /// The node as given, password redacted.
        node: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A node whose scheme is neither `amqp` nor `amqps`.
    #[error(
        "node {position} of the list ({node}): the scheme must be amqp or amqps, not {scheme:?}"
    )]
    UnsupportedScheme {
        /// Its place in the list, from 1.
        position: usize,
        /// The node as given, password redacted.
        node: String,
        /// The scheme given.
        scheme: String,
    },
    /// A node reached differently from the first: another scheme, user, password, virtual
    /// host or URL option. One connection's recovery moves between the nodes with one
    /// handshake, so they must agree.
    #[error(
        "node {position} of the list ({node}) has another {field} than node 1 ({first}): every node is reached with the same scheme, user, password, virtual host and options"
    )]
    Differs {
        /// Its place in the list, from 1.
        position: usize,
        /// The node, password redacted.
        node: String,
        /// The first node, password redacted.
        first: String,
        /// What differs: `scheme`, `user`, `password`, `virtual host` or `options`.
        field: &'static str,
    },
    /// The same node twice.
    #[error("node {node} is in the list twice")]
    Duplicate {
        /// The node, password redacted.
        node: String,
    },
    /// Two nodes that answered with different cluster names: the list mixes clusters.
    #[error(
        "{node} belongs to cluster {cluster:?} but {first} to {first_cluster:?}: a node list names the nodes of one cluster"
    )]
    DifferentClusters {
        /// The node seen first, password redacted.
        first: String,
        /// Its cluster name.
        first_cluster: String,
        /// The node of the other cluster, password redacted.
        node: String,
        /// Its cluster name.
        cluster: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        let table = [
            (
                "amqp://guest:guest@127.0.0.1:5672/%2f",
                "amqp://guest:****@127.0.0.1:5672/%2f",
            ),
            (
                "amqps://u:p%40ss@host/vh?heartbeat=5",
                "amqps://u:****@host/vh?heartbeat=5",
            ),
            ("amqp://u:a@b@host", "amqp://u:****@host"),
            ("amqp://u:p:q@h/x@y", "amqp://u:****@h/x@y"),
            ("amqp://127.0.0.1", "amqp://127.0.0.1"),
            ("amqp://h/v", "amqp://h/v"),
            ("amqp://user@host", "amqp://user@host"),
            ("not a url", "not a url"),
            ("no-scheme", "no-scheme"),
        ];
        for (url, want) in table {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn messages_name_the_node_without_its_password() {
        let node = redact_url("amqp://app:s3cret@h2/%2f");
        let errors = [
            NodeListError::Invalid {
                position: 2,
                node: node.clone(),
                reason: "empty host".into(),
            },
            NodeListError::UnsupportedScheme {
                position: 2,
                node: node.clone(),
                scheme: "http".into(),
            },
            NodeListError::Duplicate { node: node.clone() },
        ];
        for err in errors {
            let shown = err.to_string();
            assert!(shown.contains("amqp://app:****@h2/%2f"), "{shown}");
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }
}
