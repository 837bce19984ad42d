//! [`DynBackend`]: the `dyn`-compatible form of [`Backend`] that a
//! [`Locker`](crate::Locker) holds, derived for every backend.

use std::{fmt, sync::Arc, time::Duration};

use tokio::time::Instant;

use super::{
    AcquireRequest, Acquired, Backend, BoxFuture, Capabilities, Holder, ListPage, ListRequest,
    Mode, ReleaseOutcome, RenewOutcome, RenewRequest,
};
use crate::{error::Result, key::LockKey, token::Token};

/// The `dyn`-compatible form of [`Backend`], which every `Backend` has:
/// a [`Locker`](crate::Locker) holds its backend as `Arc<dyn DynBackend>`,
/// and `dyn DynBackend` is a [`Backend`] again. Implement [`Backend`],
/// never this.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::{Backend, DynBackend}, Locker, MemoryBackend};
/// use std::sync::Arc;
///
/// let backend: Arc<dyn DynBackend> = Arc::new(MemoryBackend::new());
/// assert_eq!(backend.name(), "memory");
/// let locker = Locker::from_arc(backend);
/// # drop(locker);
/// ```
pub trait DynBackend: Send + Sync + fmt::Debug + 'static {
    #[doc(hidden)]
    fn dyn_name(&self) -> &'static str;
    #[doc(hidden)]
    fn dyn_capabilities(&self) -> Capabilities;
    #[doc(hidden)]
    fn dyn_acquire<'a>(
        &'a self,
        req: AcquireRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>>>;
    #[doc(hidden)]
    fn dyn_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>>;
    #[doc(hidden)]
    fn dyn_abandon<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, ()>;
    #[doc(hidden)]
    fn dyn_renew<'a>(
        &'a self,
        locks: &'a [RenewRequest],
    ) -> BoxFuture<'a, Result<Vec<RenewOutcome>>>;
    #[doc(hidden)]
    fn dyn_check_servers(&self) -> BoxFuture<'_, Result<()>>;
    #[doc(hidden)]
    fn dyn_proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>>;
    #[doc(hidden)]
    fn dyn_holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>>;
    #[doc(hidden)]
    fn dyn_list<'a>(&'a self, req: ListRequest<'a>) -> BoxFuture<'a, Result<ListPage>>;
    #[doc(hidden)]
    fn dyn_holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>>;
    #[doc(hidden)]
    fn dyn_force_release<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool>>;
    #[doc(hidden)]
    fn dyn_extend<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<(Instant, Duration)>>>;
    #[doc(hidden)]
    fn dyn_permits_taken<'a>(&'a self, key: &'a LockKey, limit: u32) -> BoxFuture<'a, Result<u32>>;
    #[doc(hidden)]
    fn dyn_connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState>;
}

impl<B: Backend + 'static> DynBackend for B {
    fn dyn_name(&self) -> &'static str {
        self.name()
    }
    fn dyn_capabilities(&self) -> Capabilities {
        self.capabilities()
    }
    fn dyn_acquire<'a>(
        &'a self,
        req: AcquireRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>>> {
        Box::pin(self.acquire(req))
    }
    fn dyn_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        Box::pin(self.release(key, mode, token))
    }
    fn dyn_abandon<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, ()> {
        Box::pin(self.abandon(key, mode, token))
    }
    fn dyn_renew<'a>(
        &'a self,
        locks: &'a [RenewRequest],
    ) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        Box::pin(self.renew(locks))
    }
    fn dyn_check_servers(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.check_servers())
    }
    fn dyn_proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.proclaim(key, token, value))
    }
    fn dyn_holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        Box::pin(self.holder(key))
    }
    fn dyn_list<'a>(&'a self, req: ListRequest<'a>) -> BoxFuture<'a, Result<ListPage>> {
        Box::pin(self.list(req))
    }
    fn dyn_holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.holder_changed(key, seen))
    }
    fn dyn_force_release<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.force_release(key))
    }
    fn dyn_extend<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<(Instant, Duration)>>> {
        Box::pin(self.extend(key, mode, token, lease))
    }
    fn dyn_permits_taken<'a>(&'a self, key: &'a LockKey, limit: u32) -> BoxFuture<'a, Result<u32>> {
        Box::pin(self.permits_taken(key, limit))
    }
    fn dyn_connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        self.connection_state()
    }
}

