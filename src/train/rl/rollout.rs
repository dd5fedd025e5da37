//! The rollout half of an RL step: for each of the step's prompts the simulated
//! user opens the conversation from the task's hidden goal, the *current* policy samples n
//! responses, and every response is continued S times by the simulated user and the same
//! policy and scored on every metric by the shared rollout core
//! ([`FutureRunner::score_reply`], the code generate_conv ranks its candidates with).
//!
//! A response whose futures failed, or that has no score for some weighted metric in any
//! future, has no reward: it stays in `rollouts.jsonl` with `reward: null` and leaves its
//! group (never scored 0). With `truncated = zero` (verl) a response cut at the token cap
//! plays no futures and its reward is 0.
//!
//! Each response keeps the token ids its sampler drew, which are what the update trains on.
//!
//! Seeds derive from (run seed, task, purpose, split, step, prompt, response), so a resumed
//! step draws the same samples and its cached calls are reused.

use std::collections::BTreeMap;
use std::time::Instant;

use futures::StreamExt;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use super::config::{Opening, RlRunConfig};
use super::{Group, ScoredResponse};
use crate::llm::roles::Role;
use crate::llm::{ChatMessage, FinishReason};
use crate::reward::metrics::{default_weights, Scorer};
use crate::reward::mr::MrFormula;
use crate::rollout::futures::{FutureRunner, ScoredReply, SessionRecord};
use crate::rollout::user::{derive_seed, SimError, UserSimulator};
use crate::task::twenty_questions::chat;
use crate::task::Task;

/// One sampled response, its futures and its scores.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResponseRecord {
    pub index: usize,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Tokens of the response (the policy's tokenizer).
    pub tokens: usize,
    /// The sampled token ids (end-of-turn included when sampled): what trains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    /// The reward the update used: MR under the configured formula; `null` = no valid
    /// score, the response left its group.
    pub reward: Option<f64>,
    /// MR under both formulas, whichever trained.
    pub mr_mean: Option<f64>,
    pub mr_verl_clamp: Option<f64>,
    /// metric → mean over the futures that have a score for it.
    pub metrics: BTreeMap<String, f64>,
    pub sessions: Vec<SessionRecord>,
    /// Why the futures could not be played, when they could not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One prompt of a step and its group of responses: a line of `rollouts.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub step: u64,
    /// `train`, or `eval` for held-out tasks.
    pub split: String,
    pub prompt_index: usize,
    pub task_id: String,
    /// The conversation prefix the policy answered (ends with a user message).
    pub prompt: Vec<ChatMessage>,
    /// Tokens of the prompt as the policy read it (chat template applied).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<usize>,
    pub weights: BTreeMap<String, f64>,
    pub responses: Vec<ResponseRecord>,
}

impl GroupRecord {
    /// The trainer's view of the group.
    pub fn to_group(&self) -> Group {
        Group {
            task_id: self.task_id.clone(),
            prompt: self.prompt.clone(),
            responses: self
                .responses
                .iter()
                .map(|r| ScoredResponse {
                    text: r.text.clone(),
                    reward: r.reward,
                    metrics: r.metrics.clone(),
                    truncated: r.finish_reason == FinishReason::Length,
                    token_ids: r.token_ids.clone(),
                })
                .collect(),
        }
    }
}

/// What one step's rollout produced and what it cost in time.
#[derive(Debug, Default)]
pub struct StepRollout {
    pub groups: Vec<GroupRecord>,
    /// Prompts the simulated user could not open: (task id, error).
    pub failed_prompts: Vec<(String, String)>,
    /// Seconds opening the prompts and sampling the responses.
    pub time_rollout: f64,
    /// Seconds playing and scoring the futures (judges included: they run interleaved).
    pub time_futures: f64,
}

/// One prompt of a step: its task (metrics, hidden goal) and, for `--opening dataset`, the
/// conversation prefix the policy answers.
#[derive(Clone, Debug, PartialEq)]
pub struct RlPrompt {
    pub task: Task,
    pub prefix: Option<Vec<ChatMessage>>,
}

impl RlPrompt {
    pub fn of_task(task: Task) -> Self {
        Self { task, prefix: None }
    }
}

/// Everything a rollout needs besides the policy (which changes every step).
pub struct Rollout<'a> {
    pub cfg: &'a RlRunConfig,
    pub user: &'a UserSimulator,
    /// Asks the later questions of 20 Questions futures instead of the policy, when set.
    pub future_questioner: Option<&'a Role>,
}

