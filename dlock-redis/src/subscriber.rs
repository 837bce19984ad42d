//! One pub/sub connection per node, shared by every waiter of the backend.
//!
//! A release names the first waiter in line (its token is the message),
//! so it wakes that one waiter, wherever it runs; a Redlock waiter
//! registers one wake-up on every node. A manager task owns the
//! connection and alone subscribes and unsubscribes; a channel stays
//! subscribed for [`LINGER`] after its last waiter left, so the next
//! waiter of a contended key finds it live without a round trip, and is
//! taken out of the table before it is unsubscribed. After a reconnect,
//! or a shard channel the server unsubscribed (its slot moved), the
//! channels are subscribed again and their waiters woken to check again.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::Duration,
};

use dlock_core::backend::Backoff;
use futures_util::StreamExt;
use redis::{
    aio::PubSubSink, cluster::ClusterClient, cluster_async::ClusterConnection, Client, PushInfo,
    PushKind, RedisError, RedisResult, Value,
};
use tokio::sync::{mpsc, oneshot, watch, Notify};

use crate::sentinel::Master;

/// Where the subscriber connects: one node, on classic channels; or a
/// cluster, on shard channels (`SSUBSCRIBE`, served by the slot's shard).
/// One per subscriber, so its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Source {
    Node(Client),
    /// The master a Sentinel deployment names now, followed when it changes.
    Sentinel(Arc<Master>),
    /// Built for RESP3, without a push sender: the manager gives one.
    Cluster(ClusterClient),
}

/// The half of a connection that subscribes.
enum Sink {
    Node(PubSubSink),
    Cluster(ClusterConnection),
}

/// The half that brings messages.
enum Stream {
    Node(redis::aio::PubSubStream),
    Cluster(mpsc::UnboundedReceiver<PushInfo>),
}

impl Sink {
    async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Sink::Node(sink) => sink.subscribe(channel).await,
            Sink::Cluster(conn) => conn.ssubscribe(channel).await,
        }
    }

    /// Subscribes to `channel` within `within`, and marks it live in
    /// `channels` once the server confirmed it; `Err` if no answer came in
    /// time.
    async fn subscribe_live(
        &mut self,
        channels: &Mutex<Channels>,
        channel: &str,
        within: Duration,
    ) -> Result<RedisResult<()>, tokio::time::error::Elapsed> {
        let answer = tokio::time::timeout(within, self.subscribe(channel)).await;
        if let Ok(Ok(())) = answer {
            if let Some(watched) = lock(channels).watched.get_mut(channel) {
                watched.live = true;
            }
        }
        answer
    }

    async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Sink::Node(sink) => sink.unsubscribe(channel).await,
            Sink::Cluster(conn) => conn.sunsubscribe(channel).await,
        }
    }

    async fn ping(&mut self) -> RedisResult<()> {
        match self {
            // A subscribed RESP2 connection answers `PING` with
            // `["pong", ""]`, not `PONG`: take any reply as alive.
            Sink::Node(sink) => sink.ping::<Value>().await.map(drop),
            Sink::Cluster(conn) => redis::cmd("PING")
                .query_async::<Value>(conn)
                .await
                .map(drop),
        }
    }
}

/// What the connection brought.
enum Event {
    /// A message on a channel.
    Message(String, Vec<u8>),
    /// The server unsubscribed us from a shard channel: its slot moved to
    /// another shard (our own `SUNSUBSCRIBE`s of idle channels come back
    /// this way too, for channels no longer in the table).
    Unsubscribed(String),
    /// The cluster client lost a connection (and subscribes again
    /// itself): releases may have been missed meanwhile.
    Disconnected,
}

impl Stream {
    /// The next event; `None` once the connection is gone.
    async fn next(&mut self) -> Option<Event> {
        match self {
            Stream::Node(stream) => stream.next().await.map(|m| {
                Event::Message(
                    m.get_channel_name().to_owned(),
                    m.get_payload_bytes().to_vec(),
                )
            }),
            Stream::Cluster(pushes) => loop {
                let push = pushes.recv().await?;
                let kind = push.kind;
                let mut data = push.data.into_iter();
                let channel = data
                    .next()
                    .and_then(|c| redis::from_redis_value::<String>(c).ok());
                match (kind, channel) {
                    (PushKind::SMessage | PushKind::Message, Some(channel)) => {
                        let payload = data
                            .next()
                            .and_then(|p| redis::from_redis_value::<Vec<u8>>(p).ok())
                            .unwrap_or_default();
                        return Some(Event::Message(channel, payload));
                    }
                    (PushKind::SUnsubscribe, Some(channel)) => {
                        return Some(Event::Unsubscribed(channel))
                    }
                    (PushKind::Disconnection, _) => return Some(Event::Disconnected),
                    _ => {}
                }
            },
        }
    }
}

enum Command {
    Subscribe(String, oneshot::Sender<Result<(), RedisError>>),
}

/// How long a channel stays subscribed after its last waiter left.
const LINGER: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Channels {
    watched: HashMap<String, Watched>,
}

