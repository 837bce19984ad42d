//! Leader election on a lock: [`Locker::elect`] and its [`Election`].

use std::{
    fmt,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use tokio::{
    runtime::Handle,
    sync::{watch, Notify},
    task::JoinHandle,
};

use crate::{
    backend::{Backoff, DynBackend, Holder},
    error::{LockError, Result},
    key::LockKey,
    locker::{guard::LockGuard, options::LockOptions, Locker},
    LostReason,
};

/// Where a candidate stands in its election.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// Waiting to lead: another candidate leads, or none does yet.
    Candidate,
    /// Leading, in `term`: the fencing token of this leadership, greater
    /// than every earlier leader's.
    Leader {
        /// The term.
        term: u64,
    },
    /// The leadership ended (`reason`), and the candidate campaigns again.
    Deposed {
        /// The term that ended.
        term: u64,
        /// Why it ended.
        reason: LostReason,
    },
    /// Resigned: no longer a candidate.
    Resigned,
}

impl Role {
    /// The term, while leading.
    pub fn term(&self) -> Option<u64> {
        match self {
            Role::Leader { term } => Some(*term),
            _ => None,
        }
    }
}

/// The leader of an election, as anyone reads it: [`Locker::leader`],
/// [`Election::leader`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The leader's term.
    pub term: u64,
    /// What the leader proclaimed ([`Election::proclaim`]; empty if it
    /// set nothing); `None` for a moment after it wins, until its value is
    /// written (for its whole term if the servers refused the write three
    /// times, which the leader logs).
    pub value: Option<Vec<u8>>,
}

/// How many times a new leader tries to write its value before it leads
/// without one.
const PROCLAIM_ATTEMPTS: u32 = 3;

/// The longest value a candidate may proclaim.
pub const MAX_PROCLAIMED: usize = 32 * 1024;

struct Shared {
    locker: Locker,
    key: LockKey,
    /// The leadership's guard while leading (a sibling of the campaign's).
    leading: Mutex<Option<LockGuard>>,
    /// What this candidate proclaims while it leads. Held across the write
    /// to the server, so that two writes never land out of order.
    value: tokio::sync::Mutex<Option<Vec<u8>>>,
    resign: Notify,
    /// The last leadership that was lost: its term, and why. The role says
    /// it too, until the campaign moves on (and a watcher that looks later
    /// sees only the newest role).
    deposed: Mutex<Option<(u64, LostReason)>>,
    /// The candidate's role. Held here, not only by the campaign task, so
    /// that dropping the [`Election`] (which aborts the task) can say
    /// [`Role::Resigned`].
    role: watch::Sender<Role>,
}

impl Shared {
    /// Announces `role`, unless the candidate resigned already: nothing
    /// follows [`Role::Resigned`], not even a campaign step that was
    /// running on another thread as the election was dropped.
    fn set_role(&self, role: Role) {
        self.role.send_if_modified(|current| {
            if *current == Role::Resigned {
                return false;
            }
            *current = role;
            true
        });
    }

    /// The current leadership's token, unless it is lost.
    fn leading_token(&self) -> Option<crate::Token> {
        lock(&self.leading)
            .as_ref()
            .filter(|guard| !guard.is_lost())
            .map(|guard| *guard.token())
    }
}

