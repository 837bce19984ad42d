//! [`FinishOnDrop`]: a request that runs in the caller's task, and on to
//! its end in a task of its own if the caller leaves half-way.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    task::{ready, Context, Poll},
};

use super::BoxFuture;

/// A request that must not stop half-way (a statement on a shared
/// connection, a write whose outcome decides what to undo), run in the
/// task that awaits it, with no task hop, and, if that task drops it
/// before its end, run on to its end in a task of its own, on the Tokio
/// runtime it was made on (wherever it is dropped).
///
/// Made outside a runtime and dropped outside one, or once its runtime
/// shut down, the request is dropped where it stands: give it a drop guard
/// of its own for that case. A request that panicked is not run on.
///
/// A caller that polls the request and then stops polling it without
/// dropping it (a `&mut` future in a `select!` loop) stalls it: give
/// anything else that needs the request's resources a way to finish it
/// (dlock's SQL sessions share the in-flight statement for that).
///
/// # Examples
///
/// ```
/// use dlock_core::backend::FinishOnDrop;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let (go, gate) = tokio::sync::oneshot::channel::<()>();
/// let (tx, rx) = tokio::sync::oneshot::channel();
/// let mut request = Box::pin(FinishOnDrop::watched(|abandoned| async move {
///     let _ = gate.await;
///     // Runs though its caller left: it knows, and can undo its work.
///     let _ = tx.send(abandoned.get());
/// }));
/// // The caller polls it once, then leaves.
/// tokio::select! {
///     biased;
///     _ = &mut request => unreachable!("it waits for the gate"),
///     _ = std::future::ready(()) => drop(request),
/// }
/// go.send(()).unwrap();
/// assert!(rx.await.unwrap(), "the request ran on, and knew it was left");
/// # }
/// ```
pub struct FinishOnDrop<T: Send + 'static> {
    future: Option<BoxFuture<'static, T>>,
    abandoned: Abandoned,
    /// The runtime it was made on, which runs it on if it is dropped
    /// half-way, wherever that happens.
    runtime: Option<tokio::runtime::Handle>,
}

/// Whether the caller of a [`FinishOnDrop`] request left before its end.
#[derive(Debug, Clone, Default)]
pub struct Abandoned(Arc<AtomicBool>);

impl Abandoned {
    /// True once the caller dropped the request before its end: the
    /// request runs on in a task of its own, and nobody reads its output.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl<T: Send + 'static> FinishOnDrop<T> {
    /// `future`, run to its end even if its caller leaves.
    pub fn new(future: impl Future<Output = T> + Send + 'static) -> Self {
        FinishOnDrop {
            future: Some(Box::pin(future)),
            abandoned: Abandoned::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// The future `make` returns, run to its end even if its caller
    /// leaves, and told through [`Abandoned`] whether the caller left
    /// (set before it runs on alone).
    pub fn watched<F>(make: impl FnOnce(Abandoned) -> F) -> Self
    where
        F: Future<Output = T> + Send + 'static,
    {
        let abandoned = Abandoned::default();
        FinishOnDrop {
            future: Some(Box::pin(make(abandoned.clone()))),
            abandoned,
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            panic!("FinishOnDrop polled after its end");
        };
        // A future that panicked is not run on when dropped.
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx)));
        let output = match polled {
            Ok(poll) => ready!(poll),
            Err(panic) => {
                self.future = None;
                std::panic::resume_unwind(panic)
            }
        };
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        self.abandoned.0.store(true, Ordering::SeqCst);
        let runtime = self
            .runtime
            .take()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        if let Some(runtime) = runtime {
            drop(runtime.spawn(async move {
                future.await;
            }));
        }
    }
}

impl<T: Send + 'static> std::fmt::Debug for FinishOnDrop<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FinishOnDrop")
            .field("done", &self.future.is_none())
            .field("abandoned", &self.abandoned.get())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Awaited to its end: runs in the caller's task, and is not abandoned.
    #[tokio::test]
    async fn awaited_it_runs_in_the_callers_task() {
        tokio::spawn(async {
            let caller = tokio::task::id();
            let ran_in = FinishOnDrop::watched(|abandoned| async move {
                tokio::task::yield_now().await;
                (tokio::task::id(), abandoned.get())
            })
            .await;
            assert_eq!(ran_in, (caller, false));
        })
        .await
        .unwrap();
    }

    /// Dropped half-way: runs on to its end in another task, told so.
    #[tokio::test]
    async fn dropped_half_way_it_runs_on_and_knows() {
        tokio::spawn(async {
            let caller = tokio::task::id();
            let (go, gate) = tokio::sync::oneshot::channel::<()>();
            let (tx, rx) = tokio::sync::oneshot::channel();
            let mut request = Box::pin(FinishOnDrop::watched(|abandoned| async move {
                let _ = gate.await;
                let _ = tx.send((tokio::task::id(), abandoned.get()));
            }));
            tokio::select! {
                biased;
                _ = &mut request => panic!("it waits for the gate"),
                _ = std::future::ready(()) => drop(request),
            }
            go.send(()).unwrap();
            let (ran_in, abandoned) = tokio::time::timeout(Duration::from_secs(5), rx)
                .await
                .expect("it ran to its end")
                .expect("it ran to its end");
            assert_ne!(ran_in, caller);
            assert!(abandoned);
        })
        .await
        .unwrap();
    }

    /// Dropped half-way on a thread with no runtime: runs on, on the
    /// runtime it was made on.
    #[test]
    fn dropped_off_its_runtime_it_runs_on_its_own() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (go, gate) = tokio::sync::oneshot::channel::<()>();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut request = {
            let _on = runtime.enter();
            Box::pin(FinishOnDrop::new(async move {
                let _ = gate.await;
                let _ = tx.send(());
            }))
        };
        // Polled once, so that it is half-way.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(request.as_mut().poll(&mut cx).is_pending());
        std::thread::spawn(move || {
            assert!(tokio::runtime::Handle::try_current().is_err());
            drop(request);
        })
        .join()
        .unwrap();
        // Fails if the request was dropped: then nothing runs on.
        let _ = go.send(());
        rx.recv_timeout(Duration::from_secs(5))
            .expect("it ran to its end on the runtime it was made on");
    }

    /// A request that panicked is dropped, not run on.
    #[tokio::test]
    async fn a_request_that_panicked_is_not_run_on() {
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = polls.clone();
        let mut request = Box::pin(FinishOnDrop::new(std::future::poll_fn(move |_| {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("the request's own panic");
            }
            Poll::<()>::Pending
        })));
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            request.as_mut().poll(&mut cx)
        }));
        assert!(polled.is_err(), "the panic reaches the caller");
        drop(request);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            polls.load(Ordering::SeqCst),
            1,
            "polled again after its panic"
        );
    }
}
