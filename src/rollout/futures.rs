//! Futures of a reply: the simulated user answers the reply, the assistant and
//! the user continue for up to `window` messages, S times, and every future is scored on
//! every metric. This is the one rollout core of the method: `generate_conv` ranks its
//! candidates with it and `rl_train` scores its sampled responses with it.
//!
//! Seeds are derived from (run seed, task id, purpose, caller's key), so a reply scored at
//! the same key draws the same simulator and judge samples, and cached calls are reused.

use std::collections::BTreeMap;

use futures::future::{join_all, try_join_all};
use serde::{Deserialize, Serialize};

use super::user::{derive_seed, rollout_future, Sampling, SimError, UserSimulator, UserTurn};
use crate::llm::roles::Role;
use crate::llm::ChatMessage;
use crate::reward::adaptive::AdaptiveRule;
use crate::reward::metrics::{MetricScore, Scorer};
use crate::reward::mr::{multiturn_reward, MrFormula, SessionScores};
use crate::task::twenty_questions::future::{DemonstratorBackend, FutureQuestioner};
use crate::task::Task;

/// The role that asks the later questions of 20 Questions futures when it is not the futures'
/// assistant model: the built-in demonstrator (no model call), metered as the assistant.
pub fn future_questioner_role(questioner: FutureQuestioner) -> Result<Option<Role>, String> {
    match questioner {
        FutureQuestioner::Policy => Ok(None),
        FutureQuestioner::Demonstrator => {
            let backend = std::sync::Arc::new(DemonstratorBackend::new()?);
            Ok(Some(Role::from_backend(
                "assistant",
                "20q-demonstrator",
                backend,
                None,
                None,
            )))
        }
    }
}

/// The reply as an assistant message, and the conversation it ends (`history` + reply): what
/// the simulated user answers.
fn after_reply(history: &[ChatMessage], reply: &str) -> (ChatMessage, Vec<ChatMessage>) {
    let reply = ChatMessage::assistant(reply.to_string());
    let base = history.iter().cloned().chain([reply.clone()]).collect();
    (reply, base)
}

/// One scored future of a reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The future after the reply (user first).
    pub messages: Vec<ChatMessage>,
    pub terminated: bool,
    pub user_raw: Vec<String>,
    /// metric → score of the whole session (history + reply + future).
    pub scores: BTreeMap<String, MetricScore>,
}

impl SessionRecord {
    pub fn values(&self) -> SessionScores {
        self.scores
            .iter()
            .map(|(k, v)| (k.clone(), v.value))
            .collect()
    }
}

/// A reply's futures and, when asked for, one extra independent user sample on
/// `history + reply` (the real next user turn of a generated conversation).
#[derive(Clone, Debug)]
pub struct ScoredReply {
    pub sessions: Vec<SessionRecord>,
    pub next_user: Option<UserTurn>,
}

impl ScoredReply {
    /// The multiturn-aware reward of the reply; `None` when no future has a score for
    /// every weighted metric (never a silent 0).
    pub fn mr(&self, weights: &BTreeMap<String, f64>, formula: MrFormula) -> Option<f64> {
        let per_session: Vec<SessionScores> =
            self.sessions.iter().map(SessionRecord::values).collect();
        multiturn_reward(&per_session, weights, formula)
    }
}

/// What scoring a reply needs; shared by every reply of a run.
pub struct FutureRunner<'a> {
    pub user: &'a UserSimulator,
    /// The model that plays the assistant inside futures.
    pub assistant: &'a Role,
    pub assistant_sampling: &'a Sampling,
    pub scorer: &'a Scorer,
    /// Futures per reply (S); 0 scores the reply alone (single-turn reward).
    pub samples: usize,
    /// Messages per future, the user's first one included.
    pub window: usize,
    pub run_seed: u64,
}

