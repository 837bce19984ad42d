//! The Redis names of one lock: its key, its fencing counter, its release
//! channel and its waiting line, all in one hash slot.

use dlock_core::LockKey;

/// The names one lock uses on the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    /// Holds the owner token, with the lease as its TTL.
    pub(crate) lock: String,
    /// Counts acquisitions: the fencing token. Lives twice the lease past
    /// the last acquisition or renewal, and is seeded from the server's
    /// clock when missing, so that tokens keep growing across idle periods
    /// (see `scripts.rs`).
    pub(crate) fence: String,
    /// Where a release is published: the message is the token of the
    /// first waiter in line.
    pub(crate) channel: String,
    /// The waiting line: tickets scored by place (see `scripts.rs`).
    pub(crate) queue: String,
    /// When each ticket in line lapses unless its waiter refreshes it.
    pub(crate) tickets: String,
}

/// The names of `key` under `prefix`.
///
/// The escaped key is the hash tag (`{...}`), so every name shares a
/// slot on Redis Cluster. Escaping `%`, `{` and `}` keeps the tag intact
/// whatever the key contains, and is one-to-one, so two keys never share a
/// lock. Everything else (spaces, unicode, NUL) is stored as it is: Redis
/// keys are binary-safe.
pub(crate) fn names(prefix: &str, key: &LockKey) -> Names {
    // Built by hand, not with `format!`: this runs twice per lock and
    // release, and formatting was a visible share of the client's time.
    let key = key.as_str();
    let mut lock = String::with_capacity(prefix.len() + key.len() + 3);
    lock.push_str(prefix);
    lock.push_str(":{");
    for c in key.chars() {
        match c {
            '%' => lock.push_str("%25"),
            '{' => lock.push_str("%7B"),
            '}' => lock.push_str("%7D"),
            c => lock.push(c),
        }
    }
    lock.push('}');
    let with_suffix = |suffix: &str| {
        let mut name = String::with_capacity(lock.len() + suffix.len());
        name.push_str(&lock);
        name.push_str(suffix);
        name
    };
    Names {
        fence: with_suffix(":fence"),
        channel: with_suffix(":released"),
        queue: with_suffix(":queue"),
        tickets: with_suffix(":tickets"),
        lock,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lock(key: &str) -> String {
        names("dlock", &LockKey::new(key).unwrap()).lock
    }

    /// The part Redis Cluster hashes: between the first `{` and the next `}`.
    fn hash_tag(name: &str) -> &str {
        let open = name.find('{').unwrap();
        let close = open + name[open..].find('}').unwrap();
        &name[open + 1..close]
    }

    #[test]
    fn all_names_share_the_hash_tag() {
        let n = names("dlock", &LockKey::new("order:{42}").unwrap());
        assert_eq!(hash_tag(&n.lock), "order:%7B42%7D");
        assert_eq!(hash_tag(&n.fence), hash_tag(&n.lock));
        assert_eq!(hash_tag(&n.channel), hash_tag(&n.lock));
        assert_eq!(hash_tag(&n.queue), hash_tag(&n.lock));
        assert_eq!(hash_tag(&n.tickets), hash_tag(&n.lock));
    }

    #[test]
    fn escaping_is_one_to_one() {
        let keys = [
            "a{b}", "a%7Bb%7D", "a%b", "a%25b", "{", "}", "%", "a b", "ключ",
        ];
        let mut seen = std::collections::HashSet::new();
        for k in keys {
            assert!(seen.insert(lock(k)), "{k} collides");
        }
    }
}
