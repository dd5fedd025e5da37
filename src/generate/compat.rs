//! `--compat upstream-v2 | verl`: one flag that sets every generation
//! default where ours differs from upstream CollabLLM v2 or from verl's CollabLLM recipe
//! (docs/fidelity.md). Applied after the config file and before the other flags, so a flag
//! still wins; the manifest records the preset and every value it set.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::config::GenerateConfig;
pub use super::config::{Compat, CompatRecord};
use crate::llm::tokens::TokenCounterKind;
use crate::reward::judge::InteractivityScale;
use crate::reward::mr::MrFormula;

/// A judge answer cap large enough to stand for upstream's "no cap".
const UNCAPPED_JUDGE_TOKENS: usize = 4096;

impl Compat {
    /// Sets the preset's values on `cfg` and returns the record of what it set.
    pub fn apply(self, cfg: &mut GenerateConfig) -> CompatRecord {
        let mut set = BTreeMap::new();
        let mut put = |k: &str, v: Value| {
            set.insert(k.to_string(), v);
        };
        match self {
            Compat::UpstreamV2 => {
                // build_dataset.py: 2 candidates, temperature 0.8 for the assistant, pairs at
                // any gap, cl100k token counts, judges without a token cap.
                cfg.candidates = 2;
                put("candidates", json!(2));
                cfg.policy_sampling.temperature = 0.8;
                cfg.assistant_sampling.temperature = 0.8;
                put("policy_sampling.temperature", json!(0.8));
                put("assistant_sampling.temperature", json!(0.8));
                cfg.policy_sampling.top_p = 1.0;
                cfg.assistant_sampling.top_p = 1.0;
                put("policy_sampling.top_p", json!(1.0));
                put("assistant_sampling.top_p", json!(1.0));
                cfg.min_gap = 0.0;
                put("min_gap", json!(0.0));
                cfg.token_counter = TokenCounterKind::Cl100k;
                put("token_counter", json!(cfg.token_counter));
                cfg.rollout.judge_max_tokens = UNCAPPED_JUDGE_TOKENS;
                put("judge_max_tokens", json!(UNCAPPED_JUDGE_TOKENS));
                cfg.rollout.interactivity_scale = InteractivityScale::V2;
                put(
                    "interactivity_scale",
                    json!(cfg.rollout.interactivity_scale),
                );
                cfg.mr_formula = MrFormula::Mean;
                put("mr_formula", json!(cfg.mr_formula));
            }
            Compat::Verl => {
                // The recipe's reward: per-metric means clamped to [−1, 1], its interactivity
                // rubric, a word count (−1e-4 per word = the math default −0.1 per thousand).
                cfg.mr_formula = MrFormula::VerlClamp;
                put("mr_formula", json!(cfg.mr_formula));
                cfg.rollout.interactivity_scale = InteractivityScale::Verl;
                put(
                    "interactivity_scale",
                    json!(cfg.rollout.interactivity_scale),
                );
                cfg.token_counter = TokenCounterKind::Words;
                put("token_counter", json!(cfg.token_counter));
                cfg.samples = 3;
                put("samples", json!(3));
                cfg.window = 4;
                put("window", json!(4));
                cfg.policy_sampling.temperature = 1.0;
                put("policy_sampling.temperature", json!(1.0));
                cfg.policy_sampling.top_p = 1.0;
                put("policy_sampling.top_p", json!(1.0));
            }
        }
        CompatRecord { preset: self, set }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_set_upstream_values_and_say_which() {
        let mut cfg = GenerateConfig::default();
        let r = Compat::UpstreamV2.apply(&mut cfg);
        assert_eq!(cfg.candidates, 2);
        assert_eq!(cfg.policy_sampling.temperature, 0.8);
        assert_eq!(cfg.min_gap, 0.0);
        assert_eq!(cfg.token_counter, TokenCounterKind::Cl100k);
        assert_eq!(r.set["candidates"], json!(2));
        assert_eq!(r.set["token_counter"], json!("cl100k"));
        cfg.validate().unwrap();

        let mut cfg = GenerateConfig::default();
        let r = Compat::Verl.apply(&mut cfg);
        assert_eq!(cfg.mr_formula, MrFormula::VerlClamp);
        assert_eq!(cfg.rollout.interactivity_scale, InteractivityScale::Verl);
        assert_eq!(cfg.token_counter, TokenCounterKind::Words);
        assert_eq!(r.set["mr_formula"], json!("verl_clamp"));
        cfg.validate().unwrap();
        assert!("upstream-v1".parse::<Compat>().is_err());
    }
}