/// Reads who leads `key` now. A holder whose fence the backend does not
/// know yet (on SQL, until the leader's win is written) does not count.
async fn leader_of(locker: &Locker, key: &LockKey) -> Result<Option<Leader>> {
    Ok(leader_from(locker.backend().holder(key).await?))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Locker {
    /// Starts campaigning for the leadership of `name`, in a task of its
    /// own on the current runtime, until the [`Election`] is resigned or
    /// dropped.
    ///
    /// A candidate leads while it holds the election's lock (the key
    /// `election:{name}`): leaders never overlap, exactly as locks never
    /// do, on every backend, and a leader whose lease ends learns it (its
    /// [`Role`] becomes [`Role::Deposed`], [`Election::is_leader`] turns
    /// false) no later than another candidate is elected. Each leadership's
    /// term is the lock's fencing token, so terms strictly increase across
    /// leaders: write with the term, to a store that refuses an older one
    /// (see [`LockGuard::fencing_token`]), and a deposed leader that writes
    /// late is refused. A deposed candidate campaigns again.
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`] on a backend without fencing tokens (a
    /// term must order leaders); [`LockError::NoRuntime`] outside a Tokio
    /// runtime; [`LockError::InvalidKey`] for a name that makes no key.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{election::Role, Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let backend = MemoryBackend::new();
    /// let (a, b) = (Locker::new(backend.clone()), Locker::new(backend));
    /// let first = a.elect("scheduler")?;
    /// let term = first.leading().await?;
    /// let second = b.elect("scheduler")?;
    /// assert!(first.is_leader() && !second.is_leader());
    /// first.resign().await?;
    /// // The next leader's term is greater.
    /// assert!(second.leading().await? > term);
    /// # Ok(())
    /// # }
    /// ```
    pub fn elect(&self, name: impl AsRef<str>) -> Result<Election> {
        if !self.backend().capabilities().has_fencing() {
            return Err(LockError::Unsupported {
                backend: self.backend().name(),
                what: "leader election (it needs fencing tokens for its terms)",
            });
        }
        let key = election_key(name.as_ref())?;
        let runtime = Handle::try_current().map_err(|_| LockError::NoRuntime)?;
        let (role, roles) = watch::channel(Role::Candidate);
        let shared = Arc::new(Shared {
            locker: self.clone(),
            key,
            leading: Mutex::new(None),
            value: tokio::sync::Mutex::new(None),
            resign: Notify::new(),
            deposed: Mutex::new(None),
            role,
        });
        let task = runtime.spawn(campaign(shared.clone()));
        Ok(Election {
            shared,
            roles,
            task: Some(task),
        })
    }

    /// Who leads the election `name` now, and what it proclaimed: one read
    /// of the election's lock, for anyone (a candidate or not).
    ///
    /// # Errors
    ///
    /// [`LockError::Unsupported`] on a backend that cannot read a lock's
    /// holder (every backend of this workspace with fencing tokens can);
    /// [`LockError::InvalidKey`] for a name that makes no key; the
    /// server's error if it does not answer.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let backend = MemoryBackend::new();
    /// let (node, follower) = (Locker::new(backend.clone()), Locker::new(backend));
    /// assert!(follower.leader("scheduler").await?.is_none());
    /// let election = node.elect("scheduler")?;
    /// election.proclaim("10.0.0.7:8080").await?;
    /// let term = election.leading().await?;
    /// let leader = follower.leader("scheduler").await?.expect("a leader");
    /// assert_eq!(leader.term, term);
    /// assert_eq!(leader.value.as_deref(), Some(&b"10.0.0.7:8080"[..]));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn leader(&self, name: impl AsRef<str>) -> Result<Option<Leader>> {
        leader_of(self, &election_key(name.as_ref())?).await
    }
}

impl Locker {
    /// Watches who leads the election `name`: a
    /// [`tokio::sync::watch`] receiver of the leader (or `None`), updated
    /// by a task of its own on the current runtime until every receiver
    /// is dropped. For anyone, a candidate or not.
    ///
    /// It is woken by the server where the server can tell (see
    /// [`Backend::holder_changed`](crate::backend::Backend::holder_changed)):
    /// the in-process backend, Redis, etcd and ZooKeeper; the SQL
    /// backends read again every
    /// [`HOLDER_POLL`](crate::backend::HOLDER_POLL). A watch keeps the
    /// latest value: a receiver that looks rarely sees the newest leader,
    /// not each one between. If the servers stop answering, the last
    /// leader read stays until they answer again.
    ///
    /// # Errors
    ///
    /// As [`Locker::leader`], for the first read.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let backend = MemoryBackend::new();
    /// let (node, follower) = (Locker::new(backend.clone()), Locker::new(backend));
    /// let mut leaders = follower.observe("scheduler").await?;
    /// assert!(leaders.borrow().is_none());
    /// let election = node.elect("scheduler")?;
    /// let term = election.leading().await?;
    /// let leader = leaders.wait_for(Option::is_some).await.expect("watching");
    /// assert_eq!(leader.as_ref().map(|l| l.term), Some(term));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn observe(&self, name: impl AsRef<str>) -> Result<watch::Receiver<Option<Leader>>> {
        observe_key(self, election_key(name.as_ref())?).await
    }
}

