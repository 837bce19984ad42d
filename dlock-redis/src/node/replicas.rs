//! `wait_replicas`: a grant or a renewal counts only once enough replicas
//! have it. The `WAIT` goes in one pipeline with the write it is for, so
//! it runs on the connection that made the write, right after it: `WAIT`
//! counts the replicas that have this connection's writes, and one sent
//! on another connection (a reconnect, or the next master after a
//! failover) would count replicas that never had the write.

use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult};

use super::Node;

impl Node {
    /// `WAIT replicas timeout`, if the node waits for replicas.
    pub(crate) fn wait_command(&self) -> Option<Cmd> {
        let (replicas, timeout) = self.wait?;
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(
            u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        );
        Some(wait)
    }

    /// `acked`, if it is fewer replicas than the node waits for.
    pub(crate) fn short_of_replicas(&self, acked: Option<i64>) -> Option<i64> {
        let (replicas, _) = self.wait?;
        acked.filter(|&acked| acked < i64::from(replicas))
    }

    /// The error for a write only `acked` replicas acknowledged.
    pub(crate) fn unacknowledged(&self, acked: i64) -> RedisError {
        let (replicas, timeout) = self.wait.unwrap_or_default();
        RedisError::from((
            ErrorKind::Client,
            "too few replicas acknowledged the write that `wait_replicas` asks for: a failover could lose it",
            format!("{acked} of {replicas} within {timeout:?}"),
        ))
    }

    /// `cmd`'s answer; with `acked` and `wait_replicas`, and `WAIT`'s
    /// answer, the two pipelined on one connection.
    pub(crate) async fn query<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        acked: bool,
    ) -> RedisResult<(T, Option<i64>)> {
        let mut conn = self.conn.clone();
        let Some(wait) = self.wait_command().filter(|_| acked) else {
            return Ok((cmd.query_async(&mut conn).await?, None));
        };
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone()).add_command(wait);
        let (answer, acked) = pipe.query_async(&mut conn).await?;
        Ok((answer, Some(acked)))
    }
}
