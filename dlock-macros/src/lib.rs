//! `#[distributed_lock]`: run an async fn's body under a distributed lock.
//!
//! Use it through `dlock_core`, which re-exports it (feature `macros`, on
//! by default); the documentation with examples is at
//! `dlock_core::distributed_lock`. This crate is the shim: parsing lives in
//! `args.rs` and `template.rs`, code generation in `expand.rs`.

mod args;
mod duration;
mod expand;
mod template;

use proc_macro::TokenStream;

/// Runs the body of an async fn while holding a distributed lock.
///
/// See `dlock_core::distributed_lock` for the arguments, examples and the
/// equivalent code without the macro.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}
