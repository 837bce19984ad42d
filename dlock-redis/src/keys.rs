//! The Redis names of one lock: its key, its fencing counter, its release
//! channel and its waiting line, all in one hash slot.

use std::{fmt, io::Write};

use dlock_core::{backend::Mode, LockKey, Token};
use redis::{RedisWrite, ToRedisArgs};

/// The names one lock uses on the server: its key, and the names made
/// from it by a suffix, written straight into a command's arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    /// Holds the owner token, with the lease as its TTL.
    pub(crate) lock: String,
}

impl Names {
    /// The fence counter (see `fence_lua!`).
    pub(crate) fn fence(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":fence")
    }

    /// Where a release publishes the token of the first waiter in line.
    pub(crate) fn channel(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":released")
    }

    /// Where a proclaim, and the release of a proclaimed hold, publish.
    pub(crate) fn holder_channel(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":holder")
    }

    /// The waiting line: tickets scored by place (see `queue_lua!`).
    pub(crate) fn queue(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":queue")
    }

    /// What the holder proclaimed: its token, `|`, and the value.
    pub(crate) fn value(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":value")
    }

    /// The last release's token, so that the release sent again succeeds.
    pub(crate) fn released_by(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":released_by")
    }

    /// When each ticket in line lapses unless its waiter refreshes it.
    pub(crate) fn tickets(&self) -> Suffixed<'_> {
        Suffixed(&self.lock, ":tickets")
    }
}

/// A lock's name with a suffix: one command argument, with no string of
/// its own.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Suffixed<'a>(&'a str, &'static str);

impl fmt::Display for Suffixed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)?;
        f.write_str(self.1)
    }
}

impl ToRedisArgs for Suffixed<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + RedisWrite,
    {
        let mut arg = out.writer_for_next_arg();
        // Writing to a command's buffer cannot fail.
        let _ = arg.write_all(self.0.as_bytes());
        let _ = arg.write_all(self.1.as_bytes());
    }
}

/// The names of `key` under `prefix`. The escaped key is the hash tag
/// (`{...}`), so every name shares a slot on Redis Cluster; escaping `%`,
/// `{` and `}` keeps the tag intact and is one-to-one. Everything else is
/// stored as it is: Redis keys are binary-safe.
pub(crate) fn names(prefix: &str, key: &LockKey) -> Names {
    // By hand, not `format!`: this runs at every lock and release.
    let mut lock = String::with_capacity(prefix.len() + key.as_str().len() + 3);
    lock.push_str(prefix);
    lock.push_str(":{");
    key.escape_into(&mut lock, |c| c == '{' || c == '}');
    lock.push('}');
    Names { lock }
}

/// The names of `key`'s read-write lock (`mode` a reader or writer) or
/// semaphore (permits): the plain lock's with `:rw` or `:sem`, in the same
/// slot. Their "lock" is the sorted set of holders (see `shared_lua!`).
pub(crate) fn shared_names(prefix: &str, key: &LockKey, mode: Mode) -> Names {
    let mut names = names(prefix, key);
    names.lock.push_str(match mode {
        Mode::Permits { .. } => ":sem",
        _ => ":rw",
    });
    names
}

/// What a read-write lock's or semaphore's holder or waiter is called on
/// the server: its token, `|`, and what it takes (`r`, `w`, or
/// `p{count}/{limit}`), so the scripts can admit it without another read.
pub(crate) fn entry(token: &Token, mode: Mode) -> String {
    format!("{token}|{}", mode.tag())
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
        for other in [n.fence(), n.channel(), n.queue(), n.tickets()] {
            assert_eq!(hash_tag(&other.to_string()), hash_tag(&n.lock));
        }
    }

    #[test]
    fn a_suffixed_name_is_one_argument_with_the_suffix() {
        let n = names("dlock", &LockKey::new("k").unwrap());
        assert_eq!(n.queue().to_redis_args(), [b"dlock:{k}:queue".to_vec()]);
        assert_eq!(n.fence().to_string(), "dlock:{k}:fence");
    }

    /// The names keys had before the codec moved into core: a key's name
    /// on the server must never change.
    #[test]
    fn names_are_byte_for_byte_the_same_as_before() {
        for (key, name) in [
            ("order:42", "dlock:{order:42}"),
            ("a/b", "dlock:{a/b}"),
            ("a%b", "dlock:{a%25b}"),
            ("{x}", "dlock:{%7Bx%7D}"),
            ("ключ", "dlock:{ключ}"),
            ("tab\there", "dlock:{tab\there}"),
            ("nul\0", "dlock:{nul\0}"),
            ("\u{85}", "dlock:{\u{85}}"),
            ("..", "dlock:{..}"),
            ("a b", "dlock:{a b}"),
            ("🔒", "dlock:{🔒}"),
        ] {
            assert_eq!(lock(key), name, "{key:?}");
        }
    }

    #[test]
    fn shared_objects_have_names_of_their_own_in_the_same_slot() {
        let key = LockKey::new("order:{42}").unwrap();
        let plain = names("dlock", &key);
        let rw = shared_names("dlock", &key, Mode::Write);
        let sem = shared_names("dlock", &key, Mode::Permits { count: 1, limit: 2 });
        assert_eq!(rw.lock, "dlock:{order:%7B42%7D}:rw");
        assert_eq!(shared_names("dlock", &key, Mode::Read), rw);
        assert_eq!(sem.lock, "dlock:{order:%7B42%7D}:sem");
        for n in [&rw, &sem] {
            assert_eq!(hash_tag(&n.lock), hash_tag(&plain.lock));
            assert_ne!(n.lock, plain.lock);
        }
        let token = Token::generate();
        assert_eq!(entry(&token, Mode::Read), format!("{token}|r"));
        assert_eq!(
            entry(&token, Mode::Permits { count: 2, limit: 5 }),
            format!("{token}|p2/5")
        );
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
