//! The one server setting that can break a lock silently: eviction.

use redis::{aio::ConnectionManager, Client, RedisResult};

/// Logs a warning when the node may evict keys under memory pressure: its
/// `maxmemory-policy` is not `noeviction`. Every policy but that one can
/// evict lock keys (they carry a TTL, so the `volatile-*` policies pick
/// them too), and an evicted lock is granted to the next owner while its
/// holder still works. A server that refuses `CONFIG GET` (managed Redis
/// often does) is not checked.
pub(crate) async fn warn_if_evicting(conn: &mut ConnectionManager, client: &Client) {
    let answer: RedisResult<Vec<String>> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
        .await;
    match answer.as_deref() {
        Ok([_, policy]) if policy != "noeviction" => tracing::warn!(
            node = %client.get_connection_info().addr(),
            policy = %policy,
            "dlock redis: this node's maxmemory-policy can evict lock keys, which grants a held \
             lock to a second owner; set `maxmemory-policy noeviction`"
        ),
        Ok(_) => {}
        Err(error) => tracing::debug!(%error, "dlock redis could not read maxmemory-policy"),
    }
}