impl FutureRunner<'_> {
    fn seed(&self, task: &Task, purpose: &str, key: &[&str]) -> u64 {
        let mut parts = vec![task.id.as_str(), purpose];
        parts.extend_from_slice(key);
        derive_seed(self.run_seed, &parts)
    }

    /// Plays `samples` futures after `reply` (the next assistant message after `history`)
    /// and scores each on every metric of `weights`. The futures' openers are one simulator
    /// request with `samples (+1)` samples; with `with_next_user` the extra sample is
    /// returned as `next_user` and is not one of the futures.
    pub async fn score_reply(
        &self,
        task: &Task,
        history: &[ChatMessage],
        reply: &str,
        weights: &BTreeMap<String, f64>,
        key: &[&str],
        with_next_user: bool,
    ) -> Result<ScoredReply, SimError> {
        let (reply, base) = after_reply(history, reply);
        if self.samples == 0 {
            let mut scored = self.score_alone(task, history, reply, weights, key).await;
            // The real conversation still goes on from the chosen reply (generate_conv).
            if with_next_user {
                scored.next_user = Some(self.one_user_message(task, &base, key).await?);
            }
            return Ok(scored);
        }
        let extra = usize::from(with_next_user);
        let mut openers = self
            .user
            .next_messages(
                task,
                &base,
                self.samples + extra,
                self.seed(task, "future-user", key),
            )
            .await?;
        let next_user = if with_next_user {
            Some(openers.pop().ok_or(SimError::NoUserMessage {
                attempts: 1,
                last: String::new(),
            })?)
        } else {
            None
        };
        let sessions = try_join_all(openers.into_iter().enumerate().map(|(k, opener)| {
            let (base, reply) = (&base, &reply);
            async move {
                let k = k.to_string();
                let mut future_key = key.to_vec();
                future_key.push(&k);
                self.play_future(task, history, base, reply, opener, weights, &future_key)
                    .await
            }
        }))
        .await?;
        Ok(ScoredReply {
            sessions,
            next_user,
        })
    }

    /// One future after `base` (`history` + `reply`) opened by `opener`, scored on every
    /// metric of `weights`; `future_key` ends with the future's index.
    #[allow(clippy::too_many_arguments)]
    async fn play_future(
        &self,
        task: &Task,
        history: &[ChatMessage],
        base: &[ChatMessage],
        reply: &ChatMessage,
        opener: UserTurn,
        weights: &BTreeMap<String, f64>,
        future_key: &[&str],
    ) -> Result<SessionRecord, SimError> {
        let future = rollout_future(
            self.user,
            (self.assistant, self.assistant_sampling),
            task,
            base,
            opener,
            self.window,
            self.seed(task, "future", future_key),
        )
        .await?;
        let after: Vec<ChatMessage> = std::iter::once(reply.clone())
            .chain(future.messages.iter().cloned())
            .collect();
        let scores = self
            .score_session(task, history, &after, weights, future_key)
            .await;
        Ok(SessionRecord {
            messages: future.messages,
            terminated: future.terminated,
            user_raw: future.user_raw,
            scores,
        })
    }

    /// One simulated user message after `base`, drawn alone at `key`.
    async fn one_user_message(
        &self,
        task: &Task,
        base: &[ChatMessage],
        key: &[&str],
    ) -> Result<UserTurn, SimError> {
        self.user
            .next_messages(task, base, 1, self.seed(task, "future-user", key))
            .await?
            .pop()
            .ok_or(SimError::NoUserMessage {
                attempts: 1,
                last: String::new(),
            })
    }

    /// The real next user message after `reply` (an independent draw, not a future), as
    /// [`Self::score_reply`] returns it with `with_next_user` and `samples == 0`.
    pub async fn next_user(
        &self,
        task: &Task,
        history: &[ChatMessage],
        reply: &str,
        key: &[&str],
    ) -> Result<UserTurn, SimError> {
        self.one_user_message(task, &after_reply(history, reply).1, key)
            .await
    }

    /// Adaptive futures for the candidates of one turn (`replies`): each gets
    /// `rule.min_futures`, then one more per round while `rule` says its place (best, worst)
    /// is in doubt, up to `rule.max_futures` (see [`AdaptiveRule`]). Future k of candidate i
    /// is opened by its own simulator request at key `key + [i, k]`, so which futures a
    /// candidate had never changes the others' draws, and a rerun draws the same futures. A
    /// future with no reward (a metric missing) counts against the maximum but tells the
    /// rule nothing. `next_user` is not drawn (see [`Self::next_user`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn score_replies_adaptive(
        &self,
        task: &Task,
        history: &[ChatMessage],
        replies: &[&str],
        weights: &BTreeMap<String, f64>,
        formula: MrFormula,
        rule: &AdaptiveRule,
        key: &[&str],
    ) -> Result<Vec<ScoredReply>, SimError> {
        let bases: Vec<(ChatMessage, Vec<ChatMessage>)> =
            replies.iter().map(|r| after_reply(history, r)).collect();
        let mut sessions: Vec<Vec<SessionRecord>> = vec![Vec::new(); replies.len()];
        let mut rewards: Vec<Vec<f64>> = vec![Vec::new(); replies.len()];
        loop {
            let wanted: Vec<usize> = rule
                .wanted(&rewards)
                .into_iter()
                .filter(|&i| sessions[i].len() < rule.max_futures)
                .collect();
            if wanted.is_empty() {
                break;
            }
            // Candidates below the minimum get all their first futures in one round.
            let jobs: Vec<(usize, usize)> = wanted
                .iter()
                .flat_map(|&i| {
                    let have = sessions[i].len();
                    let upto = if have < rule.min_futures {
                        rule.min_futures
                    } else {
                        have + 1
                    };
                    (have..upto).map(move |k| (i, k))
                })
                .collect();
            let played = try_join_all(jobs.iter().map(|&(i, k)| {
                let (i_s, k_s) = (i.to_string(), k.to_string());
                let (reply, base) = &bases[i];
                async move {
                    let mut future_key = key.to_vec();
                    future_key.extend([i_s.as_str(), k_s.as_str()]);
                    let opener = self.one_user_message(task, base, &future_key).await?;
                    self.play_future(task, history, base, reply, opener, weights, &future_key)
                        .await
                }
            }))
            .await?;
            for (&(i, _), session) in jobs.iter().zip(played) {
                let reward =
                    multiturn_reward(std::slice::from_ref(&session.values()), weights, formula);
                rewards[i].extend(reward);
                sessions[i].push(session);
            }
        }
        Ok(sessions
            .into_iter()
            .map(|sessions| ScoredReply {
                sessions,
                next_user: None,
            })
            .collect())
    }

    /// `samples == 0`: the single-turn reward (the ablation of the paper and what TRL's
    /// GRPOTrainer optimises): one session with no future, the reply scored as the last turn.
    async fn score_alone(
        &self,
        task: &Task,
        history: &[ChatMessage],
        reply: ChatMessage,
        weights: &BTreeMap<String, f64>,
        key: &[&str],
    ) -> ScoredReply {
        let scores = self
            .score_session(task, history, &[reply], weights, key)
            .await;
        ScoredReply {
            sessions: vec![SessionRecord {
                messages: Vec::new(),
                terminated: false,
                user_raw: Vec::new(),
                scores,
            }],
            next_user: None,
        }
    }

    /// Every metric of one session, concurrently; a metric that fails is recorded as
    /// missing by the scorer, never as 0.
    async fn score_session(
        &self,
        task: &Task,
        history: &[ChatMessage],
        after: &[ChatMessage],
        weights: &BTreeMap<String, f64>,
        future_key: &[&str],
    ) -> BTreeMap<String, MetricScore> {
        join_all(weights.keys().map(|metric| async move {
            let mut parts = vec![metric.as_str()];
            parts.extend_from_slice(future_key);
            let seed = self.seed(task, "judge", &parts);
            let s = self.scorer.score(metric, task, history, after, seed).await;
            (metric.clone(), s)
        }))
        .await
        .into_iter()
        .collect()
    }
}
