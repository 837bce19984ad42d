//! What a backend guarantees beyond the properties every backend has.

use super::Mode;

/// What a backend guarantees beyond the properties every backend has.
///
/// # Examples
///
/// ```
/// use dlock_core::backend::Capabilities;
///
/// let caps = Capabilities::new().fencing(true).fifo(true);
/// assert!(caps.has_fencing() && caps.is_fifo());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    fencing: bool,
    fifo: bool,
    session_leases: bool,
    read_write: bool,
    semaphores: bool,
    forced_release: bool,
    server_leases: bool,
}

impl Capabilities {
    /// No capabilities.
    pub const fn new() -> Self {
        Capabilities {
            fencing: false,
            fifo: false,
            session_leases: false,
            read_write: false,
            semaphores: false,
            forced_release: false,
            server_leases: false,
        }
    }

    /// Every acquisition gets a fencing token greater than those of all
    /// earlier acquisitions of the same key.
    pub const fn fencing(mut self, yes: bool) -> Self {
        self.fencing = yes;
        self
    }

    /// Waiters are granted the lock in the order they asked for it.
    pub const fn fifo(mut self, yes: bool) -> Self {
        self.fifo = yes;
        self
    }

    /// Locks live on a session of the client (etcd lease, ZooKeeper
    /// session): a guard that is leaked keeps its lock for as long as its
    /// client lives, and the lock ends only when the client dies and its
    /// session expires.
    pub const fn session_leases(mut self, yes: bool) -> Self {
        self.session_leases = yes;
        self
    }

    /// Read-write locks: [`Mode::Read`] and [`Mode::Write`].
    pub const fn read_write(mut self, yes: bool) -> Self {
        self.read_write = yes;
        self
    }

    /// Semaphores: [`Mode::Permits`].
    pub const fn semaphores(mut self, yes: bool) -> Self {
        self.semaphores = yes;
        self
    }

    /// [`Backend::force_release`](super::Backend::force_release) takes a
    /// lock from its holder.
    pub const fn forced_release(mut self, yes: bool) -> Self {
        self.forced_release = yes;
        self
    }

    /// A lock ends when its lease ends by the server's clock, whatever
    /// becomes of the client that took it (a key with a TTL), and
    /// [`Backend::extend`](super::Backend::extend) moves that end for any
    /// lock: a release can then leave the lock held until a later time
    /// ([`LockOptions::hold_at_least`](crate::LockOptions::hold_at_least)).
    pub const fn server_leases(mut self, yes: bool) -> Self {
        self.server_leases = yes;
        self
    }

    /// Whether a lock's end is the server's lease alone (see
    /// [`server_leases`](Capabilities::server_leases)).
    pub const fn has_server_leases(&self) -> bool {
        self.server_leases
    }

    /// Whether [`Backend::force_release`](super::Backend::force_release)
    /// takes a lock from its holder.
    pub const fn has_forced_release(&self) -> bool {
        self.forced_release
    }

    /// Whether read-write locks are offered.
    pub const fn has_read_write(&self) -> bool {
        self.read_write
    }

    /// Whether semaphores are offered.
    pub const fn has_semaphores(&self) -> bool {
        self.semaphores
    }

    /// Whether `mode` is offered (plain locks always are).
    pub const fn supports(&self, mode: Mode) -> bool {
        match mode {
            Mode::Exclusive => true,
            Mode::Read | Mode::Write => self.read_write,
            Mode::Permits { .. } => self.semaphores,
        }
    }

    /// Whether locks live on a client session.
    pub const fn has_session_leases(&self) -> bool {
        self.session_leases
    }

    /// Whether fencing tokens are given.
    pub const fn has_fencing(&self) -> bool {
        self.fencing
    }

    /// Whether waiters are served first come, first served.
    pub const fn is_fifo(&self) -> bool {
        self.fifo
    }
}
