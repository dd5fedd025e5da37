//! SIGINT / SIGTERM as something a run can wait for: the run stops taking new work, writes
//! what is finished, records status `interrupted` and returns [`Interrupted`].

use tokio::sync::watch;

/// The signals a run stops on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Interrupt,
    Terminate,
}

impl Signal {
    pub fn name(self) -> &'static str {
        match self {
            Signal::Interrupt => "SIGINT",
            Signal::Terminate => "SIGTERM",
        }
    }

    /// The shell's convention for a process ended by this signal: 128 + its number.
    pub fn exit_code(self) -> u8 {
        match self {
            Signal::Interrupt => 128 + libc::SIGINT as u8,
            Signal::Terminate => 128 + libc::SIGTERM as u8,
        }
    }
}

/// A run stopped by a signal after recording what it finished.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by {}: finished work is kept and recorded; {}", .signal.name(), .how_to_resume)]
pub struct Interrupted {
    pub signal: Signal,
    /// What the user does to continue.
    pub how_to_resume: &'static str,
}

impl Interrupted {
    /// A run that the same command resumes.
    pub fn new(signal: Signal) -> Self {
        Self::resume_with(signal, "rerun the same command to resume")
    }

    pub fn resume_with(signal: Signal, how_to_resume: &'static str) -> Self {
        Self {
            signal,
            how_to_resume,
        }
    }
}

/// The exit code for an error that is (or wraps) [`Interrupted`].
pub fn interrupted_exit_code(err: &anyhow::Error) -> Option<u8> {
    err.chain()
        .find_map(|e| e.downcast_ref::<Interrupted>())
        .map(|i| i.signal.exit_code())
}

/// Resolves when the process gets SIGINT or SIGTERM (after [`Shutdown::on_signals`]); never
/// for [`Shutdown::never`]. Clones share the signal.
#[derive(Clone, Debug)]
pub struct Shutdown {
    rx: Option<watch::Receiver<Option<Signal>>>,
}

impl Shutdown {
    /// No signal handling (library callers and tests): the default disposition stays.
    pub fn never() -> Self {
        Self { rx: None }
    }

    /// Catches SIGINT and SIGTERM from now on. A second signal, while the run is still
    /// writing what it finished, ends the process at once. Must run inside a tokio runtime.
    pub fn on_signals() -> std::io::Result<Self> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt())?;
        let mut term = signal(SignalKind::terminate())?;
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let mut seen = false;
            loop {
                let got = tokio::select! {
                    _ = int.recv() => Signal::Interrupt,
                    _ = term.recv() => Signal::Terminate,
                };
                if seen {
                    std::process::exit(i32::from(got.exit_code()));
                }
                seen = true;
                tracing::warn!(
                    "{}: finishing what is complete and recording the run as interrupted \
                     (send it again to stop at once)",
                    got.name()
                );
                let _ = tx.send(Some(got));
            }
        });
        Ok(Self { rx: Some(rx) })
    }

    /// The signal received so far, if any.
    pub fn received(&self) -> Option<Signal> {
        self.rx.as_ref().and_then(|rx| *rx.borrow())
    }

    /// Waits for the first signal.
    pub async fn wait(&self) -> Signal {
        let Some(rx) = &self.rx else {
            return std::future::pending().await;
        };
        let mut rx = rx.clone();
        let got = rx.wait_for(Option::is_some).await.map(|s| *s);
        match got {
            Ok(s) => s.unwrap_or(Signal::Interrupt),
            // The listener is gone: no signal can come any more.
            Err(_) => std::future::pending().await,
        }
    }

    /// Runs `work` unless a signal comes first (setup steps that record nothing yet).
    pub async fn guard<T>(
        &self,
        work: impl std::future::Future<Output = T>,
    ) -> Result<T, Interrupted> {
        tokio::select! {
            biased;
            signal = self.wait() => Err(Interrupted::new(signal)),
            out = work => Ok(out),
        }
    }
}
