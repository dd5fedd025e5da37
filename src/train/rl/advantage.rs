//! Group-relative advantages of outcome rewards (one scalar per response, broadcast to its
//! tokens by [`super::batch`]).
//!
//! - `grpo`: (R − mean) / (std + 1e-6) with the unbiased (n − 1) standard deviation, as verl's
//!   `compute_grpo_outcome_advantage` (`torch.std`, Bessel-corrected by default) computes it.
//! - `drgrpo`: R − mean, no division (Dr. GRPO; verl's `norm_adv_by_std_in_grpo=False`).
//! - `rloo`: R − mean of the other responses of the group (leave-one-out baseline).
//!
//! Responses without a valid reward leave their group before the statistics; a group left
//! with fewer than two rewards has no baseline and contributes no gradient.
//!
//! A *length-only* group — every response has the same score on every metric but the token
//! counts (`token_amount`, `reply_tokens`) — is counted, and by default skipped (zero
//! advantages): its rewards differ by a few thousandths, which GRPO's division by the
//! group's standard deviation would turn into ±1 advantages for "shorter" alone.

use std::fmt;
use std::str::FromStr;

use super::Group;

/// The epsilon verl adds to the group standard deviation.
pub const GRPO_STD_EPS: f64 = 1e-6;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Estimator {
    #[default]
    Grpo,
    DrGrpo,
    Rloo,
}

impl Estimator {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::DrGrpo => "drgrpo",
            Self::Rloo => "rloo",
        }
    }

    /// Advantages of a group's valid rewards, in order; `None` when fewer than two.
    pub fn advantages(self, rewards: &[f64]) -> Option<Vec<f64>> {
        let n = rewards.len();
        if n < 2 {
            return None;
        }
        // Equal rewards carry no signal; the rounding of their mean would otherwise become
        // an advantage of ~1e-10 / 1e-6 under GRPO's division.
        if rewards.iter().all(|r| *r == rewards[0]) {
            return Some(vec![0.0; n]);
        }
        let sum: f64 = rewards.iter().sum();
        let mean = sum / n as f64;
        Some(match self {
            Self::Grpo => {
                let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
                let denom = var.sqrt() + GRPO_STD_EPS;
                rewards.iter().map(|r| (r - mean) / denom).collect()
            }
            Self::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
            Self::Rloo => rewards
                .iter()
                .map(|r| r - (sum - r) / (n - 1) as f64)
                .collect(),
        })
    }
}

impl fmt::Display for Estimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Estimator {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grpo" => Ok(Self::Grpo),
            "drgrpo" | "dr_grpo" | "dr-grpo" => Ok(Self::DrGrpo),
            "rloo" => Ok(Self::Rloo),
            other => Err(format!(
                "unknown advantage estimator {other:?} (expected grpo, drgrpo or rloo)"
            )),
        }
    }
}

/// One response that carries gradient: its group and index there, and its advantage.
#[derive(Clone, Debug, PartialEq)]
pub struct Advantaged {
    pub group: usize,
    pub response: usize,
    pub advantage: f64,
}

/// What [`compute`] kept and dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdvantageStats {
    pub groups: usize,
    pub responses: usize,
    /// Responses dropped for a missing or non-finite reward.
    pub invalid_rewards: usize,
    /// Groups with fewer than two valid rewards (no gradient).
    pub degenerate_groups: usize,
    /// Groups whose valid rewards are all equal: zero advantage, so no policy gradient
    /// (they still count in the KL term).
    pub zero_variance_groups: usize,
    /// Groups whose rewards differ only in the token-count metrics (skipped unless kept).
    pub length_only_groups: usize,
    pub reward_mean: f64,
    pub advantage_abs_mean: f64,
}

impl AdvantageStats {
    pub fn named(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("groups", self.groups as f64),
            ("responses", self.responses as f64),
            ("invalid_rewards", self.invalid_rewards as f64),
            ("degenerate_groups", self.degenerate_groups as f64),
            ("zero_variance_groups", self.zero_variance_groups as f64),
            ("length_only_groups", self.length_only_groups as f64),
            ("reward_mean", self.reward_mean),
            ("advantage_abs_mean", self.advantage_abs_mean),
        ]
    }
}

