//! `dpo_train`: offline preference training (TRL's DPO losses and metrics) and SFT.
//!
//! [`config`] holds the run's settings ([`TrainConfig`], embedding the shared
//! [`TrainerSettings`](crate::train::settings::TrainerSettings)); [`loss`] is
//! TRL's DPO loss family; [`run`] is the loop: reference log-probs (cached beside the data),
//! AdamW steps with accumulation, clipping and a warmup schedule, logs, evaluation,
//! checkpoints (HF or PEFT layout, optimizer state included) and `--resume`.

pub(crate) mod batches;
pub mod config;
pub mod loss;
pub mod run;

pub use config::{Objective, ResumeOverride, TrainConfig, DEFAULT_OUTPUT, RESUME_SETTINGS};
pub use run::{train, train_until, TrainSummary};