/// [`Backend`]'s methods, callable on a `dyn DynBackend` (such as
/// [`Locker::backend`](crate::Locker::backend)) with no import.
impl dyn DynBackend + '_ {
    /// See [`Backend::name`].
    pub fn name(&self) -> &'static str {
        self.dyn_name()
    }
    /// See [`Backend::capabilities`].
    pub fn capabilities(&self) -> Capabilities {
        self.dyn_capabilities()
    }
    /// See [`Backend::acquire`].
    pub fn acquire<'a>(
        &'a self,
        req: AcquireRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>>> {
        self.dyn_acquire(req)
    }
    /// See [`Backend::release`].
    pub fn release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, Result<ReleaseOutcome>> {
        self.dyn_release(key, mode, token)
    }
    /// See [`Backend::abandon`].
    pub fn abandon<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
    ) -> BoxFuture<'a, ()> {
        self.dyn_abandon(key, mode, token)
    }
    /// See [`Backend::renew`].
    pub fn renew<'a>(
        &'a self,
        locks: &'a [RenewRequest],
    ) -> BoxFuture<'a, Result<Vec<RenewOutcome>>> {
        self.dyn_renew(locks)
    }
    /// See [`Backend::check_servers`].
    pub fn check_servers(&self) -> BoxFuture<'_, Result<()>> {
        self.dyn_check_servers()
    }
    /// See [`Backend::proclaim`].
    pub fn proclaim<'a>(
        &'a self,
        key: &'a LockKey,
        token: &'a Token,
        value: &'a [u8],
    ) -> BoxFuture<'a, Result<bool>> {
        self.dyn_proclaim(key, token, value)
    }
    /// See [`Backend::holder`].
    pub fn holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Holder>>> {
        self.dyn_holder(key)
    }
    /// See [`Backend::list`].
    pub fn list<'a>(&'a self, req: ListRequest<'a>) -> BoxFuture<'a, Result<ListPage>> {
        self.dyn_list(req)
    }
    /// See [`Backend::holder_changed`].
    pub fn holder_changed<'a>(
        &'a self,
        key: &'a LockKey,
        seen: Option<&'a Holder>,
    ) -> BoxFuture<'a, Result<()>> {
        self.dyn_holder_changed(key, seen)
    }
    /// See [`Backend::force_release`].
    pub fn force_release<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool>> {
        self.dyn_force_release(key)
    }
    /// See [`Backend::extend`].
    pub fn extend<'a>(
        &'a self,
        key: &'a LockKey,
        mode: Mode,
        token: &'a Token,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<(Instant, Duration)>>> {
        self.dyn_extend(key, mode, token, lease)
    }
    /// See [`Backend::permits_taken`].
    pub fn permits_taken<'a>(&'a self, key: &'a LockKey, limit: u32) -> BoxFuture<'a, Result<u32>> {
        self.dyn_permits_taken(key, limit)
    }
    /// See [`Backend::connection_state`].
    pub fn connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        self.dyn_connection_state()
    }
}

/// Forwards to the boxed methods, so that an `Arc<dyn DynBackend>` is a
/// [`Backend`] wherever one is asked for.
impl Backend for dyn DynBackend + '_ {
    fn name(&self) -> &'static str {
        self.dyn_name()
    }
    fn capabilities(&self) -> Capabilities {
        self.dyn_capabilities()
    }
    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        self.dyn_acquire(req).await
    }
    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        self.dyn_release(key, mode, token).await
    }
    async fn abandon(&self, key: &LockKey, mode: Mode, token: &Token) {
        self.dyn_abandon(key, mode, token).await
    }
    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        self.dyn_renew(locks).await
    }
    async fn check_servers(&self) -> Result<()> {
        self.dyn_check_servers().await
    }
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        self.dyn_proclaim(key, token, value).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        self.dyn_holder(key).await
    }
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        self.dyn_list(req).await
    }
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        self.dyn_holder_changed(key, seen).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        self.dyn_force_release(key).await
    }
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        self.dyn_extend(key, mode, token, lease).await
    }
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        self.dyn_permits_taken(key, limit).await
    }
    fn connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        self.dyn_connection_state()
    }
}

/// A shared backend is the backend it shares.
impl<B: Backend + ?Sized> Backend for Arc<B> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn capabilities(&self) -> Capabilities {
        (**self).capabilities()
    }
    async fn acquire(&self, req: AcquireRequest<'_>) -> Result<Option<Acquired>> {
        (**self).acquire(req).await
    }
    async fn release(&self, key: &LockKey, mode: Mode, token: &Token) -> Result<ReleaseOutcome> {
        (**self).release(key, mode, token).await
    }
    async fn abandon(&self, key: &LockKey, mode: Mode, token: &Token) {
        (**self).abandon(key, mode, token).await
    }
    async fn renew(&self, locks: &[RenewRequest]) -> Result<Vec<RenewOutcome>> {
        (**self).renew(locks).await
    }
    async fn check_servers(&self) -> Result<()> {
        (**self).check_servers().await
    }
    async fn proclaim(&self, key: &LockKey, token: &Token, value: &[u8]) -> Result<bool> {
        (**self).proclaim(key, token, value).await
    }
    async fn holder(&self, key: &LockKey) -> Result<Option<Holder>> {
        (**self).holder(key).await
    }
    async fn list(&self, req: ListRequest<'_>) -> Result<ListPage> {
        (**self).list(req).await
    }
    async fn holder_changed(&self, key: &LockKey, seen: Option<&Holder>) -> Result<()> {
        (**self).holder_changed(key, seen).await
    }
    async fn force_release(&self, key: &LockKey) -> Result<bool> {
        (**self).force_release(key).await
    }
    async fn extend(
        &self,
        key: &LockKey,
        mode: Mode,
        token: &Token,
        lease: Duration,
    ) -> Result<Option<(Instant, Duration)>> {
        (**self).extend(key, mode, token, lease).await
    }
    async fn permits_taken(&self, key: &LockKey, limit: u32) -> Result<u32> {
        (**self).permits_taken(key, limit).await
    }
    fn connection_state(&self) -> tokio::sync::watch::Receiver<crate::ConnectionState> {
        (**self).connection_state()
    }
}
