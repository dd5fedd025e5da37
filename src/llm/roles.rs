//! A *role* (policy, simulated user, judge, future assistant) is a backend built from a model
//! spec, wrapped in the run's request cache and a usage meter of its own.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::cache::{CachedBackend, RequestCache};
use super::local::{LoadOptions, LocalBackend, LocalLoadError};
use super::openai::OpenAiBackend;
use super::pool::PoolBackend;
use super::usage::{cost_usd, MeteredBackend, Price, PricedRole, UsageMeter, UsageSnapshot};
use super::{ChatBackend, EndpointOptions, LlmError, ModelSpec, SharedBackend};
use crate::engine::Engine;

#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    #[error("--{role} {spec}: {source}")]
    Local {
        role: String,
        spec: String,
        #[source]
        source: LocalLoadError,
    },
    #[error("--{role} {spec}: {source}")]
    Remote {
        role: String,
        spec: String,
        #[source]
        source: LlmError,
    },
}

/// One role's backend, meter and (for local models) engine.
#[derive(Clone)]
pub struct Role {
    pub name: String,
    /// The spec as given (for manifests), or a description for injected backends.
    pub spec: String,
    /// Cached and metered: what the pipeline calls.
    pub backend: SharedBackend,
    pub meter: Arc<UsageMeter>,
    /// The local engine behind this role, if any (tokenizer, log-probability judging).
    pub engine: Option<Arc<Engine>>,
    /// The endpoint pool behind this role, if any (calls per endpoint for manifests).
    pub pool: Option<Arc<PoolBackend>>,
}

impl std::fmt::Debug for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Role")
            .field("name", &self.name)
            .field("spec", &self.spec)
            .finish()
    }
}

impl Role {
    /// Wraps any backend (tests inject scripted ones) in the cache and a fresh meter.
    pub fn from_backend(
        name: &str,
        spec: &str,
        inner: SharedBackend,
        cache: Option<Arc<RequestCache>>,
        engine: Option<Arc<Engine>>,
    ) -> Role {
        let cached: SharedBackend = match cache {
            Some(c) => Arc::new(CachedBackend::new(inner, c).for_role(name)),
            None => inner,
        };
        let meter = UsageMeter::new();
        let backend: SharedBackend = Arc::new(MeteredBackend::new(cached, meter.clone(), name));
        Role {
            name: name.to_string(),
            spec: spec.to_string(),
            backend,
            meter,
            engine,
            pool: None,
        }
    }

    /// Builds the role's backend from a model spec: local models load (once per process),
    /// endpoints get a client with the run's retry and concurrency settings.
    pub async fn build(
        name: &str,
        spec: &ModelSpec,
        endpoint: &EndpointOptions,
        load: &LoadOptions,
        cache: Option<Arc<RequestCache>>,
    ) -> Result<Role, RoleError> {
        match spec {
            ModelSpec::OpenAi { model, base_url } => {
                let remote = |source| RoleError::Remote {
                    role: name.into(),
                    spec: spec.to_string(),
                    source,
                };
                let urls: Vec<&str> = base_url
                    .as_deref()
                    .map(|b| {
                        b.split(',')
                            .map(|u| u.trim().trim_end_matches('/'))
                            .collect()
                    })
                    .unwrap_or_default();
                if urls.len() > 1 {
                    let pool = PoolBackend::new(model, &urls, endpoint).map_err(remote)?;
                    let mut role =
                        Self::from_backend(name, &spec.to_string(), pool.clone(), cache, None);
                    role.pool = Some(pool);
                    return Ok(role);
                }
                let b = OpenAiBackend::new(model, base_url.as_deref(), endpoint).map_err(remote)?;
                Ok(Self::from_backend(name, &spec.to_string(), b, cache, None))
            }
            _ => {
                let local = LocalBackend::load(spec, load)
                    .await
                    .map_err(|e| RoleError::Local {
                        role: name.into(),
                        spec: spec.to_string(),
                        source: e,
                    })?;
                let engine = local.engine().clone();
                Ok(Self::from_backend(
                    name,
                    &spec.to_string(),
                    local as Arc<dyn ChatBackend>,
                    cache,
                    Some(engine),
                ))
            }
        }
    }
}

/// [`cost_usd`] of `usage` for named roles: a role is local when it has an engine, and is
/// priced by its spec.
pub fn roles_cost_usd<'a>(
    roles: impl IntoIterator<Item = (String, &'a Role)>,
    usage: &BTreeMap<String, UsageSnapshot>,
    prices: &BTreeMap<String, Price>,
) -> serde_json::Value {
    let priced = roles
        .into_iter()
        .map(|(name, r)| {
            let role = PricedRole {
                spec: &r.spec,
                local: r.engine.is_some(),
                usage: usage.get(&name).copied().unwrap_or_default(),
            };
            (name, role)
        })
        .collect();
    cost_usd(&priced, prices)
}

/// A backend that puts a system message before every request's messages (a request that
/// already opens with a system message is left as it is): how a model is evaluated "with its
/// system prompt". Outside the cache, so cached answers are keyed with the system message.
struct SystemPromptBackend {
    inner: SharedBackend,
    system: String,
}

#[async_trait::async_trait]
impl ChatBackend for SystemPromptBackend {
    fn id(&self) -> &super::BackendId {
        self.inner.id()
    }

    async fn chat(&self, req: &super::ChatRequest) -> Result<super::ChatResponse, LlmError> {
        self.inner.chat(&self.with_system(req)).await
    }

    fn context_limits(&self) -> Option<super::ContextLimits> {
        self.inner.context_limits()
    }

    async fn chat_stream(
        &self,
        req: &super::ChatRequest,
        sink: &super::DeltaSink,
    ) -> Result<super::ChatResponse, LlmError> {
        self.inner.chat_stream(&self.with_system(req), sink).await
    }
}

impl SystemPromptBackend {
    fn with_system(&self, req: &super::ChatRequest) -> super::ChatRequest {
        let mut req = req.clone();
        if req.messages.first().is_none_or(|m| m.role != "system") {
            req.messages
                .insert(0, super::ChatMessage::system(self.system.clone()));
        }
        req
    }
}

impl Role {
    /// This role with `system` before every request (same meter and engine).
    pub fn with_system_prompt(&self, system: &str) -> Role {
        Role {
            backend: Arc::new(SystemPromptBackend {
                inner: self.backend.clone(),
                system: system.to_string(),
            }),
            ..self.clone()
        }
    }
}
