//! Test only: a pause at a chosen moment of the backend's work, for tests
//! that make a fault happen exactly there (a failover between a grant and
//! the wait for its replicas).

use std::{future::Future, pin::Pin, sync::Mutex};

/// What a test runs at the moment: once.
pub(crate) type Hook = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// The lock whose grant runs the hook, and the hook.
static AFTER_GRANT: Mutex<Option<(String, Hook)>> = Mutex::new(None);

/// Runs `hook` once, as soon as one node's answer grants `lock` (its
/// server name, such as `dlock:{key}`) and before anything else is done
/// with that answer.
pub(crate) fn after_grant(lock: &str, hook: Hook) {
    *AFTER_GRANT.lock().unwrap_or_else(|e| e.into_inner()) = Some((lock.to_owned(), hook));
}

/// Called where one node's answer granted `lock`.
pub(crate) async fn granted(lock: &str) {
    let hook = {
        let mut armed = AFTER_GRANT.lock().unwrap_or_else(|e| e.into_inner());
        match armed.take() {
            Some((name, hook)) if name == lock => Some(hook),
            other => {
                *armed = other;
                None
            }
        }
    };
    if let Some(hook) = hook {
        hook().await;
    }
}
