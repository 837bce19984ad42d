//! One timer task for every fixed lease a backend ends itself.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, OnceLock},
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
/// ends once the `LeaseTimers` is dropped.
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
    commands: OnceLock<mpsc::UnboundedSender<Command>>,
    /// Serializes the task's start.
    starting: Mutex<()>,
}

impl LeaseTimers {
    /// Timers that call `on_end` with a lease's token when it ends (on the
    /// timer task: `on_end` should hand slow work to a task of its own).
    pub fn new(on_end: impl Fn(Token) + Send + Sync + 'static) -> Self {
        LeaseTimers {
            on_end: Arc::new(on_end),
            commands: OnceLock::new(),
            starting: Mutex::new(()),
        }
    }

    /// Ends `token`'s lease at `ends`, unless cancelled first.
    pub fn add(&self, token: Token, ends: Instant) {
        self.send(Command::Add(token, ends));
    }

    /// Forgets `token`'s lease: it was released before its end. A no-op
    /// for a lease not added, or ended already.
    pub fn cancel(&self, token: Token) {
        if self.commands.get().is_some() {
            self.send(Command::Cancel(token));
        }
    }

    fn send(&self, command: Command) {
        let commands = match self.commands.get() {
            Some(commands) => commands,
            None => {
                let _starting = self.starting.lock().unwrap_or_else(|e| e.into_inner());
                self.commands.get_or_init(|| {
                    let (tx, rx) = mpsc::unbounded_channel();
                    tokio::spawn(run(rx, self.on_end.clone()));
                    tx
                })
            }
        };
        // The task ends only once every sender is gone.
        let _ = commands.send(command);
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
