//! The simulated side of a conversation — the user simulator that answers the assistant and
//! the judge (and extractor) that scores what it produced — assembled in one place from a
//! run's [`RolloutConfig`], for generate_conv, eval_multiturn and rl_train alike. Each run
//! still loads its models its own way (generate_conv shares one local model between roles
//! with one spec, eval_multiturn loads at its `--weights`), then hands the two roles here.

use std::sync::Arc;

use crate::llm::cache::RequestCache;
use crate::llm::local::LoadOptions;
use crate::llm::roles::{Role, RoleError};
use crate::reward::judge::Judge;
use crate::task::prompts::Prompts;
use crate::task::twenty_questions::chat::OracleMode;

use super::config::RolloutConfig;
use super::user::UserSimulator;

/// The user simulator and the judge of a run.
pub struct Simulated {
    pub user: UserSimulator,
    pub judge: Arc<Judge>,
}

impl Simulated {
    /// The simulator and judge over roles already built, with `cfg`'s sampling, retries,
    /// token caps and judge mode (checked by [`RolloutConfig::validate`]: log-probability
    /// judging needs a local judge); `oracle` answers 20 Questions inside futures.
    pub fn new(
        user: Role,
        judge: Role,
        cfg: &RolloutConfig,
        prompts: Arc<Prompts>,
        oracle: OracleMode,
    ) -> Simulated {
        let judge = Arc::new(Judge {
            role: judge,
            prompts: prompts.clone(),
            mode: cfg.judge_mode,
            retries: cfg.judge_retries,
            max_tokens: cfg.judge_max_tokens,
            extract_max_tokens: cfg.extractor_max_tokens,
            interactivity_scale: cfg.interactivity_scale,
        });
        let user = UserSimulator {
            json: user.engine.is_none(),
            role: user,
            prompts,
            sampling: cfg.user_sampling.clone(),
            termination: cfg.termination.clone(),
            retries: cfg.user_retries,
            oracle,
            max_questions: cfg.max_questions,
        };
        Simulated { user, judge }
    }
}

/// Loads (or connects to) the user and judge models `cfg` names: local models once per
/// process, endpoints with the run's retry and concurrency settings.
pub async fn simulated_roles(
    cfg: &RolloutConfig,
    load: &LoadOptions,
    cache: Option<Arc<RequestCache>>,
) -> Result<(Role, Role), RoleError> {
    let user = Role::build("user", &cfg.user, &cfg.endpoint, load, cache.clone()).await?;
    let judge = Role::build("judge", &cfg.judge, &cfg.endpoint, load, cache).await?;
    Ok((user, judge))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::scripted::ScriptedBackend;

    fn endpoint_role(name: &str) -> Role {
        let backend = ScriptedBackend::new(name, |_, _| Ok(String::new()));
        Role::from_backend(name, "openai:gpt-4o-mini", backend, None, None)
    }

    /// The simulator and judge take the rollout settings (an endpoint user answers in JSON),
    /// and the settings refuse log-probability judging by an endpoint judge, naming it.
    #[test]
    fn the_simulated_side_takes_the_rollout_settings() {
        let prompts = Arc::new(Prompts::builtin().unwrap());
        let cfg = RolloutConfig {
            judge_retries: 5,
            user_retries: 2,
            judge_max_tokens: 33,
            termination: "[[BYE]]".into(),
            max_questions: 12,
            ..RolloutConfig::default()
        };
        let s = Simulated::new(
            endpoint_role("user"),
            endpoint_role("judge"),
            &cfg,
            prompts,
            OracleMode::Table,
        );
        assert!(s.user.json);
        assert_eq!(
            (
                s.user.retries,
                s.user.max_questions,
                s.user.termination.as_str()
            ),
            (2, 12, "[[BYE]]")
        );
        assert_eq!((s.judge.retries, s.judge.max_tokens), (5, 33));
        let logprob = RolloutConfig {
            judge_mode: crate::reward::judge::JudgeMode::Logprob,
            judge: "openai:gpt-4o-mini".parse().unwrap(),
            ..cfg
        };
        let e = logprob.validate().unwrap_err().to_string();
        assert!(
            e.contains("judge_mode") && e.contains("openai:gpt-4o-mini is an endpoint"),
            "{e}"
        );
        let local = RolloutConfig {
            judge: crate::llm::ModelSpec::Default,
            ..logprob
        };
        local.validate().unwrap();
    }
}
