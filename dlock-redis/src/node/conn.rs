//! A node's connection: one server's, a cluster's, or the one that
//! follows a Sentinel deployment's master.

use redis::{
    aio::{ConnectionLike, ConnectionManager},
    cluster_async::ClusterConnection,
    Cmd, Pipeline, RedisFuture, Value,
};

use crate::sentinel::Following;

/// A node's multiplexed connection: to one server, or to a cluster,
/// which routes each command to the master of its key's slot.
#[derive(Clone)]
pub(crate) enum Conn {
    Node(ConnectionManager),
    Cluster(ClusterConnection),
    /// The master a Sentinel deployment names now.
    Sentinel(Following),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Node(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
            Conn::Sentinel(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Node(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Sentinel(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Node(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
            Conn::Sentinel(conn) => conn.get_db(),
        }
    }
}
