//! Usage accounting per role: calls, tokens, retries, failures, cache hits, re-asks.
//!
//! A *re-ask* is a call made because an earlier answer was unusable (a judge reply without a
//! score, a simulator reply without a message): the caller marks it with [`reask`]. It is a
//! call like any other (it counts in `calls` and costs tokens) and is also counted in
//! `reasks`, so a run's summary can show how many calls the re-asks cost.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::spec::redact_credentials;
use super::{
    BackendId, ChatBackend, ChatMessage, ChatRequest, ChatResponse, LlmError, OptionProbs,
};

/// Lock-free counters shared by everything that calls one role's backend.
#[derive(Debug, Default)]
pub struct UsageMeter {
    calls: AtomicU64,
    cache_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    retries: AtomicU64,
    failures: AtomicU64,
    reasks: AtomicU64,
}

/// A point-in-time copy of a [`UsageMeter`], as written to manifests and summaries.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageSnapshot {
    /// Calls that reached the model (cache hits excluded).
    pub calls: u64,
    pub cache_hits: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub retries: u64,
    /// Calls that ended in an error after every retry.
    pub failures: u64,
    /// Calls that re-asked after an unusable answer (part of `calls`; see the module docs).
    #[serde(default)]
    pub reasks: u64,
}

impl UsageMeter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn add(&self, d: &UsageSnapshot) {
        self.calls.fetch_add(d.calls, Ordering::Relaxed);
        self.cache_hits.fetch_add(d.cache_hits, Ordering::Relaxed);
        self.prompt_tokens
            .fetch_add(d.prompt_tokens, Ordering::Relaxed);
        self.completion_tokens
            .fetch_add(d.completion_tokens, Ordering::Relaxed);
        self.retries.fetch_add(d.retries, Ordering::Relaxed);
        self.failures.fetch_add(d.failures, Ordering::Relaxed);
        self.reasks.fetch_add(d.reasks, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> UsageSnapshot {
        UsageSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            reasks: self.reasks.load(Ordering::Relaxed),
        }
    }
}

impl UsageSnapshot {
    const CACHE_HIT: Self = Self {
        calls: 0,
        cache_hits: 1,
        prompt_tokens: 0,
        completion_tokens: 0,
        retries: 0,
        failures: 0,
        reasks: 0,
    };

    /// What one answered call adds: a cache hit costs nothing but is counted as such.
    pub fn of_response(resp: &ChatResponse) -> Self {
        if resp.cached {
            return Self::CACHE_HIT;
        }
        Self {
            calls: 1,
            prompt_tokens: resp.usage.prompt_tokens,
            completion_tokens: resp.usage.completion_tokens,
            retries: u64::from(resp.retries),
            ..Self::default()
        }
    }

    pub fn of_probe(p: &OptionProbs) -> Self {
        if p.cached {
            return Self::CACHE_HIT;
        }
        Self {
            calls: 1,
            prompt_tokens: p.prompt_tokens,
            ..Self::default()
        }
    }

    pub fn of_failure(err: &LlmError) -> Self {
        Self {
            calls: 1,
            failures: 1,
            retries: u64::from(attempts(err).saturating_sub(1)),
            ..Self::default()
        }
    }
}

tokio::task_local! {
    static USAGE_SCOPE: Arc<UsageTally>;
}

/// Usage per role of every metered call made inside one future (see [`with_usage_scope`]).
#[derive(Debug, Default)]
struct UsageTally(std::sync::Mutex<BTreeMap<String, UsageSnapshot>>);

impl UsageTally {
    fn add(&self, role: &str, d: UsageSnapshot) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let e = map.entry(role.to_string()).or_default();
        *e = *e + d;
    }
}

fn add_to_scope(role: &str, d: UsageSnapshot) {
    // Outside a scope there is nothing to attribute the call to; the role's meter has it.
    let _ = USAGE_SCOPE.try_with(|t| t.add(role, d));
}

