//! Endpoint pools: one role served by several OpenAI-compatible servers of the same model
//! (`openai:<model>@<url1>,<url2>,…`, e.g. several vLLM replicas). Each call goes to the
//! least-loaded endpoint that is not backed off; an endpoint whose attempt fails (connection,
//! timeout, 429, 5xx, malformed answer) is backed off with a doubling delay and the call moves
//! on to another one, so a run completes while any endpoint answers. A request a member
//! refuses (4xx) goes to the others (a member with a wrong key, no such model or a shorter
//! context; 401/403/404 also back it off); it fails only when every member refused it. The pool has one cache identity (the
//! model and the endpoint list), so answers are reused whichever endpoint gave them.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::openai::OpenAiBackend;
use super::spec::EndpointOptions;
use super::{BackendId, ChatBackend, ChatRequest, ChatResponse, LlmError};

/// Calls and failures of one endpoint of a pool.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct EndpointStats {
    pub endpoint: String,
    pub calls: u64,
    pub failures: u64,
}

struct Member {
    backend: Arc<OpenAiBackend>,
    in_flight: AtomicUsize,
    calls: AtomicU64,
    failures: AtomicU64,
    /// Consecutive failures (the backoff doubles with each).
    streak: AtomicU32,
    down_until: Mutex<Option<Instant>>,
}

impl Member {
    fn down_until(&self) -> Option<Instant> {
        *self
            .down_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

pub struct PoolBackend {
    id: BackendId,
    members: Vec<Member>,
    opts: EndpointOptions,
}

/// What a member's failure says about the call.
enum Verdict {
    /// The request itself is wrong (our own validation): no endpoint will take it.
    Fatal,
    /// The member refused this request (4xx): another may accept it (a member with a wrong
    /// key, another model or a shorter context); the call fails once every member refused.
    Refused,
    /// The member is unwell (connection, timeout, 429, 5xx, malformed answer): back it off.
    Unwell,
}

fn verdict(e: &LlmError) -> Verdict {
    match e {
        LlmError::InvalidRequest(_) => Verdict::Fatal,
        LlmError::Rejected { .. } => Verdict::Refused,
        _ => Verdict::Unwell,
    }
}

/// Statuses that say the member itself is unusable (credentials, permissions, no such
/// model or route there): it is backed off like an unwell one, not only skipped for the call.
fn member_is_misconfigured(e: &LlmError) -> bool {
    matches!(
        e,
        LlmError::Rejected {
            status: 401 | 403 | 404,
            ..
        }
    )
}

impl PoolBackend {
    /// A pool over `base_urls` (at least two). Each member makes one attempt per pick; the
    /// pool makes up to `opts.max_retries` further attempts across its members.
    pub fn new(
        model: &str,
        base_urls: &[&str],
        opts: &EndpointOptions,
    ) -> Result<Arc<Self>, LlmError> {
        if base_urls.len() < 2 {
            return Err(LlmError::InvalidRequest(
                "an endpoint pool needs at least two base URLs".into(),
            ));
        }
        let single = EndpointOptions {
            max_retries: 0,
            ..opts.clone()
        };
        let members = base_urls
            .iter()
            .map(|u| {
                Ok(Member {
                    backend: OpenAiBackend::new(model, Some(u), &single)?,
                    in_flight: AtomicUsize::new(0),
                    calls: AtomicU64::new(0),
                    failures: AtomicU64::new(0),
                    streak: AtomicU32::new(0),
                    down_until: Mutex::new(None),
                })
            })
            .collect::<Result<Vec<_>, LlmError>>()?;
        let endpoint = members
            .iter()
            .map(|m| m.backend.id().endpoint.clone())
            .collect::<Vec<_>>()
            .join(",");
        Ok(Arc::new(Self {
            id: BackendId {
                kind: "openai".into(),
                model: model.to_string(),
                endpoint,
            },
            members,
            opts: opts.clone(),
        }))
    }

    /// Calls and failures per endpoint so far.
    pub fn stats(&self) -> Vec<EndpointStats> {
        self.members
            .iter()
            .map(|m| EndpointStats {
                endpoint: m.backend.id().endpoint.clone(),
                calls: m.calls.load(Ordering::Relaxed),
                failures: m.failures.load(Ordering::Relaxed),
            })
            .collect()
    }

    /// The least-loaded member that is up and not in `skip`, or the time the first one comes
    /// back.
    fn pick(&self, skip: &[usize]) -> Result<usize, Instant> {
        let now = Instant::now();
        let up = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, _)| !skip.contains(i))
            .filter(|(_, m)| m.down_until().is_none_or(|t| t <= now))
            .min_by_key(|(i, m)| {
                let calls = m.calls.load(Ordering::Relaxed) as usize;
                // Ties go to the member with fewer calls, then the first one.
                (m.in_flight.load(Ordering::Relaxed), calls, *i)
            });
        match up {
            Some((i, _)) => Ok(i),
            None => Err(self
                .members
                .iter()
                .filter_map(Member::down_until)
                .min()
                .unwrap_or(now)),
        }
    }

    fn back_off(&self, m: &Member) {
        let streak = m.streak.fetch_add(1, Ordering::Relaxed);
        let delay = (self.opts.backoff_base_s * 2f64.powi(streak.min(16) as i32))
            .min(self.opts.backoff_max_s)
            .max(0.0);
        *m.down_until.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Instant::now() + Duration::from_secs_f64(delay));
    }
}

#[async_trait]
impl ChatBackend for PoolBackend {
    fn id(&self) -> &BackendId {
        &self.id
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        req.validate()?;
        let attempts = (self.opts.max_retries as usize + 1).max(self.members.len());
        let mut last = None;
        // Members that refused this request: not asked again for it.
        let mut refused: Vec<usize> = Vec::new();
        for attempt in 0..attempts {
            let i = match self.pick(&refused) {
                Ok(i) => i,
                Err(back_at) => {
                    tokio::time::sleep_until(back_at.into()).await;
                    match self.pick(&refused) {
                        Ok(i) => i,
                        Err(_) => continue,
                    }
                }
            };
            let m = &self.members[i];
            m.in_flight.fetch_add(1, Ordering::Relaxed);
            m.calls.fetch_add(1, Ordering::Relaxed);
            let result = m.backend.chat(req).await;
            m.in_flight.fetch_sub(1, Ordering::Relaxed);
            match result {
                Ok(mut resp) => {
                    m.streak.store(0, Ordering::Relaxed);
                    resp.retries = attempt as u32;
                    return Ok(resp);
                }
                Err(e) => {
                    m.failures.fetch_add(1, Ordering::Relaxed);
                    match verdict(&e) {
                        Verdict::Fatal => return Err(e),
                        Verdict::Refused => {
                            refused.push(i);
                            if member_is_misconfigured(&e) {
                                self.back_off(m);
                            }
                            // Every member refused it (the request is at fault), or none
                            // other is up now: a refusal is not worth waiting out a backoff.
                            if self.pick(&refused).is_err() {
                                return Err(e);
                            }
                            tracing::warn!(endpoint = %m.backend.id().endpoint, error = %e, "pool endpoint refused the request; asking another");
                        }
                        Verdict::Unwell => {
                            tracing::warn!(endpoint = %m.backend.id().endpoint, error = %e, "pool endpoint failed; backing it off");
                            self.back_off(m);
                        }
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| {
            LlmError::InvalidRequest(format!("{}: no endpoint of the pool answered", self.id))
        }))
    }
}
