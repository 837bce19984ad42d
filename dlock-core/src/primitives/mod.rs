//! The primitives built on [`Locker`](crate::Locker): each one a
//! type of its own, and the `Locker` methods that start it.

pub mod election;
pub(crate) mod multi;
pub(crate) mod mutex;
pub(crate) mod rwlock;
pub(crate) mod semaphore;