/// The waiters of one channel, by token.
#[derive(Default)]
struct Watched {
    waiters: HashMap<String, Arc<Notify>>,
    /// Subscribed on the current connection, as the server confirmed.
    live: bool,
    /// Since when nobody waits on it.
    idle_since: Option<tokio::time::Instant>,
}

impl Watched {
    /// Wakes the waiter a message names, or every waiter for an empty
    /// message (a release by a client that does not name the next waiter).
    fn wake(&self, payload: &[u8]) {
        if payload.is_empty() {
            self.wake_all();
        } else if let Some(wake) = std::str::from_utf8(payload)
            .ok()
            .and_then(|token| self.waiters.get(token))
        {
            wake.notify_one();
        }
    }

    fn wake_all(&self) {
        for wake in self.waiters.values() {
            // A permit: the waiter may be mid-attempt, and sleep next.
            wake.notify_one();
        }
    }
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
    /// A subscriber for `source`, with the connect and response timeouts;
    /// connects on first use. Spawns the manager task, which ends when the
    /// subscriber is dropped.
    pub(crate) fn new(source: Source, timeouts: (Duration, Duration)) -> Subscriber {
        let channels = Arc::new(Mutex::new(Channels::default()));
        let (commands, queue) = mpsc::unbounded_channel();
        tokio::spawn(manage(source, timeouts, channels.clone(), queue));
        Subscriber { channels, commands }
    }

    /// Whether any channel is subscribed (or being subscribed) now.
    pub(crate) fn watches_any(&self) -> bool {
        !lock(&self.channels).watched.is_empty()
    }

    /// Whether `channel` is subscribed now: someone waits on it, or did
    /// within the last [`LINGER`].
    pub(crate) fn is_live(&self, channel: &str) -> bool {
        lock(&self.channels)
            .watched
            .get(channel)
            .is_some_and(|w| w.live)
    }

