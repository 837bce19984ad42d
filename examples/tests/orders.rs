//! The order service, driven over real HTTP: two instances at once never
//! charge an order twice; lock errors become the documented statuses.

use std::{net::SocketAddr, time::Duration};

use dlock::{BackendExt, Locker, MemoryBackend};
use dlock_examples::orders::{router, AppState, Ledger};
use dlock_testkit::fixture::RedisServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A response: status, headers (lower-case names), body.
#[derive(Debug)]
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on a new connection, bounded to 30 s.
async fn http(addr: SocketAddr, method: &str, path: &str) -> Response {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.expect("receive");
        raw
    };
    let raw = tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .expect("an answer within 30 s");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a full response");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Response {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// Serves one instance on a free port.
async fn serve(locker: Locker, name: &str, ledger: &Ledger) -> SocketAddr {
    let state = AppState::new(locker, name, ledger.clone(), Duration::from_millis(20));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router(state)).await });
    addr
}

/// 12 orders, each asked 4 times (twice per instance), all at once.
async fn two_instances_charge_each_order_once(a: Locker, b: Locker) {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    let (a, b) = (serve(a, "a", &ledger).await, serve(b, "b", &ledger).await);
    const ORDERS: u64 = 12;
    let requests: Vec<_> = (1..=ORDERS)
        .flat_map(|id| [a, b, a, b].map(move |addr| (id, addr)))
        .map(|(id, addr)| {
            tokio::spawn(async move {
                (
                    id,
                    http(addr, "POST", &format!("/orders/{id}/process")).await,
                )
            })
        })
        .collect();
    let mut created = vec![0; ORDERS as usize + 1];
    for request in requests {
        let (id, response) = request.await.expect("request task");
        match response.status {
            201 => created[id as usize] += 1,
            200 => assert!(response.body.contains("already processed"), "{response:?}"),
            _ => panic!("order {id}: {response:?}"),
        }
    }
    assert!(
        created[1..].iter().all(|&n| n == 1),
        "201 counts per order: {created:?}"
    );
    let charges = ledger.charges().expect("charges");
    let mut ids: Vec<u64> = charges.iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        (1..=ORDERS).collect::<Vec<_>>(),
        "charges: {charges:?}"
    );
    // The total is a read-modify-write by both instances under the
    // DistMutex: no update lost.
    assert_eq!(ledger.total().await.expect("total"), ORDERS);
    let (sa, sb) = (
        http(a, "GET", "/stats").await,
        http(b, "GET", "/stats").await,
    );
    let processed = |r: &Response| -> u64 {
        r.body
            .split_whitespace()
            .nth(3)
            .and_then(|n| n.trim_end_matches(';').parse().ok())
            .unwrap_or_else(|| panic!("{r:?}"))
    };
    assert_eq!(processed(&sa) + processed(&sb), ORDERS, "{sa:?} {sb:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_never_charge_an_order_twice_in_process() {
    // Instances in one process share the in-process backend.
    let backend = MemoryBackend::new();
    two_instances_charge_each_order_once(backend.clone().into_locker(), backend.into_locker())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_never_charge_an_order_twice_through_redis() {
    let server = RedisServer::start().expect("redis-server");
    let url = server.url();
    let connect = || dlock_examples::backend::locker(Some(&url));
    let (a, b) = (connect().await.expect("a"), connect().await.expect("b"));
    two_instances_charge_each_order_once(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_out_the_lock_gets_409_with_retry_after() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    let locker = MemoryBackend::new().into_locker();
    let addr = serve(locker.clone(), "a", &ledger).await;
    // Another request (here: another task) holds order 7 for longer than
    // the handler's 2 s wait.
    let held = tokio::spawn(async move {
        let guard = locker.lock("order:7").await.expect("lock");
        tokio::time::sleep(Duration::from_secs(4)).await;
        guard.release().await.expect("release");
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let response = http(addr, "POST", "/orders/7/process").await;
    assert_eq!(response.status, 409, "{response:?}");
    assert_eq!(response.header("retry-after"), Some("1"), "{response:?}");
    assert!(ledger.charges().expect("charges").is_empty());
    held.await.expect("holder");
    let response = http(addr, "POST", "/orders/7/process").await;
    assert_eq!(response.status, 201, "after the release: {response:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_lock_service_is_a_500() {
    let mut server = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::open(dir.path()).expect("ledger");
    let locker = dlock_examples::backend::locker(Some(&server.url()))
        .await
        .expect("connect");
    let addr = serve(locker, "a", &ledger).await;
    assert_eq!(http(addr, "POST", "/orders/1/process").await.status, 201);
    server.process().kill();
    let response = http(addr, "POST", "/orders/2/process").await;
    assert_eq!(response.status, 500, "{response:?}");
    assert_eq!(
        response.body, "internal error\n",
        "no details leak: {response:?}"
    );
    assert_eq!(
        ledger.charges().expect("charges").len(),
        1,
        "order 2 not charged"
    );
}

/// The `orders` binary on a free port; killed when dropped.
struct Instance {
    child: tokio::process::Child,
    addr: SocketAddr,
}

impl Instance {
    async fn start(name: &str, url: &str, ledger: &std::path::Path) -> Instance {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_orders"))
            .args([
                "--port",
                "0",
                "--instance",
                name,
                "--backend",
                url,
                "--charge-ms",
                "20",
            ])
            .arg("--ledger")
            .arg(ledger)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the orders binary");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("listening within 30 s")
            .expect("read stdout")
            .expect("a line");
        let addr = line
            .rsplit("http://")
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in `{line}`"));
        Instance { child, addr }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_orders_processes_share_the_work_through_redis() {
    let server = RedisServer::start().expect("redis-server");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut a = Instance::start("a", &server.url(), dir.path()).await;
    let mut b = Instance::start("b", &server.url(), dir.path()).await;
    const ORDERS: u64 = 6;
    let requests: Vec<_> = (1..=ORDERS)
        .flat_map(|id| [a.addr, b.addr, a.addr, b.addr].map(move |addr| (id, addr)))
        .map(|(id, addr)| {
            tokio::spawn(async move { http(addr, "POST", &format!("/orders/{id}/process")).await })
        })
        .collect();
    let mut created = 0;
    for request in requests {
        let response = request.await.expect("request task");
        match response.status {
            201 => created += 1,
            200 => {}
            _ => panic!("{response:?}"),
        }
    }
    assert_eq!(created, ORDERS);
    let ledger = Ledger::open(dir.path()).expect("ledger");
    let mut ids: Vec<u64> = ledger
        .charges()
        .expect("charges")
        .iter()
        .map(|(id, _)| *id)
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, (1..=ORDERS).collect::<Vec<_>>());
    assert_eq!(ledger.total().await.expect("total"), ORDERS);
    // Ctrl-C: each instance shuts down gracefully and exits with success.
    for instance in [&mut a, &mut b] {
        let pid = instance.child.id().expect("running").to_string();
        let sent = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .expect("kill -INT");
        assert!(sent.success());
        let status = tokio::time::timeout(Duration::from_secs(20), instance.child.wait())
            .await
            .expect("stopped within 20 s")
            .expect("wait");
        assert!(status.success(), "{status:?}");
    }
}
