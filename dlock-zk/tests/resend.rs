//! A release sent again after its reply was lost, through a proxy that
//! lets the request through and drops the answer.

use dlock_core::BackendExt;
use dlock_testkit::{
    fixture::{TcpProxy, ZooKeeperServer},
    session_faults,
};
use dlock_zk::ZkBackend;

/// The node is deleted by the first send, whose answer is lost with the
/// connection; the send core makes again finds no node, on a session that
/// still lives: it must answer that it released, and leave the next
/// owner's node alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_again_after_its_reply_was_lost_is_a_no_op_that_succeeds() {
    let server = ZooKeeperServer::start().expect("start ZooKeeper");
    let proxy = TcpProxy::start(server.endpoint().parse().unwrap())
        .await
        .unwrap();
    // A session timeout the whole check stays well inside.
    let backend = ZkBackend::connect(&format!("zk://{}/s?session_timeout=20s", proxy.endpoint()))
        .await
        .unwrap();
    let cut = backend.clone().into_locker();
    let next = ZkBackend::connect(&format!("zk://{}/s", server.endpoint()))
        .await
        .unwrap()
        .into_locker();
    session_faults::check_a_release_sent_again_after_a_lost_reply_succeeds(
        &backend, &cut, &next, &proxy, "resent",
    )
    .await;
}
