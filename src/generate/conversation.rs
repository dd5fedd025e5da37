//! One conversation of N candidates per turn, S futures per candidate, every
//! session scored, the best candidate continues the real conversation.
//!
//! Everything that does not depend on another result runs concurrently: the candidates'
//! futures and their scoring overlap, so a turn costs one candidate round trip, the window's
//! messages and one judge round trip. The real next user message is an extra, independent
//! sample of the same simulator request that opens the futures (sample S of S+1): it is a fresh
//! draw on `history + chosen`, not one of the futures, and it adds no round trip.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::try_join_all;

use super::config::GenerateConfig;
use crate::llm::roles::Role;
use crate::llm::{ChatMessage, ChatRequest, FinishReason};
use crate::reward::metrics::Scorer;
use crate::rollout::futures::FutureRunner;
use crate::rollout::records::{now_secs, CandidateRecord, ConversationRecord, TurnRecord, Variant};
use crate::rollout::user::{derive_seed, SimError, UserSimulator};
use crate::task::prompts::{Prompts, SystemPromptSource};
use crate::task::twenty_questions::chat;
use crate::task::Task;

/// Everything a conversation needs; shared by all conversations of a run.
pub struct Pipeline {
    pub cfg: GenerateConfig,
    pub prompts: Arc<Prompts>,
    pub policy: Role,
    pub assistant: Role,
    pub user: UserSimulator,
    pub scorer: Scorer,
    /// `--system-prompt`: the policy's system prompt, the first message of every
    /// conversation (and so of every pair's prompt).
    pub system_prompt: Option<SystemPromptSource>,
}

struct Candidate {
    variant: Variant,
    text: String,
    finish: FinishReason,
}

impl Pipeline {
    fn seed(&self, task: &Task, parts: &[&str]) -> u64 {
        let mut all = vec![task.id.as_str()];
        all.extend_from_slice(parts);
        derive_seed(self.cfg.seed, &all)
    }

    /// The weights for a task: the configured ones, or the task type's defaults.
    pub fn weights_for(&self, task: &Task) -> BTreeMap<String, f64> {
        if self.cfg.metrics.is_empty() {
            crate::reward::metrics::default_weights(task.task_type)
        } else {
            self.cfg.metrics.clone()
        }
    }

    pub async fn run(&self, task: &Task) -> Result<ConversationRecord, SimError> {
        let started_at = now_secs();
        let weights = self.weights_for(task);
        let first_user = self
            .user
            .next_messages(task, &[], 1, self.seed(task, &["first-user"]))
            .await?
            .remove(0);
        // The run's system prompt opens the conversation, so pairs keep it in their prompt.
        let system = match &self.system_prompt {
            Some(s) => Some(s.text(&self.prompts, task.task_type)?),
            None => None,
        };
        let mut history: Vec<ChatMessage> = system.map(ChatMessage::system).into_iter().collect();
        match self.midgame_prefix(task, &first_user.text)? {
            Some(prefix) => history.extend(prefix),
            None => history.push(ChatMessage::user(first_user.text.clone())),
        }
        let mut turns = Vec::new();
        let mut ended_by = if first_user.terminated {
            "user_terminated"
        } else {
            "max_messages"
        };
        // max_messages counts the conversation from its opening message: not the system
        // prompt, nor a 20 Questions mid-game prefix.
        let offset = history.len() - 1;
        while !first_user.terminated && history.len() - offset < self.cfg.max_messages {
            let turn_id = turns.len() as u32;
            let (turn, next_user) = self.turn(task, &history, turn_id, &weights).await?;
            let chosen = &turn.candidates[turn.chosen];
            history.push(ChatMessage::assistant(chosen.text.clone()));
            turns.push(turn);
            if history.len() - offset >= self.cfg.max_messages {
                break;
            }
            if next_user.terminated {
                ended_by = "user_terminated";
                // The oracle's answer that ends a 20 Questions game (a win, or the last
                // question) is part of the game.
                if task.task_type.is_game() {
                    history.push(ChatMessage::user(next_user.text));
                }
                break;
            }
            history.push(ChatMessage::user(next_user.text));
        }
        Ok(ConversationRecord {
            task_id: task.id.clone(),
            task_type: task.task_type,
            goal: task.prompt.clone(),
            reference: task.reference.clone(),
            metadata: task.metadata.clone(),
            first_user,
            turns,
            messages: history,
            ended_by: ended_by.into(),
            weights,
            started_at,
            finished_at: now_secs(),
            // Filled in by the caller, which measures the whole conversation.
            usage: BTreeMap::new(),
        })
    }

    /// 20 Questions with `midgame`: the rules and the demonstrator's first questions, drawn
    /// per task (see [`chat::demonstrator_prefix`]); `None` otherwise.
    fn midgame_prefix(
        &self,
        task: &Task,
        intro: &str,
    ) -> Result<Option<Vec<ChatMessage>>, SimError> {
        if self.cfg.midgame == 0 || !task.task_type.is_game() {
            return Ok(None);
        }
        chat::task_prefix(
            task,
            intro,
            self.cfg.rollout.max_questions,
            self.cfg.midgame,
            self.seed(task, &["midgame"]),
        )
        .map(Some)
        .map_err(SimError::TwentyQuestions)
    }