/// Runs `fut` and returns, beside its output, the usage per role of every call that a
/// [`MeteredBackend`] answered while polling it: what one conversation cost, even with many
/// conversations in flight on the same roles. Calls on spawned tasks are not attributed.
pub async fn with_usage_scope<F: std::future::Future>(
    fut: F,
) -> (F::Output, BTreeMap<String, UsageSnapshot>) {
    let tally = Arc::new(UsageTally::default());
    let out = USAGE_SCOPE.scope(tally.clone(), fut).await;
    let map = tally.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
    (out, map)
}

tokio::task_local! {
    static REASK: ();
}

/// Runs `call` marked as a re-ask (see the module docs) when `is_reask`; as is otherwise.
pub async fn reask<F: std::future::Future>(is_reask: bool, call: F) -> F::Output {
    if is_reask {
        REASK.scope((), call).await
    } else {
        call.await
    }
}

/// Whether the current call runs inside [`reask`].
pub(crate) fn in_reask() -> bool {
    REASK.try_with(|_| ()).is_ok()
}

/// Usage recorded in a run's manifest (`usage_total`, or `usage` for manifests written
/// before totals existed); empty when there is none.
pub fn recorded_usage(manifest: &std::path::Path) -> BTreeMap<String, UsageSnapshot> {
    match crate::run::Manifest::read(manifest) {
        Ok(Some(m)) => manifest_usage(&m),
        _ => BTreeMap::new(),
    }
}

/// The usage a read manifest records (see [`recorded_usage`]).
pub fn manifest_usage(m: &crate::run::Manifest) -> BTreeMap<String, UsageSnapshot> {
    let recorded = match m.field("usage_total") {
        serde_json::Value::Null => m.field("usage"),
        total => total,
    };
    serde_json::from_value(recorded.clone()).unwrap_or_default()
}

/// Attempts an endpoint made before it returned `err`.
pub(crate) fn attempts(err: &LlmError) -> u32 {
    match err {
        LlmError::RateLimited { attempts, .. }
        | LlmError::Server { attempts, .. }
        | LlmError::Timeout { attempts, .. }
        | LlmError::MalformedResponse { attempts, .. }
        | LlmError::Connection { attempts, .. }
        | LlmError::EmptyReply { attempts, .. } => *attempts,
        _ => 1,
    }
}

impl std::ops::Add for UsageSnapshot {
    type Output = UsageSnapshot;
    fn add(self, o: UsageSnapshot) -> UsageSnapshot {
        UsageSnapshot {
            calls: self.calls + o.calls,
            cache_hits: self.cache_hits + o.cache_hits,
            prompt_tokens: self.prompt_tokens + o.prompt_tokens,
            completion_tokens: self.completion_tokens + o.completion_tokens,
            retries: self.retries + o.retries,
            failures: self.failures + o.failures,
            reasks: self.reasks + o.reasks,
        }
    }
}

/// Adds two per-role usage tables.
pub fn add_usage(
    a: &BTreeMap<String, UsageSnapshot>,
    b: &BTreeMap<String, UsageSnapshot>,
) -> BTreeMap<String, UsageSnapshot> {
    let mut out = a.clone();
    for (role, u) in b {
        let t = out.entry(role.clone()).or_default();
        *t = *t + *u;
    }
    out
}

/// A backend whose every call is counted in a [`UsageMeter`]. Put it outermost (above the
/// cache) so that cache hits are counted as such.
pub struct MeteredBackend<B: ?Sized> {
    inner: Arc<B>,
    meter: Arc<UsageMeter>,
    /// The role name calls are attributed to inside a [`with_usage_scope`].
    role: String,
}

impl<B: ChatBackend + ?Sized> MeteredBackend<B> {
    pub fn new(inner: Arc<B>, meter: Arc<UsageMeter>, role: &str) -> Self {
        Self {
            inner,
            meter,
            role: role.to_string(),
        }
    }

    fn count(&self, mut d: UsageSnapshot) {
        if in_reask() {
            d.reasks = d.calls;
        }
        self.meter.add(&d);
        add_to_scope(&self.role, d);
    }
    pub fn meter(&self) -> &Arc<UsageMeter> {
        &self.meter
    }
}