/// Metrics that count tokens: a group that differs only in them is length-only.
pub const LENGTH_METRICS: &[&str] = &["token_amount", "reply_tokens"];

/// Whether the responses (valid ones, by index) differ in some reward but agree on every
/// metric that is not a token count, and have at least one such metric.
fn length_only(group: &Group, valid: &[(usize, f64)]) -> bool {
    let Some(&(first, r0)) = valid.first() else {
        return false;
    };
    let metrics = &group.responses[first].metrics;
    let other: Vec<(&String, &f64)> = metrics
        .iter()
        .filter(|(m, _)| !LENGTH_METRICS.contains(&m.as_str()))
        .collect();
    !other.is_empty()
        && valid.iter().any(|(_, r)| *r != r0)
        && valid.iter().all(|&(i, _)| {
            let m = &group.responses[i].metrics;
            other
                .iter()
                .all(|(k, v)| m.get(*k).is_some_and(|x| (x - *v).abs() <= 1e-12))
        })
}

/// Advantages of every response that trains, with counts of what was left out. With
/// `skip_length_only`, length-only groups get zero advantages.
pub fn compute(
    groups: &[Group],
    estimator: Estimator,
    skip_length_only: bool,
) -> (Vec<Advantaged>, AdvantageStats) {
    let mut out = Vec::new();
    let mut stats = AdvantageStats {
        groups: groups.len(),
        ..Default::default()
    };
    let mut reward_sum = 0.0;
    let mut reward_n = 0usize;
    for (g, group) in groups.iter().enumerate() {
        stats.responses += group.responses.len();
        let valid: Vec<(usize, f64)> = group
            .responses
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.reward.filter(|x| x.is_finite()).map(|x| (i, x)))
            .collect();
        stats.invalid_rewards += group.responses.len() - valid.len();
        let rewards: Vec<f64> = valid.iter().map(|v| v.1).collect();
        reward_sum += rewards.iter().sum::<f64>();
        reward_n += rewards.len();
        let Some(mut adv) = estimator.advantages(&rewards) else {
            stats.degenerate_groups += 1;
            continue;
        };
        if length_only(group, &valid) {
            stats.length_only_groups += 1;
            if skip_length_only {
                adv.iter_mut().for_each(|a| *a = 0.0);
            }
        }
        if rewards.iter().all(|r| *r == rewards[0]) {
            stats.zero_variance_groups += 1;
        }
        for ((i, _), a) in valid.into_iter().zip(adv) {
            out.push(Advantaged {
                group: g,
                response: i,
                advantage: a,
            });
        }
    }
    stats.reward_mean = if reward_n > 0 {
        reward_sum / reward_n as f64
    } else {
        0.0
    };
    stats.advantage_abs_mean = if out.is_empty() {
        0.0
    } else {
        out.iter().map(|a| a.advantage.abs()).sum::<f64>() / out.len() as f64
    };
    (out, stats)
}

#[cfg(test)]
mod tests {
    use super::super::ScoredResponse;
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-9, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn grpo_uses_the_unbiased_std() {
        // mean 2, unbiased var ((1)+(0)+(1))/2 = 1 → std 1.
        let a = Estimator::Grpo.advantages(&[1.0, 2.0, 3.0]).unwrap();
        let d = 1.0 + GRPO_STD_EPS;
        close(&a, &[-1.0 / d, 0.0, 1.0 / d]);
        // Two responses 0/1: unbiased std = 1/√2.
        let a = Estimator::Grpo.advantages(&[0.0, 1.0]).unwrap();
        let s = 0.5f64.sqrt() + GRPO_STD_EPS;
        close(&a, &[-0.5 / s, 0.5 / s]);
    }

    #[test]
    fn drgrpo_and_rloo() {
        close(
            &Estimator::DrGrpo.advantages(&[1.0, 2.0, 6.0]).unwrap(),
            &[-2.0, -1.0, 3.0],
        );
        // Leave-one-out: 1 − (2+6)/2, 2 − (1+6)/2, 6 − (1+2)/2.
        close(
            &Estimator::Rloo.advantages(&[1.0, 2.0, 6.0]).unwrap(),
            &[-3.0, -1.5, 4.5],
        );
        // RLOO = n/(n−1) · (R − mean).
        assert!(Estimator::Rloo.advantages(&[5.0]).is_none());
    }