/// [`Locker::observe`] of the election held on `key`.
async fn observe_key(locker: &Locker, key: LockKey) -> Result<watch::Receiver<Option<Leader>>> {
    let runtime = Handle::try_current().map_err(|_| LockError::NoRuntime)?;
    let seen = locker.backend().holder(&key).await?;
    let (leaders, receiver) = watch::channel(leader_from(seen.clone()));
    runtime.spawn(follow(locker.clone(), key, seen, leaders));
    Ok(receiver)
}

/// A holder as a leader: one whose fence is known.
fn leader_from(holder: Option<Holder>) -> Option<Leader> {
    holder.and_then(|holder| {
        Some(Leader {
            term: holder.fence()?,
            value: holder.into_value(),
        })
    })
}

/// Keeps `leaders` on `key`'s holder until every receiver is gone: waits
/// for a change, reads, publishes what differs.
async fn follow(
    locker: Locker,
    key: LockKey,
    mut seen: Option<Holder>,
    leaders: watch::Sender<Option<Leader>>,
) {
    let backend = locker.backend();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let read = tokio::select! {
            () = leaders.closed() => return,
            read = async {
                backend.holder_changed(&key, seen.as_ref()).await?;
                backend.holder(&key).await
            } => read,
        };
        match read {
            Ok(holder) => {
                backoff.reset();
                if holder != seen {
                    leaders.send_replace(leader_from(holder.clone()));
                    seen = holder;
                }
            }
            Err(error) => {
                tracing::warn!(%error, key = %locker.traced(&key), "dlock election: watching the leader failed");
                tokio::select! {
                    () = leaders.closed() => return,
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
        }
    }
}

/// The lock an election is held on.
pub(crate) fn election_key(name: &str) -> Result<LockKey> {
    LockKey::new(format!("election:{name}"))
}

/// Campaigns until resigned: lock, lead until lost, campaign again.
async fn campaign(shared: Arc<Shared>) {
    let (locker, key) = (&shared.locker, &shared.key);
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let won = tokio::select! {
            // Renewed while it leads, whatever the locker's default lease:
            // a fixed one would depose every leader at its end, and churn
            // the terms every follower sees.
            won = locker.lock_with(key.as_str(), LockOptions::new().wait_forever().watchdog()) => won,
            () = shared.resign.notified() => break,
        };
        let guard = match won {
            Ok(guard) => guard,
            Err(error) => {
                // The servers are down: campaign again, with backoff.
                tracing::warn!(%error, key = %locker.traced(key), "dlock election campaign failed");
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = shared.resign.notified() => break,
                }
                continue;
            }
        };
        backoff.reset();
        let Some(term) = guard.fencing_token() else {
            tracing::error!(key = %locker.traced(key), "dlock election: the backend gave no fencing token");
            break;
        };
        {
            // Proclaim before anyone is told of the leadership, and
            // before a later `proclaim` can write.
            // Always written, empty if none was set: some backends record
            // who holds a lock only when it proclaims.
            let value = shared.value.lock().await;
            let proclaimed = value.as_deref().unwrap_or_default();
            let mut held = true;
            let mut proclaim_backoff =
                Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
            for attempt in 0..PROCLAIM_ATTEMPTS {
                match locker
                    .backend()
                    .proclaim(key, guard.token(), proclaimed)
                    .await
                {
                    Ok(true) | Err(LockError::Unsupported { .. }) => break,
                    // The server says the lock is not ours any more: the
                    // win is never announced.
                    Ok(false) => {
                        held = false;
                        break;
                    }
                    Err(error) if attempt + 1 == PROCLAIM_ATTEMPTS => {
                        tracing::warn!(%error, key = %locker.traced(key), "dlock election: the leader's value was not written");
                    }
                    Err(_) => tokio::time::sleep(proclaim_backoff.next_delay()).await,
                }
            }
            if !held {
                tracing::warn!(key = %locker.traced(key), term, "dlock election: the lock was lost as it was won; campaigning again");
                drop(value);
                drop(guard);
                tokio::select! {
                    () = tokio::time::sleep(backoff.next_delay()) => {}
                    () = shared.resign.notified() => break,
                }
                continue;
            }
            *lock(&shared.leading) = Some(guard.sibling());
            shared.set_role(Role::Leader { term });
        }
        tokio::select! {
            reason = guard.lost() => {
                lock(&shared.leading).take();
                *lock(&shared.deposed) = Some((term, reason.clone()));
                shared.set_role(Role::Deposed { term, reason });
                drop(guard);
            }
            () = shared.resign.notified() => {
                lock(&shared.leading).take();
                let _ = guard.release().await;
                break;
            }
        }
    }
    lock(&shared.leading).take();
    shared.set_role(Role::Resigned);
}