#[async_trait]
impl<B: ChatBackend + ?Sized> ChatBackend for MeteredBackend<B> {
    fn id(&self) -> &BackendId {
        self.inner.id()
    }

    fn context_limits(&self) -> Option<super::ContextLimits> {
        self.inner.context_limits()
    }

    async fn chat(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        match self.inner.chat(req).await {
            Ok(resp) => {
                self.count(UsageSnapshot::of_response(&resp));
                Ok(resp)
            }
            Err(e) => {
                self.count(UsageSnapshot::of_failure(&e));
                Err(e)
            }
        }
    }

    async fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<OptionProbs, LlmError> {
        match self.inner.option_probs(messages, prefix, options).await {
            Ok(p) => {
                self.count(UsageSnapshot::of_probe(&p));
                Ok(p)
            }
            Err(e) => {
                self.count(UsageSnapshot::of_failure(&e));
                Err(e)
            }
        }
    }
}

/// What an endpoint charges, in USD per million tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// USD per million prompt tokens.
    pub input: f64,
    /// USD per million completion tokens.
    pub output: f64,
}

impl Price {
    /// Both rates finite and ≥ 0 (what a TOML config must also satisfy).
    pub fn is_valid(&self) -> bool {
        [self.input, self.output]
            .iter()
            .all(|x| x.is_finite() && *x >= 0.0)
    }
}

/// The first price of a config's table that is not [valid](Price::is_valid), as the message a
/// config error carries.
pub fn check_prices(prices: &BTreeMap<String, Price>) -> Result<(), String> {
    match prices.iter().find(|(_, p)| !p.is_valid()) {
        Some((spec, _)) => Err(format!("the price of {spec} must be finite numbers >= 0")),
        None => Ok(()),
    }
}

/// Parses `SPEC=INPUT,OUTPUT` (USD per million prompt and completion tokens), e.g.
/// `openai:gpt-4o-mini=0.15,0.60`.
pub fn parse_price(s: &str) -> Result<(String, Price), String> {
    let shown = redact_credentials(s);
    let (spec, rates) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("`{shown}`: expected SPEC=INPUT,OUTPUT (USD per million tokens)"))?;
    let (input, output) = rates
        .split_once(',')
        .ok_or_else(|| format!("`{shown}`: expected SPEC=INPUT,OUTPUT (USD per million tokens)"))?;
    let rate = |v: &str| -> Result<f64, String> {
        match v.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(format!("`{shown}`: `{v}` is not a price (a number ≥ 0)")),
        }
    };
    if spec.trim().is_empty() {
        return Err(format!("`{shown}`: the model spec before `=` is empty"));
    }
    Ok((
        // Keyed as the spec is shown everywhere else (no URL credentials).
        redact_credentials(spec.trim()),
        Price {
            input: rate(input)?,
            output: rate(output)?,
        },
    ))
}

/// One role as the cost computation sees it.
pub struct PricedRole<'a> {
    pub spec: &'a str,
    /// Local models cost nothing per token.
    pub local: bool,
    pub usage: UsageSnapshot,
}

