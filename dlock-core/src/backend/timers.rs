//! One timer task for every fixed lease a backend ends itself.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::{sync::mpsc, time::Instant};
use tokio_util::time::{delay_queue, DelayQueue};

use crate::Token;

enum Command {
    Add(Token, Instant),
    Cancel(Token),
}

/// Ends fixed leases on time for a backend whose server has no TTL for
/// them (ZooKeeper's ephemeral nodes, SQL session locks): one task and one
/// [`DelayQueue`] for all of a backend's leases, not a sleeping task per
/// acquisition that outlives its lock. A lease cancelled (released early)
/// leaves nothing behind.
///
/// The task starts with the first lease, on the runtime current then, and
/// ends once the `LeaseTimers` is dropped; if that runtime shuts down, the
/// next lease starts a new task on its own caller's runtime.
///
/// # Examples
///
/// ```
/// use dlock_core::{backend::LeaseTimers, Token};
/// use std::{sync::{Arc, Mutex}, time::Duration};
/// use tokio::time::Instant;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let ended = Arc::new(Mutex::new(Vec::new()));
/// let timers = LeaseTimers::new({
///     let ended = ended.clone();
///     move |token| ended.lock().unwrap().push(token)
/// });
/// let (kept, released) = (Token::generate(), Token::generate());
/// timers.add(kept, Instant::now() + Duration::from_millis(10));
/// timers.add(released, Instant::now() + Duration::from_millis(10));
/// timers.cancel(released);
/// tokio::time::sleep(Duration::from_millis(50)).await;
/// assert_eq!(*ended.lock().unwrap(), [kept]);
/// # }
/// ```
pub struct LeaseTimers {
    on_end: Arc<dyn Fn(Token) + Send + Sync>,
    /// The running task's commands; `None` before the first lease.
    commands: Mutex<Option<mpsc::UnboundedSender<Command>>>,
}

impl LeaseTimers {
    /// Timers that call `on_end` with a lease's token when it ends (on the
    /// timer task: `on_end` should hand slow work to a task of its own).
    pub fn new(on_end: impl Fn(Token) + Send + Sync + 'static) -> Self {
        LeaseTimers {
            on_end: Arc::new(on_end),
            commands: Mutex::new(None),
        }
    }

    /// Ends `token`'s lease at `ends`, unless cancelled first.
    pub fn add(&self, token: Token, ends: Instant) {
        self.send(Command::Add(token, ends), true);
    }

    /// Forgets `token`'s lease: it was released before its end. A no-op
    /// for a lease not added, or ended already.
    pub fn cancel(&self, token: Token) {
        self.send(Command::Cancel(token), false);
    }

    /// Sends `command` to the task. If there is none, or it is gone (the
    /// runtime it ran on shut down), a new one starts on the caller's
    /// runtime (`start`: for an `Add`, which needs it; a `Cancel` has
    /// nothing to cancel in a new task). Leases the gone task held end
    /// with their guards' own clocks and their releases.
    fn send(&self, command: Command, start: bool) {
        let mut commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        let command = match commands.as_ref() {
            Some(tx) => match tx.send(command) {
                Ok(()) => return,
                Err(mpsc::error::SendError(command)) => command,
            },
            None => command,
        };
        if !start {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("dlock: a fixed lease was taken outside a Tokio runtime; it ends with its release only");
            return;
        };
        let (tx, rx) = mpsc::unbounded_channel();
        runtime.spawn(run(rx, self.on_end.clone()));
        let _ = tx.send(command);
        *commands = Some(tx);
    }
}

impl std::fmt::Debug for LeaseTimers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseTimers").finish_non_exhaustive()
    }
}

async fn run(
    mut commands: mpsc::UnboundedReceiver<Command>,
    on_end: Arc<dyn Fn(Token) + Send + Sync>,
) {
    let mut queue: DelayQueue<Token> = DelayQueue::new();
    let mut keys: HashMap<Token, delay_queue::Key> = HashMap::new();
    loop {
        tokio::select! {
            // Commands first: a lease moved later (an `Add` again) must
            // replace its old end before that end is taken for expired.
            biased;
            command = commands.recv() => match command {
                Some(Command::Add(token, ends)) => {
                    if let Some(old) = keys.insert(token, queue.insert_at(token, ends)) {
                        queue.remove(&old);
                    }
                }
                Some(Command::Cancel(token)) => {
                    if let Some(key) = keys.remove(&token) {
                        queue.remove(&key);
                    }
                }
                None => return,
            },
            Some(ended) = std::future::poll_fn(|cx| queue.poll_expired(cx)), if !queue.is_empty() => {
                let token = ended.into_inner();
                keys.remove(&token);
                on_end(token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime")
    }

    /// The runtime of the first lease shuts down: the next lease starts a
    /// task on its own runtime, and still ends on time.
    #[test]
    fn leases_still_end_after_the_first_runtime_is_gone() {
        let ended = Arc::new(Mutex::new(Vec::new()));
        let timers = LeaseTimers::new({
            let ended = ended.clone();
            move |token| ended.lock().unwrap().push(token)
        });
        let (first, second) = (Token::generate(), Token::generate());
        runtime().block_on(async {
            timers.add(first, Instant::now() + Duration::from_millis(10));
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        runtime().block_on(async {
            timers.add(second, Instant::now() + Duration::from_millis(10));
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        assert_eq!(*ended.lock().unwrap(), [first, second]);
    }
}
