//! The manual: how to take each kind of lock, how reentrancy works, which
//! backend to choose, what each guarantees and how to run it in
//! production. Each page's examples are doctests; those that need a
//! server are compiled, not run.
//!
//! Start with [taking a lock](locking), then [the attribute](attribute).
//! The [glossary] defines the few words the docs use in a sense of their
//! own (line, ticket, turn, hold, ...). What each backend costs is in
//! [BENCHMARKS.md](https://github.com/dlock-rs/dlock/blob/main/BENCHMARKS.md),
//! the only place figures are kept.
//!
//! | page | what it covers |
//! |---|---|
//! | [`locking`] | `connect`, `lock`, the guard, `DistMutex`, URLs and their timeouts |
//! | [`attribute`] | `#[distributed_lock]`: key templates and its arguments |
//! | [`reentrancy`] | re-entering a key inside its scope; release on drop and at shutdown |
//! | [`primitives`] | read-write locks, semaphores, several keys at once |
//! | [`election`] | leader election, who leads, watching who leads |
//! | [`backends`] | choosing a backend, what each supports, Redis, PostgreSQL, MySQL, files |
//! | [`guarantees`] | what every backend guarantees, and what dlock deliberately does not do |
//! | [`production`] | TLS, your own client, transaction locks, metrics, connection state, operators' tools |
//! | [`examples`] | the example programs, and what they show |
//! | [`testing`] | how dlock is tested, and where its code is |
//! | [`glossary`] | the words the docs use in a sense of their own |

#[doc = include_str!("../guide/locking.md")]
pub mod locking {}

#[doc = include_str!("../guide/attribute.md")]
pub mod attribute {}

#[doc = include_str!("../guide/reentrancy.md")]
pub mod reentrancy {}

#[doc = include_str!("../guide/primitives.md")]
pub mod primitives {}

#[doc = include_str!("../guide/election.md")]
pub mod election {}

#[doc = include_str!("../guide/backends.md")]
pub mod backends {}

#[doc = include_str!("../guide/guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("../guide/production.md")]
pub mod production {}

#[doc = include_str!("../guide/examples.md")]
pub mod examples {}

#[doc = include_str!("../guide/testing.md")]
pub mod testing {}

#[doc = include_str!("../guide/glossary.md")]
pub mod glossary {}
