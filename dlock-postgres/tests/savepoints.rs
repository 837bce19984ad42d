//! Locks on the caller's transaction or connection and savepoints: a
//! transaction-level advisory lock taken inside a savepoint is freed by
//! `ROLLBACK TO SAVEPOINT`, so `lock_in` refuses a nested transaction; a
//! session-level lock (`lock_on`) is freed by no rollback at all.

use dlock_core::{BackendExt, LockError, Locker};
use dlock_postgres::{sqlx, PgBackend};
use dlock_testkit::fixture::PostgresServer;
use sqlx::{Connection, PgPool};

async fn set_up(server: &PostgresServer) -> (PgPool, PgBackend, Locker) {
    let pool = PgPool::connect(&server.url())
        .await
        .expect("the application's pool");
    let backend = PgBackend::from_pool(&pool).await.expect("connect");
    let other = PgBackend::connect(&server.url())
        .await
        .expect("another client")
        .into_locker();
    (pool, backend, other)
}

/// Whether another client is refused `key` now.
async fn held(other: &Locker, key: &str) -> bool {
    match other.try_lock(key).await.expect("another client's attempt") {
        Some(guard) => {
            guard.release().await.expect("release");
            false
        }
        None => true,
    }
}

/// `lock_in` and `try_lock_in` on a nested transaction (a savepoint) are
/// refused with `Unsupported`: a lock granted there would be freed by the
/// savepoint's rollback while the outer transaction and its `TxLock` live,
/// and another client would be granted the key beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_lock_inside_a_savepoint_is_refused() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let (pool, backend, other) = set_up(&server).await;
    for attempt in ["lock_in", "try_lock_in"] {
        let key = format!("order:{attempt}");
        let mut tx = pool.begin().await.unwrap();
        let mut nested = tx.begin().await.unwrap();
        let taken = if attempt == "lock_in" {
            backend.lock_in(&mut nested, &key).await.map(Some)
        } else {
            backend.try_lock_in(&mut nested, &key).await
        };
        nested.rollback().await.unwrap();
        let still_held = held(&other, &key).await;
        match taken {
            Ok(Some(lock)) => assert!(
                still_held,
                "{attempt}: a TxLock (fence {}) outlived its savepoint's rollback: \
                 another client was granted {key} while the outer transaction lived",
                lock.fencing_token()
            ),
            Ok(None) => panic!("{attempt}: refused a free key"),
            Err(e) => assert!(
                matches!(
                    e,
                    LockError::Unsupported {
                        backend: "postgres",
                        ..
                    }
                ),
                "{attempt}: {e}"
            ),
        }
        // The outer transaction still locks as before.
        let lock = backend.lock_in(&mut tx, &key).await.unwrap();
        assert!(held(&other, &key).await, "{attempt}: outer lock not held");
        tx.rollback().await.unwrap();
        assert!(!held(&other, &key).await, "{attempt}: rollback kept it");
        drop(lock);
    }
}

/// A session-level lock on the caller's connection (`lock_on`) outlives
/// `ROLLBACK TO SAVEPOINT` (a nested sqlx transaction's, or one of raw
/// SQL) and `ROLLBACK`: only its release or the connection's end frees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lock_outlives_savepoint_rollbacks() {
    let server = PostgresServer::start().expect("start PostgreSQL");
    let (pool, backend, other) = set_up(&server).await;
    let mut lock = backend
        .lock_on(pool.acquire().await.unwrap(), "migrations")
        .await
        .unwrap();
    {
        let mut tx = (*lock).begin().await.unwrap();
        let mut nested = tx.begin().await.unwrap();
        sqlx::query("SELECT 1").execute(&mut *nested).await.unwrap();
        nested.rollback().await.unwrap();
        assert!(held(&other, "migrations").await, "freed by a savepoint");
        tx.rollback().await.unwrap();
        assert!(held(&other, "migrations").await, "freed by a rollback");
    }
    // Locked inside a savepoint made by raw SQL, then rolled back to it.
    let conn = lock.release().await.unwrap();
    assert!(!held(&other, "migrations").await, "release kept it");
    let mut conn = conn;
    sqlx::raw_sql("BEGIN; SAVEPOINT s")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut lock = backend.lock_on(conn, "migrations").await.unwrap();
    sqlx::raw_sql("ROLLBACK TO SAVEPOINT s; ROLLBACK")
        .execute(&mut *lock)
        .await
        .unwrap();
    assert!(held(&other, "migrations").await, "freed by a raw rollback");
    drop(lock.release().await.unwrap());
    assert!(!held(&other, "migrations").await, "release kept it");
}