impl Rollout<'_> {
    fn seed(&self, task: &Task, parts: &[&str]) -> u64 {
        let mut all = vec![task.id.as_str()];
        all.extend_from_slice(parts);
        derive_seed(self.cfg.optim.seed, &all)
    }

    /// The metric weights of a task: the configured ones or its type's defaults.
    pub fn weights_for(&self, task: &Task) -> BTreeMap<String, f64> {
        if self.cfg.metrics.is_empty() {
            default_weights(task.task_type)
        } else {
            self.cfg.metrics.clone()
        }
    }

    /// Opens each prompt, samples `n` responses per prompt from `policy` and scores them.
    pub async fn step(
        &self,
        policy: &Role,
        scorer: &Scorer,
        split: &str,
        step: u64,
        prompts: &[RlPrompt],
        n: usize,
    ) -> anyhow::Result<StepRollout> {
        let started = Instant::now();
        let step_s = step.to_string();
        let opened = futures::future::join_all(prompts.iter().enumerate().map(|(i, p)| {
            let step_s = &step_s;
            async move {
                let i_s = i.to_string();
                let r = self.open(policy, p, split, step_s, &i_s, n).await;
                (i, &p.task, r)
            }
        }))
        .await;
        let mut out = StepRollout::default();
        let mut sampled = Vec::new();
        for (i, task, r) in opened {
            match r {
                Ok(Opened::Sampled(prompt, prompt_tokens, choices)) => {
                    sampled.push((i, task, prompt, choices, prompt_tokens))
                }
                Ok(Opened::UserFailed(e)) => {
                    tracing::warn!(task = %task.id, error = %e, "the simulated user could not open this prompt; it is left out of the step");
                    out.failed_prompts.push((task.id.clone(), e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        out.time_rollout = started.elapsed().as_secs_f64();

        let started = Instant::now();
        let runner = FutureRunner {
            user: self.user,
            assistant: self.future_questioner.unwrap_or(policy),
            assistant_sampling: &self.cfg.future_sampling(),
            scorer,
            samples: self.cfg.samples,
            window: self.cfg.window,
            run_seed: self.cfg.optim.seed,
        };
        // A response that plays no futures (verl: cut at the cap) costs no call.
        let truncated = self.cfg.truncated;
        let jobs: Vec<(usize, usize)> = sampled
            .iter()
            .enumerate()
            .flat_map(|(g, s)| {
                s.3.iter()
                    .enumerate()
                    .filter(move |(_, c)| !truncated.zeroes(c.finish))
                    .map(move |(j, _)| (g, j))
            })
            .collect();
        let scored: Vec<((usize, usize), Result<ScoredReply, SimError>)> =
            futures::stream::iter(jobs.into_iter().map(|(g, j)| {
                let (runner, sampled, step_s) = (&runner, &sampled, &step_s);
                async move {
                    let (i, task, prompt, choices, _) = &sampled[g];
                    let (i_s, j_s) = (i.to_string(), j.to_string());
                    let weights = self.weights_for(task);
                    let key = [split, step_s.as_str(), i_s.as_str(), j_s.as_str()];
                    let r = runner
                        .score_reply(task, prompt, &choices[j].text, &weights, &key, false)
                        .await;
                    ((g, j), r)
                }
            }))
            .buffer_unordered(self.cfg.rollout.concurrency)
            .collect()
            .await;
        let mut by_key: BTreeMap<(usize, usize), Result<ScoredReply, SimError>> =
            scored.into_iter().collect();
        for (g, (i, task, prompt, choices, prompt_tokens)) in sampled.into_iter().enumerate() {
            let weights = self.weights_for(task);
            let responses = choices
                .into_iter()
                .enumerate()
                .map(|(j, sample)| {
                    let scored = by_key.remove(&(g, j));
                    self.record(j, sample, &weights, scored)
                })
                .collect();
            out.groups.push(GroupRecord {
                step,
                split: split.to_string(),
                prompt_index: i,
                task_id: task.id.clone(),
                prompt,
                prompt_tokens: Some(prompt_tokens),
                weights,
                responses,
            });
        }
        out.time_futures = started.elapsed().as_secs_f64();
        Ok(out)
    }

    /// The prompt (the simulated user's opening message) and `n` sampled responses.
    async fn open(
        &self,
        policy: &Role,
        p: &RlPrompt,
        split: &str,
        step: &str,
        i: &str,
        n: usize,
    ) -> anyhow::Result<Opened> {
        let task = &p.task;
        let prompt = match (&p.prefix, self.cfg.opening) {
            (Some(prefix), _) => prefix.clone(),
            (None, _) if self.cfg.midgame > 0 && task.task_type.is_game() => {
                match self.midgame_prefix(task, split, step, i) {
                    Ok(prefix) => prefix,
                    Err(e) => return Ok(Opened::UserFailed(e)),
                }
            }
            (None, Opening::Task | Opening::Dataset) => {
                vec![ChatMessage::user(task.prompt.clone())]
            }
            (None, Opening::User) => match self.open_by_user(task, split, step, i).await {
                Ok(text) => vec![ChatMessage::user(text)],
                Err(e) => return Ok(Opened::UserFailed(e)),
            },
        };
        let prompt = if self.continues(task, split, step, i) {
            self.one_exchange_later(policy, task, prompt, split, step, i)
                .await?
        } else {
            prompt
        };
        let s = self.cfg.policy_sampling();
        let req = s
            .request(prompt.clone())
            .n(n)
            .seed(self.seed(task, &["rl-policy", split, step, i]));
        let resp = policy
            .backend
            .chat(&req)
            .await
            .map_err(|e| anyhow::anyhow!("policy sampling for task {}: {e}", task.id))?;
        let count = |t: &str| {
            policy
                .engine
                .as_ref()
                .and_then(|e| e.tokenizer().encode(t, false).ok())
                .map_or(0, |enc| enc.len())
        };
        let prompt_tokens = resp.usage.prompt_tokens as usize;
        let choices = resp
            .choices
            .into_iter()
            .map(|c| Sampled {
                tokens: c
                    .token_ids
                    .as_ref()
                    .map_or_else(|| count(&c.content), Vec::len),
                text: c.content,
                finish: c.finish_reason,
                token_ids: c.token_ids,
            })
            .collect();
        Ok(Opened::Sampled(prompt, prompt_tokens, choices))
    }

    /// Whether training prompt `i` of `step` starts one exchange later (`continue_rate`).
    fn continues(&self, task: &Task, split: &str, step: &str, i: &str) -> bool {
        let rate = self.cfg.continue_rate;
        if split != "train" || rate <= 0.0 {
            return false;
        }
        let seed = self.seed(task, &["rl-continue-draw", split, step, i]);
        rand::Rng::random_bool(&mut rand::rngs::StdRng::seed_from_u64(seed), rate.min(1.0))
    }

    /// `prompt` one exchange later: the policy's reply (one sample) and the simulated user's
    /// answer to it. Where the user ends the conversation instead (the reply finished the
    /// task), the opening is kept.
    async fn one_exchange_later(
        &self,
        policy: &Role,
        task: &Task,
        prompt: Vec<ChatMessage>,
        split: &str,
        step: &str,
        i: &str,
    ) -> anyhow::Result<Vec<ChatMessage>> {
        let req = self
            .cfg
            .policy_sampling()
            .request(prompt.clone())
            .seed(self.seed(task, &["rl-continue", split, step, i]));
        let resp = policy
            .backend
            .chat(&req)
            .await
            .map_err(|e| anyhow::anyhow!("policy sampling for task {}: {e}", task.id))?;
        let Some(reply) = resp.choices.into_iter().next() else {
            return Ok(prompt);
        };
        let mut later = prompt.clone();
        later.push(ChatMessage::assistant(reply.content));
        let seed = self.seed(task, &["rl-continue-user", split, step, i]);
        match self.user.next_messages(task, &later, 1, seed).await {
            Ok(turns) => match turns.into_iter().next() {
                Some(u) if !u.terminated => {
                    later.push(ChatMessage::user(u.text));
                    Ok(later)
                }
                _ => Ok(prompt),
            },
            Err(e) => {
                tracing::warn!(task = %task.id, error = %e, "the simulated user could not answer the policy's first reply; the prompt stays the opening");
                Ok(prompt)
            }
        }
    }

    /// A 20 Questions prompt after a demonstrator prefix drawn for (task, split, step, prompt).
    fn midgame_prefix(
        &self,
        task: &Task,
        split: &str,
        step: &str,
        i: &str,
    ) -> Result<Vec<ChatMessage>, SimError> {
        let intro = chat::intro_message(&self.user.prompts, self.user.max_questions)?;
        chat::task_prefix(
            task,
            &intro,
            self.user.max_questions,
            self.cfg.midgame,
            self.seed(task, &["rl-midgame", split, step, i]),
        )
        .map_err(SimError::TwentyQuestions)
    }

    /// The simulated user's opening message for `task`.
    async fn open_by_user(
        &self,
        task: &Task,
        split: &str,
        step: &str,
        i: &str,
    ) -> Result<String, SimError> {
        let seed = self.seed(task, &["rl-first-user", split, step, i]);
        let mut turns = self.user.next_messages(task, &[], 1, seed).await?;
        if turns.is_empty() {
            return Err(SimError::NoUserMessage {
                attempts: 1,
                last: String::new(),
            });
        }
        Ok(turns.remove(0).text)
    }

    fn record(
        &self,
        index: usize,
        sample: Sampled,
        weights: &BTreeMap<String, f64>,
        scored: Option<Result<ScoredReply, SimError>>,
    ) -> ResponseRecord {
        if self.cfg.truncated.zeroes(sample.finish) {
            return ResponseRecord {
                index,
                text: sample.text,
                finish_reason: sample.finish,
                tokens: sample.tokens,
                token_ids: sample.token_ids,
                reward: Some(0.0),
                mr_mean: Some(0.0),
                mr_verl_clamp: Some(0.0),
                metrics: BTreeMap::new(),
                sessions: Vec::new(),
                error: None,
            };
        }
        let (scored, error) = match scored {
            Some(Ok(s)) => (Some(s), None),
            Some(Err(e)) => (None, Some(e.to_string())),
            None => (None, Some("not scored".to_string())),
        };
        let mr = |f| scored.as_ref().and_then(|s| s.mr(weights, f));
        let (mr_mean, mr_verl_clamp) = (mr(MrFormula::Mean), mr(MrFormula::VerlClamp));
        let reward = match self.cfg.mr_formula {
            MrFormula::Mean => mr_mean,
            MrFormula::VerlClamp => mr_verl_clamp,
        };
        let sessions = scored.map(|s| s.sessions).unwrap_or_default();
        ResponseRecord {
            index,
            text: sample.text,
            finish_reason: sample.finish,
            tokens: sample.tokens,
            token_ids: sample.token_ids,
            reward,
            mr_mean,
            mr_verl_clamp,
            metrics: metric_means(&sessions, weights),
            sessions,
            error,
        }
    }
}

/// One sampled response before scoring.
struct Sampled {
    text: String,
    finish: FinishReason,
    /// Tokens (the sampled ids' count, else the policy tokenizer's count of the text).
    tokens: usize,
    token_ids: Option<Vec<u32>>,
}

enum Opened {
    /// The prompt, its token count and the sampled responses.
    Sampled(Vec<ChatMessage>, usize, Vec<Sampled>),
    UserFailed(SimError),
}

/// metric → mean over the sessions that scored it (a metric no session scored is absent).
fn metric_means(
    sessions: &[SessionRecord],
    weights: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    weights
        .keys()
        .filter_map(|m| {
            let vals: Vec<f64> = sessions
                .iter()
                .filter_map(|s| s.scores.get(m).and_then(|x| x.value))
                .collect();
            (!vals.is_empty()).then(|| (m.clone(), vals.iter().sum::<f64>() / vals.len() as f64))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::llm::scripted::ScriptedBackend;
    use crate::task::clarify::{self, Split};
    use crate::task::prompts::Prompts;

    /// `--continue-rate 1` on clarify: where the policy's first reply asks, the prompt becomes
    /// request, question, the user's answer; where it answers (the user ends), the opening
    /// stays. Evaluation prompts never continue.
    #[tokio::test]
    async fn prompts_continue_one_exchange_later_where_the_user_answers() {
        let cfg = RlRunConfig {
            continue_rate: 1.0,
            ..RlRunConfig::default()
        };
        let policy = ScriptedBackend::new("policy", |req, _| {
            // Asks on vague requests, answers on stated ones.
            let first = req.messages[0].content.as_str();
            Ok(if first.contains("my friend.") {
                "What is your friend's name?".to_string()
            } else {
                "Happy birthday!".to_string()
            })
        });
        let policy = Role::from_backend("policy", "scripted", policy, None, None);
        let user = UserSimulator {
            role: policy.clone(),
            prompts: Arc::new(Prompts::builtin().unwrap()),
            sampling: Default::default(),
            termination: "[[TERMINATE CHAT]]".into(),
            json: false,
            retries: 0,
            oracle: Default::default(),
            max_questions: 20,
        };
        let rollout = Rollout {
            cfg: &cfg,
            user: &user,
            future_questioner: None,
        };
        let tasks = clarify::tasks(Split::Train);
        let (vague, stated) = (&tasks[1], &tasks[0]);
        assert!(!clarify::is_stated(vague) && clarify::is_stated(stated));
        for (task, split, later) in [
            (vague, "train", true),
            (stated, "train", false),
            (vague, "eval", false),
        ] {
            let p = RlPrompt::of_task(task.clone());
            let Opened::Sampled(prompt, _, _) =
                rollout.open(&policy, &p, split, "1", "0", 2).await.unwrap()
            else {
                panic!("not opened")
            };
            if later {
                assert_eq!(prompt.len(), 3, "{prompt:?}");
                assert_eq!(prompt[1].content, "What is your friend's name?");
                assert_eq!(prompt[2].content, task.metadata["user_answer"]);
            } else {
                assert_eq!(prompt.len(), 1, "{prompt:?}");
            }
        }
        // The rate is a probability: 0 never continues.
        let never = RlRunConfig::default();
        let rollout = Rollout {
            cfg: &never,
            ..rollout
        };
        assert!(!rollout.continues(vague, "train", "1", "0"));
    }
}