    #[test]
    fn equal_rewards_give_zero_not_nan() {
        for e in [Estimator::Grpo, Estimator::DrGrpo, Estimator::Rloo] {
            let a = e.advantages(&[0.7, 0.7, 0.7]).unwrap();
            assert!(a.iter().all(|x| *x == 0.0), "{e}: {a:?}");
        }
    }

    fn group(rewards: &[Option<f64>]) -> Group {
        Group {
            task_id: "t".into(),
            prompt: vec![],
            responses: rewards
                .iter()
                .map(|r| ScoredResponse {
                    text: "x".into(),
                    reward: *r,
                    metrics: Default::default(),
                    truncated: false,
                    token_ids: None,
                })
                .collect(),
        }
    }

    #[test]
    fn invalid_rewards_leave_and_small_groups_drop() {
        let groups = vec![
            group(&[Some(1.0), None, Some(3.0), Some(f64::NAN)]),
            group(&[Some(1.0), None]),
            group(&[Some(2.0), Some(2.0)]),
        ];
        let (adv, stats) = compute(&groups, Estimator::DrGrpo, true);
        assert_eq!(stats.invalid_rewards, 3);
        assert_eq!(stats.degenerate_groups, 1);
        assert_eq!(stats.zero_variance_groups, 1);
        assert_eq!(stats.responses, 8);
        let got: Vec<_> = adv
            .iter()
            .map(|a| (a.group, a.response, a.advantage))
            .collect();
        assert_eq!(
            got,
            vec![(0, 0, -1.0), (0, 2, 1.0), (2, 0, 0.0), (2, 1, 0.0)]
        );
        // Mean over the 5 valid rewards.
        assert!((stats.reward_mean - 9.0 / 5.0).abs() < 1e-12);
    }

    #[test]
    fn parses_names() {
        for e in [Estimator::Grpo, Estimator::DrGrpo, Estimator::Rloo] {
            assert_eq!(e.as_str().parse::<Estimator>().unwrap(), e);
        }
        assert!("ppo".parse::<Estimator>().unwrap_err().contains("ppo"));
    }

    fn scored(reward: f64, metrics: &[(&str, f64)]) -> ScoredResponse {
        ScoredResponse {
            text: "x".into(),
            reward: Some(reward),
            metrics: metrics.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            truncated: false,
            token_ids: None,
        }
    }

    #[test]
    fn groups_that_differ_only_in_length_are_counted_and_skipped() {
        let group = |rs: Vec<ScoredResponse>| Group {
            task_id: "t".into(),
            prompt: vec![],
            responses: rs,
        };
        // Same info gain and success; only the token cost differs.
        let length_only = group(vec![
            scored(
                0.5 - 0.005,
                &[("info_gain", 0.5), ("success", 0.0), ("reply_tokens", 0.01)],
            ),
            scored(
                0.5 - 0.010,
                &[("info_gain", 0.5), ("success", 0.0), ("reply_tokens", 0.02)],
            ),
        ]);
        let real = group(vec![
            scored(0.9, &[("info_gain", 0.9), ("reply_tokens", 0.01)]),
            scored(0.1, &[("info_gain", 0.1), ("reply_tokens", 0.01)]),
        ]);
        // A reward of length alone (no other metric) is what the user asked for: kept.
        let pure_length = group(vec![
            scored(-0.01, &[("token_amount", 0.01)]),
            scored(-0.02, &[("token_amount", 0.02)]),
        ]);
        let groups = [length_only, real, pure_length];
        let (adv, stats) = compute(&groups, Estimator::Grpo, true);
        assert_eq!(stats.length_only_groups, 1);
        let of = |g: usize| -> Vec<f64> {
            adv.iter()
                .filter(|a| a.group == g)
                .map(|a| a.advantage)
                .collect()
        };
        assert_eq!(of(0), [0.0, 0.0], "skipped");
        assert!(of(1)[0] > 0.7 && of(2)[0] > 0.7, "{adv:?}");
        let (adv, stats) = compute(&groups, Estimator::Grpo, false);
        assert_eq!(stats.length_only_groups, 1, "counted when kept");
        assert!(adv
            .iter()
            .filter(|a| a.group == 0)
            .all(|a| a.advantage.abs() > 0.7));
    }
}
