//! One pub/sub connection per node, shared by every waiter of the backend,
//! with reference-counted subscriptions.
//!
//! A manager task owns the connection. Subscribe and unsubscribe commands
//! reach it through one ordered queue, so an unsubscribe sent when the last
//! waiter of a channel leaves can never overtake a later subscribe. If the
//! connection drops, the task reconnects, subscribes again to every channel
//! still watched, and wakes all waiters to check again (they may have
//! missed a release meanwhile).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use futures_util::StreamExt;
use redis::{aio::PubSubSink, Client, RedisError};
use tokio::sync::{mpsc, oneshot, Notify};

enum Command {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
    Unsubscribe(String),
}

#[derive(Default)]
struct Channels {
    watched: HashMap<String, Watched>,
}

struct Watched {
    waiters: usize,
    wake: Arc<Notify>,
}

/// The shared subscriber of one node.
pub(crate) struct Subscriber {
    channels: Arc<Mutex<Channels>>,
    commands: mpsc::UnboundedSender<Command>,
}

fn lock(channels: &Mutex<Channels>) -> MutexGuard<'_, Channels> {
    channels.lock().unwrap_or_else(|e| e.into_inner())
}

impl Subscriber {
    /// A subscriber for `client`'s node; connects on first use. Must be
    /// called within a Tokio runtime: it spawns the manager task, which
    /// ends when the subscriber is dropped.
    pub(crate) fn new(client: Client, connect_timeout: Duration) -> Subscriber {
        let channels = Arc::new(Mutex::new(Channels::default()));
        let (commands, queue) = mpsc::unbounded_channel();
        tokio::spawn(manage(client, connect_timeout, channels.clone(), queue));
        Subscriber { channels, commands }
    }

    /// Starts watching `channel`; returns once the server confirmed the
    /// subscription, so that a release published after this returns wakes
    /// the watch.
    pub(crate) async fn watch(&self, channel: &str) -> Result<Watch, RedisError> {
        let wake = {
            let mut channels = lock(&self.channels);
            let watched = channels
                .watched
                .entry(channel.to_owned())
                .or_insert_with(|| Watched {
                    waiters: 0,
                    wake: Arc::new(Notify::new()),
                });
            watched.waiters += 1;
            watched.wake.clone()
        };
        // From here on, dropping the watch gives the waiter count back.
        let watch = Watch {
            channels: self.channels.clone(),
            commands: self.commands.clone(),
            channel: channel.to_owned(),
            wake,
        };
        // SUBSCRIBE is idempotent on the server: each waiter asks, and is
        // answered once its own request (and all before it) took effect.
        let (reply, confirmed) = oneshot::channel();
        self.commands
            .send(Command::Subscribe(channel.to_owned(), reply))
            .map_err(|_| closed())?;
        confirmed.await.map_err(|_| closed())??;
        Ok(watch)
    }
}

fn closed() -> RedisError {
    RedisError::from((redis::ErrorKind::Io, "the pub/sub manager has stopped"))
}

/// A waiter's interest in one channel.
pub(crate) struct Watch {
    channels: Arc<Mutex<Channels>>,
    commands: mpsc::UnboundedSender<Command>,
    channel: String,
    wake: Arc<Notify>,
}

impl Watch {
    /// Completes when a release was published on the channel (or the
    /// connection was re-established). One waiter is woken per message.
    pub(crate) async fn notified(&self) {
        self.wake.notified().await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut channels = lock(&self.channels);
        let Some(watched) = channels.watched.get_mut(&self.channel) else {
            return;
        };
        watched.waiters -= 1;
        if watched.waiters == 0 {
            channels.watched.remove(&self.channel);
            let _ = self
                .commands
                .send(Command::Unsubscribe(self.channel.clone()));
        } else {
            // This waiter may have taken a wake-up meant for the channel;
            // pass it on. At worst another waiter checks once for nothing.
            watched.wake.notify_one();
        }
    }
}

/// The manager task: owns the connection, serves commands in order, and
/// routes messages to waiters.
async fn manage(
    client: Client,
    connect_timeout: Duration,
    channels: Arc<Mutex<Channels>>,
    mut queue: mpsc::UnboundedReceiver<Command>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let connected = tokio::time::timeout(connect_timeout, client.get_async_pubsub()).await;
        let (mut sink, mut stream) = match connected {
            Ok(Ok(pubsub)) => pubsub.split(),
            _ => {
                // Serve commands with errors while the node is unreachable,
                // so waiters fall back to their bounded retries.
                let retry = tokio::time::sleep(backoff);
                tokio::pin!(retry);
                loop {
                    tokio::select! {
                        _ = &mut retry => break,
                        command = queue.recv() => match command {
                            Some(Command::Subscribe(_, reply)) => {
                                let _ = reply.send(Err(closed()));
                            }
                            Some(Command::Unsubscribe(_)) => {}
                            None => return,
                        },
                    }
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(50);
        if resubscribe(&mut sink, &channels).await.is_err() {
            continue;
        }
        // Releases may have been missed while disconnected.
        wake_all(&channels);
        loop {
            tokio::select! {
                command = queue.recv() => match command {
                    Some(Command::Subscribe(channel, reply)) => {
                        let _ = reply.send(sink.subscribe(&channel).await);
                    }
                    Some(Command::Unsubscribe(channel)) => {
                        // Unless someone started watching it again meanwhile.
                        if !lock(&channels).watched.contains_key(&channel) {
                            let _ = sink.unsubscribe(&channel).await;
                        }
                    }
                    None => return,
                },
                message = stream.next() => match message {
                    Some(message) => {
                        let channel = message.get_channel_name();
                        if let Some(watched) = lock(&channels).watched.get(channel) {
                            watched.wake.notify_one();
                        }
                    }
                    None => break,
                },
            }
        }
        tracing::warn!("dlock redis pub/sub connection lost; reconnecting");
    }
}

async fn resubscribe(sink: &mut PubSubSink, channels: &Mutex<Channels>) -> Result<(), RedisError> {
    let names: Vec<String> = lock(channels).watched.keys().cloned().collect();
    if !names.is_empty() {
        sink.subscribe(&names).await?;
    }
    Ok(())
}

fn wake_all(channels: &Mutex<Channels>) {
    for watched in lock(channels).watched.values() {
        watched.wake.notify_waiters();
    }
}