/// Completes when the role is no longer `Leader { term }`: why, or
/// `None` if the candidate resigned. A campaign that was deposed may have
/// moved on (candidate again, or leading a later term) before this looks:
/// the reason is then read from `shared`.
async fn ended(mut roles: watch::Receiver<Role>, term: u64, shared: &Shared) -> Option<LostReason> {
    let ended = roles
        .wait_for(|r| !matches!(r, Role::Leader { term: t } if *t == term))
        .await
        .map(|r| r.clone());
    match ended {
        Ok(Role::Deposed { term: t, reason }) if t == term => Some(reason),
        _ => match &*lock(&shared.deposed) {
            Some((t, reason)) if *t == term => Some(reason.clone()),
            _ => None,
        },
    }
}

/// One leadership of an [`Election`], from [`Election::lead`]: its term,
/// whether it still holds, and its end.
pub struct Leadership {
    term: u64,
    shared: Arc<Shared>,
    roles: watch::Receiver<Role>,
}

impl Leadership {
    /// The term: the fencing token to write with.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Whether this leadership still holds: the candidate leads in this
    /// term, and its lease has not run out by its own clock (checked now).
    pub fn is_current(&self) -> bool {
        lock(&self.shared.leading)
            .as_ref()
            .filter(|guard| !guard.is_lost())
            .and_then(LockGuard::fencing_token)
            == Some(self.term)
    }

    /// The election's lock, and the backend it is held on.
    pub(crate) fn held_on(&self) -> (&LockKey, Arc<dyn DynBackend>) {
        (&self.shared.key, self.shared.locker.backend().clone())
    }

    /// Completes when this leadership ends: why it was lost, or `None` if
    /// the candidate resigned (at once if it ended already).
    pub async fn lost(&self) -> Option<LostReason> {
        ended(self.roles.clone(), self.term, &self.shared).await
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("term", &self.term)
            .field("current", &self.is_current())
            .finish()
    }
}

/// A candidate in a leader election: see [`Locker::elect`].
///
/// Dropping it resigns (the leadership's lock is released in the
/// background, as a dropped guard's is); [`resign`](Election::resign)
/// resigns and waits for the release.
pub struct Election {
    shared: Arc<Shared>,
    roles: watch::Receiver<Role>,
    task: Option<JoinHandle<()>>,
}

impl Election {
    /// Where this candidate stands now.
    pub fn role(&self) -> Role {
        self.roles.borrow().clone()
    }

    /// Whether this candidate leads now: it won, and its lease has not run
    /// out by its own clock (checked now, not only when the campaign task
    /// next runs).
    pub fn is_leader(&self) -> bool {
        self.shared.leading_token().is_some()
    }

    /// The term of the current leadership, while leading.
    pub fn term(&self) -> Option<u64> {
        lock(&self.shared.leading)
            .as_ref()
            .filter(|guard| !guard.is_lost())
            .and_then(LockGuard::fencing_token)
    }

    /// The owner token of the current leadership's lock, while leading
    /// (as [`LockGuard::token`]: for logs, and for tests that take the
    /// lock from under the leader).
    pub fn token(&self) -> Option<crate::Token> {
        lock(&self.shared.leading)
            .as_ref()
            .map(|guard| *guard.token())
    }

    /// Every change of [`role`](Election::role), as a
    /// [`tokio::sync::watch`] receiver.
    pub fn changes(&self) -> watch::Receiver<Role> {
        self.roles.clone()
    }

