//! The job-stream driver of every stage that runs independent items (conversations, games,
//! tasks) and appends each result as it finishes.

use std::future::Future;

use futures::StreamExt;

use super::{Shutdown, Signal};

/// Runs `jobs` up to `concurrency` at a time and hands each result to `on_result` in the
/// order they finish, until every job is done or `shutdown` fires. Jobs still in flight at a
/// signal are dropped (a stage's model calls are in its request cache: a rerun replays them
/// for free). Returns the signal that stopped the run, if any; an error from `on_result` (a
/// record that could not be written) ends the run at once.
pub async fn drive_jobs<J, T, E>(
    jobs: impl IntoIterator<Item = J>,
    concurrency: usize,
    shutdown: &Shutdown,
    mut on_result: impl FnMut(T) -> Result<(), E>,
) -> Result<Option<Signal>, E>
where
    J: Future<Output = T>,
{
    let mut stream = futures::stream::iter(jobs).buffer_unordered(concurrency.max(1));
    loop {
        // `biased`: a signal is seen before the next result, so a stop is prompt even when
        // results are ready back to back.
        let next = tokio::select! {
            biased;
            signal = shutdown.wait() => return Ok(Some(signal)),
            next = stream.next() => next,
        };
        match next {
            Some(result) => on_result(result)?,
            None => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hands_every_result_over_and_stops_at_the_first_error() {
        let jobs = (0..5).map(|i| async move { i });
        let mut seen = Vec::new();
        let signal = drive_jobs(jobs, 2, &Shutdown::never(), |i| {
            seen.push(i);
            Ok::<_, String>(())
        })
        .await
        .unwrap();
        assert_eq!(signal, None);
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);

        let jobs = (0..5).map(|i| async move { i });
        let mut handled = 0;
        let err = drive_jobs(jobs, 1, &Shutdown::never(), |i| {
            handled += 1;
            if i == 2 {
                Err(format!("cannot write {i}"))
            } else {
                Ok(())
            }
        })
        .await
        .unwrap_err();
        assert_eq!(err, "cannot write 2");
        assert_eq!(handled, 3, "nothing is handed over after the error");
    }
}
