//! The local inference engine: everything that runs a model on this machine, and nothing that
//! talks to a remote one. Kernels by instruction set (`simd`, `q8`, `cpu_attention`) on one
//! set of compute threads (`team`), the llama-family forward pass (`llama`) read from GGUF or
//! HF safetensors through one config reader (`config`), tokenizers and chat templates, the
//! runtime that turns messages into tokens and samples (`runtime`), the prompt prefix cache,
//! and the continuous-batching scheduler (`scheduler`). Depends only on `check` and `run`;
//! `llm::local` puts it behind the chat-backend interface, `serve` behind HTTP, and `train`
//! shares its config reader, checkpoint checks and kernels.

pub(crate) mod byte_level;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod cpu_attention;
pub(crate) mod detok;
pub(crate) mod gguf_tokenizer;
pub(crate) mod huge_pages;
pub mod llama;
pub(crate) mod memory;
mod messages;
pub mod peft;
pub(crate) mod prefix_cache;
pub mod q8;
pub mod runtime;
pub(crate) mod sampling;
pub mod scheduler;
pub(crate) mod simd;
pub mod team;
#[cfg(test)]
pub(crate) mod test_util;
/// A tiny random llama for tests (`testing` feature).
#[cfg(any(test, feature = "testing"))]
pub mod tiny;
pub mod weights;

pub use messages::{ChatMessage, FinishReason, OptionProbs, TokenLogprob, TopLogprob};
pub use runtime::{
    base_hf_tensors, fingerprint, model_fingerprint, option_probs_after, weight_files, CancelFlag,
    ChatCodec, Engine, EngineError, EosRule, GenOutput, GenParams, GenState, Generation,
    LoadOptions, LocalModelFiles, Prefill, TokenSink,
};