    /// Sets what this candidate proclaims while it leads, for
    /// [`Locker::leader`] to read: written now if it leads, and on every
    /// later win before the win is announced. Returns whether it was
    /// written now (`false`: not leading; it is kept for the next win).
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] for a value over [`MAX_PROCLAIMED`]
    /// bytes; [`LockError::Unsupported`] on a backend that cannot publish
    /// a holder's value; the server's error if the write fails (the value
    /// is still kept for the next win).
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let locker = Locker::new(MemoryBackend::new());
    /// let election = locker.elect("primary")?;
    /// election.leading().await?;
    /// assert!(election.proclaim("db-2").await?);
    /// let leader = election.leader().await?.expect("a leader");
    /// assert_eq!(leader.value.as_deref(), Some(&b"db-2"[..]));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn proclaim(&self, value: impl Into<Vec<u8>>) -> Result<bool> {
        let value = value.into();
        if value.len() > MAX_PROCLAIMED {
            return Err(crate::InvalidReason::ProclaimedValueTooLong {
                len: value.len(),
                max: MAX_PROCLAIMED,
            }
            .into());
        }
        let shared = &self.shared;
        let mut kept = shared.value.lock().await;
        // Kept first: a write cut short may still land, and the next win
        // must not write an older value over it.
        let value = kept.insert(value);
        match shared.leading_token() {
            Some(token) => {
                shared
                    .locker
                    .backend()
                    .proclaim(&shared.key, &token, value)
                    .await
            }
            None => Ok(false),
        }
    }

    /// Who leads this election now (this candidate or another), and what
    /// it proclaimed: as [`Locker::leader`].
    ///
    /// # Errors
    ///
    /// As [`Locker::leader`].
    pub async fn leader(&self) -> Result<Option<Leader>> {
        leader_of(&self.shared.locker, &self.shared.key).await
    }

    /// Watches who leads this election: as [`Locker::observe`].
    ///
    /// # Errors
    ///
    /// As [`Locker::observe`].
    pub async fn observe(&self) -> Result<watch::Receiver<Option<Leader>>> {
        observe_key(&self.shared.locker, self.shared.key.clone()).await
    }

    /// Waits until this candidate leads: its term.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] if it resigned first.
    pub async fn leading(&self) -> Result<u64> {
        let mut roles = self.roles.clone();
        let role = roles
            .wait_for(|r| matches!(r, Role::Leader { .. } | Role::Resigned))
            .await
            .map(|r| r.clone());
        match role {
            Ok(Role::Leader { term }) => Ok(term),
            _ => Err(crate::InvalidReason::Resigned.into()),
        }
    }

    /// While leading, completes when this leadership ends: why, or `None`
    /// if the candidate resigned. At once (`None`) if not leading now.
    pub async fn deposed(&self) -> Option<LostReason> {
        let mut roles = self.roles.clone();
        let current = roles.borrow_and_update().clone();
        let Role::Leader { term } = current else {
            return None;
        };
        ended(roles, term, &self.shared).await
    }

    /// Waits until this candidate leads, and returns that leadership: its
    /// term, whether it still holds, and its end. A handle only: the
    /// leadership lasts until it is lost or the candidate resigns, whether
    /// or not the handle is kept.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidOptions`] if the candidate resigned first.
    ///
    /// # Examples
    ///
    /// ```
    /// use dlock_core::{Locker, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), dlock_core::LockError> {
    /// let election = Locker::new(MemoryBackend::new()).elect("scheduler")?;
    /// let leadership = election.lead().await?;
    /// assert!(leadership.is_current());
    /// // ... work, writing with leadership.term() as the fence ...
    /// election.resign().await?;
    /// assert!(!leadership.is_current());
    /// assert_eq!(leadership.lost().await, None); // resigned, not lost
    /// # Ok(())
    /// # }
    /// ```
    pub async fn lead(&self) -> Result<Leadership> {
        let term = self.leading().await?;
        Ok(Leadership {
            term,
            shared: self.shared.clone(),
            roles: self.roles.clone(),
        })
    }

    /// Resigns: leaves the election, releasing the leadership if it holds
    /// it, and waits for the release.
    ///
    /// # Errors
    ///
    /// None today; a `Result` so that a release error can be reported.
    pub async fn resign(mut self) -> Result<()> {
        self.shared.resign.notify_one();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        Ok(())
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        lock(&self.shared.leading).take();
        // Every watcher of `changes()` hears it, as on `resign`.
        self.shared.set_role(Role::Resigned);
    }
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("role", &self.role())
            .finish_non_exhaustive()
    }
}
