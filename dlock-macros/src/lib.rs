//! `#[distributed_lock]`: run an async fn's body under a distributed lock.
//!
//! Use it through `dlock` or `dlock_core`, which re-export it (in
//! `dlock_core`, feature `macros`, on by default); the documentation with
//! examples is at
//! `dlock_core::distributed_lock`. This crate is the shim: parsing lives in
//! `args.rs` and `template.rs`, code generation in `expand.rs`.

mod args;
mod duration;
mod expand;
mod template;

use proc_macro::TokenStream;

/// Runs the body of an async fn while holding a distributed lock.
///
/// Put it on a web handler, a job or a method whose body must not run in
/// two places at once. The lock is taken when the fn is called, before the
/// body starts, and released when the body ends: by returning, by `?`, by a
/// panic, or because the caller dropped the future.
///
/// ```
/// use dlock_core::{distributed_lock, set_default_locker, BackendExt, LockError, MemoryBackend};
///
/// #[derive(Debug)]
/// enum AppError {
///     Lock(LockError),
///     OutOfStock,
/// }
///
/// impl From<LockError> for AppError {
///     fn from(e: LockError) -> Self {
///         AppError::Lock(e)
///     }
/// }
///
/// #[distributed_lock(key = "order:{order_id}", wait = "5s")]
/// async fn pay(order_id: u64, amount: u32) -> Result<u32, AppError> {
///     // Only one caller per order id runs this, across every process.
///     if amount == 0 {
///         return Err(AppError::OutOfStock);
///     }
///     Ok(amount)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// set_default_locker(MemoryBackend::new().into_locker());
/// assert_eq!(pay(42, 3).await.unwrap(), 3);
/// # }
/// ```
///
/// # Arguments
///
/// | argument | meaning |
/// |---|---|
/// | `key = "order:{order_id}"` | **Required.** The lock key. `{param}` and `{param.field.field}` (also `{self.field}`, `{pair.0}`) are formatted with `Display`; `{{` and `}}` are literal braces. A placeholder that names no parameter is a compile error. |
/// | `keys = ["account:{from}", "account:{to}"]` | Instead of `key`: several locks, taken all or none within one `wait`, in one sorted order whatever order they are written in (so two calls naming the same keys in opposite orders cannot deadlock), through [`Locker::lock_all`]. `guard = name` then names the [`MultiGuard`]. |
/// | `locker = <expr>` | The [`Locker`] to lock through: any expression giving a `Locker`, a `&Locker` or an `Arc<Locker>`, such as `self.locker`. Default: `dlock_core::default_locker()`; if none was set, the fn returns `LockError::NoDefaultLocker`. |
/// | `wait = "5s"` | Wait this long (the server's answer at the limit may come a round trip later; humantime's grammar: `500ms`, `5s`, `1m30s`), then return `LockError::Timeout`. `wait = "none"` makes one attempt and returns `LockError::WouldBlock` at once if the lock is held; `wait = "forever"` never gives up. Default: the locker's default. |
/// | `lease = "30s"` | A fixed lease (at least `10ms`): the lock expires after it, and is never renewed. Default: the watchdog keeps the lock alive while the body runs. |
/// | `hold_at_least = "5m"` | A call that ends sooner leaves the lock held until this long after it was granted (by the server's lease), so that a job run from several machines runs once per period ([`LockOptions::hold_at_least`](https://docs.rs/dlock-core/latest/dlock_core/struct.LockOptions.html#method.hold_at_least)); refused where the backend cannot. At most the `lease`, if one is given. |
/// | `lock_delay = "15s"` | If the lock is lost without a release (its lease ran out, the process died), nobody is granted it until this long after ([`LockOptions::lock_delay`](https://docs.rs/dlock-core/latest/dlock_core/struct.LockOptions.html#method.lock_delay)); refused where the backend cannot. At most `1m`. |
/// | `fair = false` | Whoever asks first after a release wins, instead of the longest waiter: faster, and a waiter may starve ([`LockOptions::fair`](https://docs.rs/dlock-core/latest/dlock_core/struct.LockOptions.html#method.fair)). |
/// | `guard = lock` | The body sees the lock's guard as `lock: &LockGuard`: its fencing token for fenced writes, `is_lost()` and `lost()`. It is a reference, so the body cannot release or move the guard. Default: the guard is hidden. |
/// | `abort_on_lost` | If the lock is lost while the body runs (a fixed lease ran out, the server could not be reached), drop the body at once and return `LockError::Lost`. Without it, the body runs to its end, and then, if the lock was lost meanwhile, its value is dropped and the call returns `LockError::Lost` all the same: a caller never takes work as done under the lock when it was not. |
/// | `crate = "path"` | Where `dlock_core` is, when it is re-exported under another path. Default: `dlock` if the crate depends on it (it re-exports `dlock_core`), else `dlock_core`, each under the name the crate's `Cargo.toml` gives it. |
///
/// Unknown, duplicated or malformed arguments are compile errors that say
/// what to write instead.
///
/// # Requirements
///
/// - The fn is an `async fn`: free, a method on `&self`, `&mut self`,
///   `self` or `self: Arc<Self>`, generic, `unsafe`, or in a trait impl
///   (native `async fn` in traits; `#[async_trait]` rewrites the method
///   into a plain fn before this attribute sees it, so it cannot be used
///   there).
/// - It returns `Result<T, E>` (or an alias of one) where
///   `E: From<dlock_core::LockError>`: taking the lock can fail, and the
///   error goes there. Anything else is a compile error pointing at the
///   return type.
/// - Placeholders name parameters, including names bound by patterns
///   (`(x, y): (i32, i32)`), and `self`.
///
/// # Keys
///
/// The template is formatted as written, with each value's `Display`: no
/// escaping. `"{a}:{b}"` gives the same key for `("x:y", "z")` and
/// `("x", "y:z")`, and the two calls then exclude each other: false
/// contention, never a shared lock. Choose separators your values cannot
/// contain (ids, UUIDs), or put such values last.
///
/// # Reentrancy
///
/// The body runs inside the lock's scope (see [`Locker`]'s Reentrancy):
/// anything it calls, at any depth, that locks the same key through the
/// same locker re-enters the held lock at once, without asking the server:
/// an annotated fn that calls another with the same key, or itself (with
/// `Box::pin`). Futures joined beside the call, tasks spawned from the body
/// and code after it are outside the scope, and contend like any other
/// owner.
///
/// # Equivalent code without the macro
///
/// ```
/// # use dlock_core::{default_locker, set_default_locker, BackendExt, LockError, LockOptions, MemoryBackend};
/// # use std::time::Duration;
/// # type AppError = LockError;
/// // #[distributed_lock(key = "order:{order_id}", wait = "5s", guard = lock)]
/// async fn pay(order_id: u64, amount: u32) -> Result<u32, AppError> {
///     let key = format!("order:{}", &order_id);
///     let options = LockOptions::new().wait(Duration::from_millis(5000));
///     let guard = default_locker()?.lock_with(&key, options).await?;
///     let lock = &guard; // with `guard = lock`
///     let body = async move {
///         // ... the original body, unchanged ...
///         let _fence = lock.fencing_token();
///         Ok(amount)
///     };
///     let output = guard.scope(body).await;
///     if guard.is_lost() {
///         // Lost while the body ran: its value is dropped.
///         let reason = guard.lost().await;
///         return Err(LockError::Lost { key: guard.key().to_owned(), reason }.into());
///     }
///     output
///     // `guard` drops here, after the body: the release is scheduled.
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # set_default_locker(MemoryBackend::new().into_locker());
/// # assert_eq!(pay(1, 2).await.unwrap(), 2);
/// # }
/// ```
///
/// With `abort_on_lost`, the scoped body is raced against
/// [`LockGuard::lost`]:
///
/// ```
/// # use dlock_core::{BackendExt, LockError, Locker, MemoryBackend};
/// # async fn expensive_report() -> Result<(), LockError> { Ok(()) }
/// // #[distributed_lock(key = "report", locker = locker, abort_on_lost)]
/// async fn report(locker: &Locker) -> Result<(), LockError> {
///     let guard = locker.lock("report").await?;
///     let body = guard.scope(async move { expensive_report().await });
///     tokio::select! {
///         biased;
///         reason = guard.lost() => Err(LockError::Lost { key: guard.key().to_owned(), reason }),
///         output = body => output,
///     }
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// # report(&MemoryBackend::new().into_locker()).await.unwrap();
/// # }
/// ```
///
/// # Methods and lockers held by the value
///
/// ```
/// use dlock_core::{distributed_lock, BackendExt, LockError, Locker, MemoryBackend};
///
/// struct Accounts {
///     locker: Locker,
///     region: String,
/// }
///
/// impl Accounts {
///     #[distributed_lock(key = "{self.region}:account:{id}", locker = self.locker, wait = "none")]
///     async fn close(&self, id: u64) -> Result<(), LockError> {
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let accounts = Accounts { locker: MemoryBackend::new().into_locker(), region: "eu".into() };
/// accounts.close(7).await.unwrap();
/// # }
/// ```
///
/// [`Locker`]: https://docs.rs/dlock-core/latest/dlock_core/struct.Locker.html
/// [`Locker::lock_all`]: https://docs.rs/dlock-core/latest/dlock_core/struct.Locker.html#method.lock_all
/// [`MultiGuard`]: https://docs.rs/dlock-core/latest/dlock_core/struct.MultiGuard.html
/// [`LockGuard::lost`]: https://docs.rs/dlock-core/latest/dlock_core/struct.LockGuard.html#method.lost
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}