/// `{"by_role": {role: usd | null}, "total": usd | null}`: local roles cost 0, endpoint roles
/// cost their answered tokens at the price given for their spec (`openai:<model>@<url>` or
/// `openai:<model>`), and are `null` without one. The total is `null` if any role is.
pub fn cost_usd(
    roles: &BTreeMap<String, PricedRole<'_>>,
    prices: &BTreeMap<String, Price>,
) -> serde_json::Value {
    let mut by_role = serde_json::Map::new();
    let mut total = Some(0.0);
    for (name, r) in roles {
        let cost = if r.local {
            Some(0.0)
        } else {
            let bare = r.spec.split_once('@').map_or(r.spec, |(m, _)| m);
            let priced = |key: &str| {
                prices.get(key).or_else(|| {
                    prices
                        .iter()
                        .find(|(k, _)| redact_credentials(k) == key)
                        .map(|(_, p)| p)
                })
            };
            priced(r.spec).or_else(|| priced(bare)).map(|p| {
                (r.usage.prompt_tokens as f64 * p.input
                    + r.usage.completion_tokens as f64 * p.output)
                    / 1e6
            })
        };
        total = total.zip(cost).map(|(t, c)| t + c);
        by_role.insert(name.clone(), serde_json::json!(cost));
    }
    serde_json::json!({"by_role": by_role, "total": total})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_tables_add_role_by_role() {
        let snap = |calls, prompt_tokens| UsageSnapshot {
            calls,
            prompt_tokens,
            ..UsageSnapshot::default()
        };
        let a = BTreeMap::from([
            ("user".to_string(), snap(2, 10)),
            ("judge".into(), snap(1, 5)),
        ]);
        let b = BTreeMap::from([
            ("user".to_string(), snap(3, 7)),
            ("policy".into(), snap(4, 1)),
        ]);
        assert_eq!(
            add_usage(&a, &b),
            BTreeMap::from([
                ("judge".to_string(), snap(1, 5)),
                ("policy".into(), snap(4, 1)),
                ("user".into(), snap(5, 17)),
            ])
        );
    }

    #[test]
    fn price_keys_and_errors_hide_url_credentials() {
        let (spec, p) = parse_price("openai:m@http://u:PASS@h/v1=1,2").unwrap();
        assert_eq!(spec, "openai:m@http://***@h/v1");
        let err = parse_price("openai:m@http://u:PASS@h/v1=x,2").unwrap_err();
        assert!(!err.contains("PASS"), "{err}");
        // A price keyed with the credentials (from a config file) still applies.
        let prices = BTreeMap::from([("openai:m@http://u:PASS@h/v1".to_string(), p)]);
        let usage = UsageSnapshot {
            prompt_tokens: 1_000_000,
            ..Default::default()
        };
        let role = PricedRole {
            spec: &spec,
            local: false,
            usage,
        };
        let cost = cost_usd(&BTreeMap::from([("policy".to_string(), role)]), &prices);
        assert_eq!(cost["total"], 1.0);
    }

    #[test]
    fn prices_parse_and_name_bad_input() {
        let (spec, p) = parse_price("openai:gpt-4o-mini@http://h:1/v1=0.15, 0.6").unwrap();
        assert_eq!(spec, "openai:gpt-4o-mini@http://h:1/v1");
        assert_eq!(
            p,
            Price {
                input: 0.15,
                output: 0.6
            }
        );
        for bad in ["gpt", "gpt=1", "gpt=a,1", "gpt=1,-2", "=1,2"] {
            let e = parse_price(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        // A TOML table skips the parser: the config check names the spec instead.
        let bad = Price {
            input: f64::NAN,
            output: 1.0,
        };
        let table = BTreeMap::from([("openai:m".to_string(), p), ("openai:x".to_string(), bad)]);
        let e = check_prices(&table).unwrap_err();
        assert!(e.contains("openai:x"), "{e}");
        assert!(check_prices(&BTreeMap::from([("openai:m".to_string(), p)])).is_ok());
    }

    #[test]
    fn cost_is_zero_for_local_priced_for_endpoints_and_null_when_unknown() {
        let usage = UsageSnapshot {
            prompt_tokens: 2_000_000,
            completion_tokens: 500_000,
            ..UsageSnapshot::default()
        };
        let role = |spec, local| PricedRole { spec, local, usage };
        let prices = BTreeMap::from([(
            "openai:m".to_string(),
            Price {
                input: 1.0,
                output: 4.0,
            },
        )]);
        let roles = BTreeMap::from([
            ("judge".to_string(), role("openai:m@http://x/v1", false)),
            ("policy".to_string(), role("default", true)),
        ]);
        let c = cost_usd(&roles, &prices);
        assert_eq!(c["by_role"]["judge"], 4.0);
        assert_eq!(c["by_role"]["policy"], 0.0);
        assert_eq!(c["total"], 4.0);
        let mut roles = roles;
        roles.insert("user".into(), role("openai:other", false));
        let c = cost_usd(&roles, &prices);
        assert!(c["by_role"]["user"].is_null());
        assert!(c["total"].is_null());
    }
}