    /// Starts waking `wake` for the messages on `channel` that name
    /// `token`; returns once the server confirmed the subscription, so that
    /// a release published after this returns is seen.
    pub(crate) async fn watch(
        &self,
        channel: &str,
        token: &str,
        wake: &Arc<Notify>,
    ) -> Result<Watch, RedisError> {
        let live = {
            let mut channels = lock(&self.channels);
            let watched = channels.watched.entry(channel.to_owned()).or_default();
            watched.waiters.insert(token.to_owned(), wake.clone());
            watched.idle_since = None;
            watched.live
        };
        // From here on, dropping the watch unregisters it.
        let watch = Watch {
            channels: self.channels.clone(),
            channel: channel.to_owned(),
            token: token.to_owned(),
        };
        if live {
            // Subscribed already, and it stays so while we are registered.
            return Ok(watch);
        }
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

/// A waiter's registration on one channel; unregisters when dropped.
pub(crate) struct Watch {
    channels: Arc<Mutex<Channels>>,
    channel: String,
    token: String,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut channels = lock(&self.channels);
        let Some(watched) = channels.watched.get_mut(&self.channel) else {
            return;
        };
        watched.waiters.remove(&self.token);
        if watched.waiters.is_empty() {
            // The manager unsubscribes it once it has lingered.
            watched.idle_since = Some(tokio::time::Instant::now());
        }
    }
}

/// How often an idle pub/sub connection is pinged, so that a half-open
/// connection (a peer gone without a reset) is noticed and replaced.
const PING_EVERY: Duration = Duration::from_secs(5);

/// The manager task: owns the connection, serves commands in order, and
/// routes messages to waiters.
async fn manage(
    source: Source,
    timeouts: (Duration, Duration),
    channels: Arc<Mutex<Channels>>,
    mut queue: mpsc::UnboundedReceiver<Command>,
) {
    let within = timeouts.1;
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut masters = match &source {
        Source::Sentinel(master) => Some(master.changes()),
        _ => None,
    };
    loop {
        if let Some(masters) = &mut masters {
            // The master about to be connected to is the one seen.
            masters.borrow_and_update();
        }
        if let Some((mut sink, mut stream)) = connect(&source, timeouts, &channels).await {
            backoff.reset();
            // Releases may have been missed while disconnected.
            wake_all(&channels);
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            let mut sweep = tokio::time::interval(LINGER);
            sweep.tick().await;
            loop {
                tokio::select! {
                    command = queue.recv() => match command {
                        Some(Command::Subscribe(channel, reply)) => {
                            match sink.subscribe_live(&channels, &channel, within).await {
                                Ok(answer) => {
                                    let _ = reply.send(answer);
                                }
                                Err(_) => {
                                    let _ = reply.send(Err(closed()));
                                    break;
                                }
                            }
                        }
                        None => return,
                    },
                    event = stream.next() => match event {
                        Some(Event::Message(channel, payload)) => {
                            if let Some(watched) = lock(&channels).watched.get(&channel) {
                                watched.wake(&payload);
                            }
                        }
                        Some(Event::Unsubscribed(channel)) => {
                            // Its slot moved: subscribe again (on the new
                            // owner), and wake its waiters, who may have
                            // missed a release.
                            let watched = lock(&channels)
                                .watched
                                .get_mut(&channel)
                                .map(|w| w.live = false);
                            if watched.is_some() {
                                // Subscribed first, then woken: a waiter's
                                // check then runs with the channel live.
                                let answer = sink.subscribe_live(&channels, &channel, within).await;
                                if let Some(w) = lock(&channels).watched.get(&channel) {
                                    w.wake_all();
                                }
                                match answer {
                                    Ok(Ok(())) => {}
                                    Ok(Err(error)) => tracing::debug!(%error, "dlock redis: subscribing again failed"),
                                    Err(_) => break,
                                }
                            }
                        }
                        Some(Event::Disconnected) => wake_all(&channels),
                        None => break,
                    },
                    _ = sweep.tick() => {
                        // Out of the table first: a waiter that comes now
                        // asks for the subscription again, after this.
                        let unsubscribed = async {
                            for channel in take(&channels, LINGER) {
                                let _ = tokio::time::timeout(within, sink.unsubscribe(&channel)).await?;
                            }
                            Ok::<_, tokio::time::error::Elapsed>(())
                        };
                        if unsubscribed.await.is_err() {
                            break;
                        }
                    }
                    _ = ping.tick() => {
                        let pong = tokio::time::timeout(within, sink.ping()).await;
                        if !matches!(pong, Ok(Ok(()))) {
                            break;
                        }
                    }
                    () = new_master(&mut masters) => {
                        tracing::warn!("dlock redis pub/sub: following the new master");
                        break;
                    }
                }
            }
            tracing::warn!("dlock redis pub/sub connection lost; reconnecting");
        }
        for watched in lock(&channels).watched.values_mut() {
            watched.live = false;
        }
        // Until the next try, commands fail, so waiters fall back to polling.
        let retry = tokio::time::sleep(backoff.next_delay());
        tokio::pin!(retry);
        loop {
            tokio::select! {
                _ = &mut retry => break,
                command = queue.recv() => match command {
                    Some(Command::Subscribe(_, reply)) => {
                        let _ = reply.send(Err(closed()));
                    }
                    None => return,
                },
            }
        }
    }
}

/// Completes when the followed master changes; never without a
/// Sentinel source (or once its master is gone).
async fn new_master(masters: &mut Option<watch::Receiver<u64>>) {
    if let Some(changes) = masters {
        if changes.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// A new pub/sub connection, subscribed again to every watched channel;
/// `None` if that failed.
async fn connect(
    source: &Source,
    (connect_timeout, within): (Duration, Duration),
    channels: &Mutex<Channels>,
) -> Option<(Sink, Stream)> {
    let (mut sink, stream) = match source {
        Source::Node(client) => pubsub(client.clone(), connect_timeout).await?,
        Source::Sentinel(master) => pubsub(master.client(), connect_timeout).await?,
        Source::Cluster(client) => {
            let (pushes, received) = mpsc::unbounded_channel();
            let conn = client.get_async_connection_with_config(
                redis::cluster::ClusterConfig::new().set_push_sender(pushes),
            );
            let conn = tokio::time::timeout(connect_timeout, conn)
                .await
                .ok()?
                .ok()?;
            (Sink::Cluster(conn), Stream::Cluster(received))
        }
    };
    // Channels nobody waits on are not worth subscribing again.
    drop(take(channels, Duration::ZERO));
    let names: Vec<String> = lock(channels).watched.keys().cloned().collect();
    // One channel per command: the server answers each channel separately,
    // and one answer must confirm exactly one request.
    for name in names {
        match sink.subscribe_live(channels, &name, within).await {
            Ok(Ok(())) => {}
            // On a cluster, a shard that does not answer leaves the others
            // subscribed; its waiters are woken and fall back to polling.
            _ if matches!(source, Source::Cluster(_)) => {
                if let Some(watched) = lock(channels).watched.get(&name) {
                    watched.wake_all();
                }
            }
            _ => return None,
        }
    }
    Some((sink, stream))
}

/// A pub/sub connection to one server, within `within`.
async fn pubsub(client: Client, within: Duration) -> Option<(Sink, Stream)> {
    let pubsub = tokio::time::timeout(within, client.get_async_pubsub()).await;
    let (sink, stream) = pubsub.ok()?.ok()?.split();
    Some((Sink::Node(sink), Stream::Node(stream)))
}

/// Takes the channels that nobody has waited on for `linger` out of the
/// table.
fn take(channels: &Mutex<Channels>, linger: Duration) -> Vec<String> {
    let now = tokio::time::Instant::now();
    let mut channels = lock(channels);
    let idle: Vec<String> = channels
        .watched
        .iter()
        .filter(|(_, w)| w.waiters.is_empty())
        .filter(|(_, w)| {
            w.idle_since
                .is_some_and(|t| now.duration_since(t) >= linger)
        })
        .map(|(name, _)| name.clone())
        .collect();
    for name in &idle {
        channels.watched.remove(name);
    }
    idle
}

fn wake_all(channels: &Mutex<Channels>) {
    for watched in lock(channels).watched.values() {
        watched.wake_all();
    }
}
