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
    pub(crate) fn new(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Subscriber {
        let channels = Arc::new(Mutex::new(Channels::default()));
        let (commands, queue) = mpsc::unbounded_channel();
        let timeouts = Timeouts {
            connect: connect_timeout,
            response: response_timeout,
        };
        tokio::spawn(manage(client, timeouts, channels.clone(), queue));
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

#[derive(Clone, Copy)]
struct Timeouts {
    connect: Duration,
    response: Duration,
}

/// How often an idle pub/sub connection is pinged, so that a half-open
/// connection (a peer gone without a reset) is noticed and replaced.
const PING_EVERY: Duration = Duration::from_secs(5);

/// The manager task: owns the connection, serves commands in order, and
/// routes messages to waiters.
async fn manage(
    client: Client,
    timeouts: Timeouts,
    channels: Arc<Mutex<Channels>>,
    mut queue: mpsc::UnboundedReceiver<Command>,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        if let Some((mut sink, mut stream)) = connect(&client, timeouts, &channels).await {
            backoff = Duration::from_millis(50);
            // Releases may have been missed while disconnected.
            wake_all(&channels);
            let within = timeouts.response;
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            loop {
                tokio::select! {
                    command = queue.recv() => match command {
                        Some(Command::Subscribe(channel, reply)) => {
                            match tokio::time::timeout(within, sink.subscribe(&channel)).await {
                                Ok(answer) => {
                                    let _ = reply.send(answer);
                                }
                                Err(_) => {
                                    let _ = reply.send(Err(closed()));
                                    break;
                                }
                            }
                        }
                        Some(Command::Unsubscribe(channel)) => {
                            // Unless someone started watching it again meanwhile.
                            let unwatched = !lock(&channels).watched.contains_key(&channel);
                            if unwatched && tokio::time::timeout(within, sink.unsubscribe(&channel)).await.is_err() {
                                break;
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
                    _ = ping.tick() => {
                        let pong = tokio::time::timeout(within, sink.ping::<String>()).await;
                        if !matches!(pong, Ok(Ok(_))) {
                            break;
                        }
                    }
                }
            }
            tracing::warn!("dlock redis pub/sub connection lost; reconnecting");
        }
        // Serve commands with errors until the next try, so that waiters
        // fall back to their bounded retries instead of hanging.
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
    }
}

/// A new pub/sub connection, subscribed again to every watched channel;
/// `None` if that failed.
async fn connect(
    client: &Client,
    timeouts: Timeouts,
    channels: &Mutex<Channels>,
) -> Option<(PubSubSink, redis::aio::PubSubStream)> {
    let pubsub = tokio::time::timeout(timeouts.connect, client.get_async_pubsub()).await;
    let (mut sink, stream) = match pubsub {
        Ok(Ok(pubsub)) => pubsub.split(),
        _ => return None,
    };
    let names: Vec<String> = lock(channels).watched.keys().cloned().collect();
    // One channel per command: the server answers each channel separately,
    // and one answer must confirm exactly one request.
    for name in names {
        let answer = tokio::time::timeout(timeouts.response, sink.subscribe(&name)).await;
        if !matches!(answer, Ok(Ok(()))) {
            return None;
        }
    }
    Some((sink, stream))
}

fn wake_all(channels: &Mutex<Channels>) {
    for watched in lock(channels).watched.values() {
        // Waiters asleep now, and one that is mid-attempt and sleeps next.
        watched.wake.notify_waiters();
        watched.wake.notify_one();
    }
}