    async fn turn(
        &self,
        task: &Task,
        history: &[ChatMessage],
        turn_id: u32,
        weights: &BTreeMap<String, f64>,
    ) -> Result<(TurnRecord, crate::rollout::user::UserTurn), SimError> {
        let t = turn_id.to_string();
        let candidates = self.candidates(task, history, &t).await?;
        let runner = self.futures();
        let (scored, mut next_users) = match &self.cfg.adaptive {
            Some(rule) => {
                let texts: Vec<&str> = candidates.iter().map(|c| c.text.as_str()).collect();
                let scored = runner
                    .score_replies_adaptive(
                        task,
                        history,
                        &texts,
                        weights,
                        self.cfg.mr_formula,
                        rule,
                        &[&t],
                    )
                    .await?;
                (scored, None)
            }
            None => {
                let mut scored = try_join_all(candidates.iter().enumerate().map(|(i, c)| {
                    let (runner, t) = (&runner, &t);
                    async move {
                        let i = i.to_string();
                        runner
                            .score_reply(task, history, &c.text, weights, &[t, &i], true)
                            .await
                    }
                }))
                .await?;
                let next_users = scored
                    .iter_mut()
                    .map(|s| {
                        s.next_user.take().ok_or(SimError::NoUserMessage {
                            attempts: 1,
                            last: String::new(),
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (scored, Some(next_users))
            }
        };
        let records: Vec<CandidateRecord> = candidates
            .into_iter()
            .zip(scored)
            .enumerate()
            .map(|(i, (c, scored))| CandidateRecord {
                index: i,
                variant: c.variant,
                text: c.text,
                finish_reason: c.finish,
                mr: scored.mr(weights, self.cfg.mr_formula),
                sessions: scored.sessions,
            })
            .collect();
        // The best MR continues; without any MR (every judge failed) the first candidate does.
        let chosen = records
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.mr.map(|m| (i, m)))
            .fold(None, |best: Option<(usize, f64)>, (i, m)| match best {
                Some((_, bm)) if bm >= m => best,
                _ => Some((i, m)),
            })
            .map_or(0, |(i, _)| i);
        // Fixed S draws every candidate's next user message with its futures (no extra round
        // trip); adaptive futures draw only the chosen one's, once the ranking is known.
        let next_user = match next_users.as_mut() {
            Some(all) => all.swap_remove(chosen),
            None => {
                let i = chosen.to_string();
                runner
                    .next_user(task, history, &records[chosen].text, &[&t, &i])
                    .await?
            }
        };
        Ok((
            TurnRecord {
                turn_id,
                history: history.to_vec(),
                candidates: records,
                chosen,
                next_user: Some(next_user.clone()),
            },
            next_user,
        ))
    }

    /// N replies: the proactive share prompted per `proactive_style`, the rest plain.
    async fn candidates(
        &self,
        task: &Task,
        history: &[ChatMessage],
        turn: &str,
    ) -> Result<Vec<Candidate>, SimError> {
        let n_pro = self.cfg.proactive_count();
        let n_plain = self.cfg.candidates - n_pro;
        let s = &self.cfg.policy_sampling;
        let request = |messages: Vec<ChatMessage>, n: usize, tag: &str| {
            s.request(messages)
                .n(n)
                .seed(self.seed(task, &["candidates", turn, tag]))
        };
        let proactive = async {
            if n_pro == 0 {
                return Ok(Vec::new());
            }
            let draw = super::proactive::ProactiveDraw {
                policy: &self.policy,
                prompts: &self.prompts,
                style: self.cfg.proactive_style,
                retries: self.cfg.proactive_retries,
            };
            let drawn = draw
                .draw(task, history, |m| request(m, n_pro, "proactive"))
                .await?;
            Ok::<_, SimError>(
                drawn
                    .into_iter()
                    .map(|d| Candidate {
                        variant: Variant::Proactive,
                        text: d.text,
                        finish: d.finish,
                    })
                    .collect::<Vec<_>>(),
            )
        };
        let call = |req: Option<ChatRequest>, variant: Variant| async move {
            let Some(req) = req else {
                return Ok(Vec::new());
            };
            let resp = self
                .policy
                .backend
                .chat(&req)
                .await
                .map_err(|e| SimError::Model {
                    role: self.policy.name.clone(),
                    source: e,
                })?;
            Ok::<_, SimError>(
                resp.choices
                    .into_iter()
                    .map(|c| Candidate {
                        variant,
                        text: c.content,
                        finish: c.finish_reason,
                    })
                    .collect::<Vec<_>>(),
            )
        };
        let (pro, plain) = futures::try_join!(
            proactive,
            call(
                (n_plain > 0).then(|| request(history.to_vec(), n_plain, "plain")),
                Variant::Plain
            ),
        )?;
        Ok(pro.into_iter().chain(plain).collect())
    }

    /// The runner that scores a candidate's futures (the shared rollout core).
    fn futures(&self) -> FutureRunner<'_> {
        FutureRunner {
            user: &self.user,
            assistant: &self.assistant,
            assistant_sampling: &self.cfg.assistant_sampling,
            scorer: &self.scorer,
            samples: self.cfg.future_cap(),
            window: self.cfg.window,
            run_seed: self.cfg.seed,
        }
    }
}
