//! Releasing a lock on the session that holds it, exactly once, and
//! forgetting it.

use dlock_core::{backend::ReleaseOutcome, LostReason, Result, Token};

use super::{backend_error, lock, Owned, SqlBackend};
use crate::Dialect;

impl<D: Dialect> SqlBackend<D> {
    /// Releases the lock `token` holds, on the session that holds it.
    ///
    /// The lock is taken out of `owned` by the statement itself, right
    /// before the unlock is sent on the session's connection: a release
    /// dropped before that sent nothing and leaves the lock to the next
    /// release; one dropped after runs to its end, and a second release
    /// (core sends one for a guard whose release was cut off) finds nothing
    /// to send. An unlock sent twice would remove another hold of the same
    /// session where the server stacks them (a second reader's).
    pub(super) async fn unlock(&self, token: &Token) -> Result<ReleaseOutcome> {
        let Some((releasing, session)) = lock(&self.inner.owned)
            .get(token)
            .map(|o| (o.releasing.clone(), o.session.clone()))
        else {
            return Ok(ReleaseOutcome::NotHeld);
        };
        let _one_at_a_time = releasing.lock().await;
        // The session ended, and its locks with it; its guards were told.
        let ended = || {
            if let Some(owned) = self.take_owned(token) {
                self.forget(owned, token, false);
            }
            Ok(ReleaseOutcome::NotHeld)
        };
        if !session.is_usable() {
            return ended();
        }
        let (backend, token) = (self.clone(), *token);
        let unlocked = session
            .run(move |d, c| {
                Box::pin(async move {
                    let Some(owned) = backend.take_owned(&token) else {
                        // Released already, by a release cut off after
                        // this point.
                        return Ok(false);
                    };
                    let answer = async {
                        if d.queues(owned.mode) {
                            return d.dequeue(c, &owned.entry).await;
                        }
                        if owned.proclaimed {
                            d.disclaim(c, &owned.id, &token).await?;
                        }
                        d.unlock(c, &owned.id, owned.mode).await
                    }
                    .await;
                    match &answer {
                        Ok(_) => backend.forget(owned, &token, true),
                        // Whether the lock went is unknown: ending the
                        // session makes sure (its other guards are told).
                        Err(e) => {
                            if !d.ends_the_session(e) {
                                owned.session.end();
                            }
                            backend.forget(owned, &token, false);
                        }
                    }
                    answer
                })
            })
            .await;
        match unlocked {
            Ok((_, true)) => Ok(ReleaseOutcome::Released),
            Ok((_, false)) => Ok(ReleaseOutcome::NotHeld),
            Err(_) if !session.is_usable() => ended(),
            Err(e) => Err(backend_error::<D>(e)),
        }
    }

    /// Takes the lock `token` holds out of `owned`: from here on, its
    /// release is the taker's.
    fn take_owned(&self, token: &Token) -> Option<Owned<D>> {
        lock(&self.inner.owned).remove(token)
    }

    /// Forgets a lock taken out of `owned`: its guard, its turn at the key,
    /// and (a lock won by waiting, once `unlocked`) its session back to
    /// the idle waiter sessions.
    fn forget(&self, owned: Owned<D>, token: &Token, unlocked: bool) {
        owned.session.holders.forget(token, LostReason::NotHeld);
        if owned.fixed_end.is_some() {
            self.inner.lease_ends.cancel(*token);
        }
        let (session, on_waiter) = (owned.session.clone(), owned.on_waiter);
        drop(owned);
        if on_waiter && unlocked {
            self.put_idle(session);
        }
    }
}
