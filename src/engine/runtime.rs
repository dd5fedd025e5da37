//! The local inference engine: a loaded model with its tokenizer, chat template and
//! end-of-turn tokens, and generation (prefill once, decode `n` samples as one batch).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;
use super::config::ModelConfigError;
use super::detok::{self, IncrementalText};
use super::gguf_tokenizer::{meta_str, meta_u32, tokenizer_from_gguf};
use super::llama::{KvCache, LlamaConfig, LlamaModel, WeightFormat};
use super::prefix_cache::{self, Hit, PrefixCache};
use super::sampling::{restricted_probs, Sampler};
use super::team;
use super::{ChatMessage, FinishReason, TokenLogprob, TopLogprob};

/// Token strings that end a turn in common chat formats; those present in a vocabulary stop
/// generation in addition to the declared EOS id.
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end|>",
    "</s>",
];

/// Files of a local model after resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LocalModelFiles {
    Gguf(PathBuf),
    HfDir(PathBuf),
    /// A PEFT LoRA adapter directory and its resolved base model (merged at load).
    Adapter {
        dir: PathBuf,
        base: Box<LocalModelFiles>,
    },
}

impl LocalModelFiles {
    pub fn path(&self) -> &Path {
        match self {
            LocalModelFiles::Gguf(p) | LocalModelFiles::HfDir(p) => p,
            LocalModelFiles::Adapter { dir, .. } => dir,
        }
    }

    /// The model's configuration (an adapter's: its base's), read without loading weights.
    pub fn config(&self) -> Result<LlamaConfig, EngineError> {
        match self {
            LocalModelFiles::Gguf(p) => {
                let (_, content) = read_gguf(p)?;
                LlamaConfig::from_gguf_checked(&content).map_err(|e| load_err(p, e))
            }
            LocalModelFiles::HfDir(d) => read_hf_config(d),
            LocalModelFiles::Adapter { base, .. } => base.config(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{model}: {message}")]
    Generate { model: String, message: String },
    #[error("{model}: prompt of {prompt} tokens does not fit the context length {context}")]
    PromptTooLong {
        model: String,
        prompt: usize,
        context: usize,
    },
    /// Refused without tokenizing: no tokenization of this many bytes fits the context.
    #[error(
        "{model}: prompt of {bytes} bytes cannot fit the context length {context} \
         (no token of this model covers more than {max_token_bytes} bytes)"
    )]
    PromptTooManyBytes {
        model: String,
        bytes: usize,
        context: usize,
        max_token_bytes: usize,
    },
    #[error(
        "{model}: `max_tokens` = {max_tokens} plus the prompt's {prompt} tokens exceeds the \
         context length {context}"
    )]
    NoRoomForMaxTokens {
        model: String,
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    /// A chat template that rendered a conversation as no tokens.
    #[error(
        "{model}: the chat template ({template}) rendered these messages as no tokens; check \
         the template"
    )]
    EmptyChatPrompt { model: String, template: String },
    /// A chat request to a model without a chat template.
    #[error("{0}")]
    NoChatTemplate(String),
    /// A prompt the model cannot read (no tokens, ids outside the vocabulary).
    #[error("{model}: {message}")]
    InvalidPrompt { model: String, message: String },
    #[error("{model}: generation cancelled after {tokens} tokens")]
    Cancelled { model: String, tokens: usize },
    #[error(
        "{model}: the request needs {need_mib} MiB of key/value cache (a prompt of {prompt} \
         tokens, {n} × max_tokens {max_tokens}) but requests in flight may hold \
         {budget_mib} MiB: lower max_tokens or n, or raise the budget (serve --kv-cache-mb)"
    )]
    KvBudget {
        model: String,
        need_mib: usize,
        budget_mib: usize,
        prompt: usize,
        max_tokens: usize,
        n: usize,
    },
}

/// Set by whoever waits for a generation when it stops waiting (its client left); the
/// generation checks it before the prefill and at every decode step, so abandoned work stops
/// within one token.
#[derive(Clone, Debug, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// How to load a local model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    pub weights: WeightFormat,
    /// Cap on prompt + completion tokens (default: the model's own context length).
    pub context_length: Option<usize>,
    /// Memory for the KV caches of recent prompts, reused by prompts that start the same
    /// way (default 256 MiB; 0 turns reuse off).
    pub prefix_cache_mb: Option<usize>,
}

/// Sampling parameters of one generation call.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub temperature: f32,
    pub top_p: f32,
    pub max_new_tokens: usize,
    pub stop: Vec<String>,
    /// Sample `i` uses seed `seed + i`; `None` draws a fresh seed.
    pub seed: Option<u64>,
    pub n: usize,
    /// When a sampled end-of-sequence token ends a sample.
    pub eos: EosRule,
    /// Record each sampled token's log-probability and this many alternatives (≤ 20).
    pub logprobs: Option<usize>,
}

/// When a sampled end-of-sequence (end-of-turn) token ends a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EosRule {
    /// Only once the sample has visible text: the token is withheld before that. A chat
    /// reply is never empty (a small model's likeliest first token is often end-of-turn, and
    /// an empty reply answers nothing); chat requests and every role use this.
    #[default]
    AfterText,
    /// Wherever the model samples it, as transformers' `generate`, vLLM and llama.cpp do: raw
    /// completions, which must continue a prompt exactly as the model would (an empty text
    /// is an answer there). With log-probabilities the ending token is recorded too, as the
    /// last entry (harnesses that read one generated token after the prompt count on it).
    Stop,
    /// Never: every sample runs to `max_new_tokens` (fixed-length benchmarks).
    Ignore,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    pub text: String,
    pub finish: FinishReason,
    /// Tokens generated, the end-of-turn token included.
    pub tokens: usize,
    /// The sampled token ids, the end-of-turn token included when one was sampled: what an
    /// RL trainer trains on (decoding then re-encoding `text` need not give them back).
    pub token_ids: Vec<u32>,
    /// With `GenParams::logprobs`: each content token's log-probability (the end-of-turn
    /// token is not content).
    pub logprobs: Option<Vec<TokenLogprob>>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GenOutput {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from an earlier prompt's cache.
    pub cached_tokens: usize,
    pub samples: Vec<Generation>,
    /// Seconds spent on the prompt (one forward pass over what was not cached).
    pub prefill_secs: f64,
    /// Seconds spent decoding all samples.
    pub decode_secs: f64,
}

pub struct Engine {
    name: String,
    fingerprint: String,
    model: LlamaModel,
    codec: ChatCodec,
    context_length: usize,
    max_token_bytes: usize,
    prefix_cache: Mutex<PrefixCache>,
    /// Set once a text prompt that wrote out its own BOS was read with one BOS (logged once).
    bos_noted: AtomicBool,
}

/// The text side of a model: tokenizer, chat template and end-of-turn ids, loadable without
/// the weights (training tokenizes with it; the engine owns one).
#[derive(Clone)]
pub struct ChatCodec {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub eos_ids: Vec<u32>,
    /// `pad_token` / `unk_token` as the source declares them (GGUF ids, or the values of an
    /// HF `tokenizer_config.json`), written back by [`ChatCodec::save_hf`]: trainers such as
    /// TRL refuse a tokenizer without a pad token.
    pub special_tokens: serde_json::Map<String, serde_json::Value>,
}

/// The `tokenizer_config.json` keys kept in [`ChatCodec::special_tokens`].
const EXTRA_SPECIAL_TOKENS: [&str; 2] = ["pad_token", "unk_token"];

fn load_err(path: &Path, message: impl std::fmt::Display) -> EngineError {
    EngineError::Load {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

/// First 16 hex digits of the SHA-256 of the files' contents: identifies the weights in cache
/// keys, so a retrained checkpoint at the same path never reuses stale answers.
pub fn fingerprint(files: &[PathBuf]) -> Result<String, EngineError> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        let mut file = std::fs::File::open(f).map_err(|e| load_err(f, e))?;
        loop {
            let n = file.read(&mut buf).map_err(|e| load_err(f, e))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex::encode(h.finalize())[..16].to_string())
}

/// The weight files of a local model, in the order [`fingerprint`] reads them: a GGUF file; an
/// HF folder's safetensors; an adapter's base's, then its weights and config.
pub fn weight_files(files: &LocalModelFiles) -> Result<Vec<PathBuf>, EngineError> {
    Ok(match files {
        LocalModelFiles::Gguf(p) => vec![p.clone()],
        LocalModelFiles::HfDir(d) => safetensors_in(d)?,
        LocalModelFiles::Adapter { dir, base } => {
            let mut v = weight_files(base)?;
            v.push(dir.join(super::peft::ADAPTER_WEIGHTS));
            v.push(dir.join(super::peft::ADAPTER_CONFIG));
            v
        }
    })
}

/// A local model's identity before it is loaded: the [`fingerprint`] of its
/// [`weight_files`] (for a GGUF file or an HF folder, what [`Engine::fingerprint`] reports
/// once loaded).
pub fn model_fingerprint(files: &LocalModelFiles) -> Result<String, EngineError> {
    fingerprint(&weight_files(files)?)
}

fn json_ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| x as u32).into_iter().collect(),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn read_gguf(path: &Path) -> Result<(std::fs::File, gguf_file::Content), EngineError> {
    let mut file = std::fs::File::open(path).map_err(|e| load_err(path, e))?;
    let content = gguf_file::Content::read(&mut file)
        .map_err(|e| load_err(path, format!("not a readable GGUF file: {e}")))?;
    Ok((file, content))
}

fn read_json(dir: &Path, name: &str) -> Result<serde_json::Value, EngineError> {
    let p = dir.join(name);
    let text = std::fs::read_to_string(&p).map_err(|e| load_err(&p, e))?;
    serde_json::from_str(&text).map_err(|e| load_err(&p, format!("invalid JSON: {e}")))
}

/// `config.json` of an HF directory, through the one config reader (errors name the field).
fn read_hf_config(dir: &Path) -> Result<LlamaConfig, EngineError> {
    let path = dir.join("config.json");
    LlamaConfig::from_hf_json(&path).map_err(|e| match e {
        ModelConfigError::File { path, message } => EngineError::Load { path, message },
        ModelConfigError::Field {
            path,
            field,
            message,
        } => EngineError::Load {
            path,
            message: format!("`{field}`: {message}"),
        },
    })
}

fn safetensors_in(dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
    let mut weights: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| load_err(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && p.file_name()
                    .is_some_and(|n| n != super::peft::ADAPTER_WEIGHTS)
        })
        .collect();
    weights.sort();
    if weights.is_empty() {
        return Err(load_err(dir, "no *.safetensors weights"));
    }
    Ok(weights)
}

impl ChatCodec {
    /// The tokenizer, template and end ids of a local model (an adapter directory with its
    /// own tokenizer files uses them, else its base model's).
    pub fn load(files: &LocalModelFiles) -> Result<Self, EngineError> {
        match files {
            LocalModelFiles::Gguf(path) => Self::from_gguf(path, &read_gguf(path)?.1),
            LocalModelFiles::HfDir(dir) => Self::from_hf_dir(dir),
            LocalModelFiles::Adapter { dir, base } => {
                if dir.join("tokenizer.json").is_file()
                    && dir.join("tokenizer_config.json").is_file()
                {
                    Self::from_hf_dir(dir)
                } else {
                    Self::load(base)
                }
            }
        }
    }

    fn from_gguf(path: &Path, content: &gguf_file::Content) -> Result<Self, EngineError> {
        let tokenizer = tokenizer_from_gguf(content).map_err(|e| load_err(path, e))?;
        // A special token's id names a token of the vocabulary, or the file is refused (an
        // id of 4e9 would otherwise be an end-of-sequence that never comes, and a padding
        // id past the embedding table).
        let vocab = tokenizer.get_vocab_size(true);
        for key in [
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.padding_token_id",
            "tokenizer.ggml.unknown_token_id",
        ] {
            let Some(value) = content.metadata.get(key) else {
                continue;
            };
            if meta_u32(content, key).is_none_or(|id| (id as usize) >= vocab) {
                return Err(load_err(
                    path,
                    format!(
                        "`{key}` = {}: not a token id of this vocabulary ({vocab} tokens)",
                        crate::check::clip(&format!("{value:?}"), 80)
                    ),
                ));
            }
        }
        let token_str = |key: &str| {
            meta_u32(content, key)
                .and_then(|id| tokenizer.id_to_token(id))
                .unwrap_or_default()
        };
        let (bos, eos) = (
            token_str("tokenizer.ggml.bos_token_id"),
            token_str("tokenizer.ggml.eos_token_id"),
        );
        let name = path.display().to_string();
        let template = match meta_str(content, "tokenizer.chat_template") {
            Some(source) => {
                ChatTemplate::new(source, &name, &bos, &eos).map_err(|e| load_err(path, e))?
            }
            None => ChatTemplate::absent(&name, &bos, &eos),
        };
        let eos_ids = end_ids(
            &tokenizer,
            meta_u32(content, "tokenizer.ggml.eos_token_id").into_iter(),
        );
        let special_tokens = EXTRA_SPECIAL_TOKENS
            .iter()
            .zip([
                "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.unknown_token_id",
            ])
            .filter_map(|(name, key)| {
                let token = token_str(key);
                (!token.is_empty()).then(|| (name.to_string(), token.into()))
            })
            .collect();
        Ok(Self {
            tokenizer,
            template,
            eos_ids,
            special_tokens,
        })
    }

    fn from_hf_dir(dir: &Path) -> Result<Self, EngineError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| load_err(&tok_path, e))?;
        let tc_path = dir.join("tokenizer_config.json");
        if !tc_path.is_file() {
            return Err(load_err(&tc_path, "missing (it holds the chat template)"));
        }
        let template =
            ChatTemplate::from_tokenizer_config(&tc_path).map_err(|e| load_err(&tc_path, e))?;
        let mut declared = Vec::new();
        if dir.join("config.json").is_file() {
            declared.extend(json_ids(read_hf_config(dir)?.eos_token_id.as_ref()));
        }
        if dir.join("generation_config.json").is_file() {
            declared.extend(json_ids(
                read_json(dir, "generation_config.json")?.get("eos_token_id"),
            ));
        }
        declared.extend(tokenizer.token_to_id(template.eos_token()));
        let eos_ids = end_ids(&tokenizer, declared.into_iter());
        let source = read_json(dir, "tokenizer_config.json")?;
        let special_tokens = EXTRA_SPECIAL_TOKENS
            .iter()
            .filter_map(|k| Some((k.to_string(), source.get(*k)?.clone())))
            .filter(|(_, v)| !v.is_null())
            .collect();
        Ok(Self {
            tokenizer,
            template,
            eos_ids,
            special_tokens,
        })
    }

    /// The chat prompt as the model's own template writes it.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, super::chat_template::TemplateError> {
        self.template.render(messages, add_generation_prompt)
    }

    /// Token ids of a text whose special tokens are written out (as a rendered template is);
    /// no BOS/EOS is added, as in `apply_chat_template(tokenize=True)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizing: {e}"))
    }

    /// Writes `tokenizer.json` and a `tokenizer_config.json` carrying the chat template and
    /// BOS/EOS (and pad/unk, when known) tokens into `dir` (what an HF checkpoint needs to chat).
    pub fn save_hf(&self, dir: &Path) -> Result<(), EngineError> {
        let tok_path = dir.join("tokenizer.json");
        self.tokenizer
            .save(&tok_path, false)
            .map_err(|e| load_err(&tok_path, e))?;
        // A base model's checkpoint stays without a template (never an empty one).
        let template = match self.template.is_present() {
            true => serde_json::json!(self.template.source()),
            false => serde_json::Value::Null,
        };
        let mut cfg = serde_json::json!({
            "chat_template": template,
            "bos_token": self.template.bos_token(),
            "eos_token": self.template.eos_token(),
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false,
        });
        if let Some(obj) = cfg.as_object_mut() {
            obj.extend(self.special_tokens.clone());
        }
        let tc_path = dir.join("tokenizer_config.json");
        let text = serde_json::to_string_pretty(&cfg).map_err(|e| load_err(&tc_path, e))?;
        std::fs::write(&tc_path, text).map_err(|e| load_err(&tc_path, e))
    }
}

impl Engine {
    pub fn load(files: &LocalModelFiles, opts: &LoadOptions) -> Result<Engine, EngineError> {
        let device = Device::Cpu;
        let mut engine = match files {
            LocalModelFiles::Gguf(path) => Self::load_gguf(path, opts, &device)?,
            LocalModelFiles::HfDir(dir) => Self::load_hf_dir(dir, opts, &device)?,
            LocalModelFiles::Adapter { dir, base } => Self::load_adapter(dir, base, opts, &device)?,
        };
        if let Some(c) = opts.context_length {
            engine.context_length = engine.context_length.min(c);
        }
        engine.max_token_bytes = max_token_bytes(&engine.codec.tokenizer);
        Ok(engine)
    }

    fn load_gguf(path: &Path, opts: &LoadOptions, device: &Device) -> Result<Engine, EngineError> {
        let (mut file, content) = read_gguf(path)?;
        let cfg = LlamaConfig::from_gguf_checked(&content).map_err(|e| load_err(path, e))?;
        let codec = ChatCodec::from_gguf(path, &content)?;
        let context_length = cfg.context_length();
        let model = LlamaModel::from_gguf(&content, &mut file, cfg, opts.weights, device)
            .map_err(|e| load_err(path, format!("reading weights: {e}")))?;
        let prefix_cache = new_prefix_cache(&model, opts);
        Ok(Engine {
            name: model_name(path),
            fingerprint: fingerprint(&[path.to_path_buf()])?,
            model,
            codec,
            context_length,
            max_token_bytes: 0,
            prefix_cache,
            bos_noted: AtomicBool::new(false),
        })
    }

    fn load_hf_dir(dir: &Path, opts: &LoadOptions, device: &Device) -> Result<Engine, EngineError> {
        let cfg = read_hf_config(dir)?;
        let codec = ChatCodec::from_hf_dir(dir)?;
        let weights = safetensors_in(dir)?;
        let context_length = cfg.context_length();
        let model = LlamaModel::from_safetensors(&weights, cfg, opts.weights, device)
            .map_err(|e| load_err(dir, format!("reading weights: {e}")))?;
        let prefix_cache = new_prefix_cache(&model, opts);
        Ok(Engine {
            name: model_name(dir),
            fingerprint: fingerprint(&weights)?,
            model,
            codec,
            context_length,
            max_token_bytes: 0,
            prefix_cache,
            bos_noted: AtomicBool::new(false),
        })
    }

    /// A PEFT adapter: its base model's weights (f32) with the adapter merged in.
    fn load_adapter(
        dir: &Path,
        base: &LocalModelFiles,
        opts: &LoadOptions,
        device: &Device,
    ) -> Result<Engine, EngineError> {
        let (cfg, mut tensors, factors, base_files) = base_hf_tensors(base, device)?;
        let adapter = super::peft::Adapter::load(dir, device).map_err(|e| load_err(dir, e))?;
        adapter
            .merge_into(&mut tensors)
            .map_err(|e| load_err(dir, e))?;
        let codec = ChatCodec::load(&LocalModelFiles::Adapter {
            dir: dir.to_path_buf(),
            base: Box::new(base.clone()),
        })?;
        let context_length = cfg.context_length();
        let model = LlamaModel::from_hf_tensors(tensors, cfg, factors, opts.weights, device)
            .map_err(|e| load_err(dir, format!("building the merged model: {e}")))?;
        model.weights_on_huge_pages();
        let mut files = base_files;
        files.push(dir.join(super::peft::ADAPTER_WEIGHTS));
        files.push(dir.join(super::peft::ADAPTER_CONFIG));
        let prefix_cache = new_prefix_cache(&model, opts);
        Ok(Engine {
            name: model_name(dir),
            fingerprint: fingerprint(&files)?,
            model,
            codec,
            context_length,
            max_token_bytes: 0,
            prefix_cache,
            bos_noted: AtomicBool::new(false),
        })
    }

    /// An engine over a model built in memory (the weights of a policy being trained, see
    /// `train::rl::sync`); `fingerprint` names that version of the weights.
    pub fn from_parts(
        name: String,
        fingerprint: String,
        model: LlamaModel,
        codec: ChatCodec,
    ) -> Engine {
        let context_length = model.config().context_length();
        let max_token_bytes = max_token_bytes(&codec.tokenizer);
        let prefix_cache = new_prefix_cache(&model, &LoadOptions::default());
        Engine {
            name,
            fingerprint,
            model,
            codec,
            context_length,
            max_token_bytes,
            prefix_cache,
            bos_noted: AtomicBool::new(false),
        }
    }

    /// Uses the Jinja chat template in `path` instead of the model's own (a base model has
    /// none): what `serve --chat-template FILE` loads.
    pub fn set_chat_template(&mut self, path: &Path) -> Result<(), EngineError> {
        let source =
            super::chat_template::read_template_file(path).map_err(|e| load_err(path, e))?;
        self.codec.template = self
            .codec
            .template
            .replaced(&source, &path.display().to_string())
            .map_err(|e| load_err(path, e))?;
        Ok(())
    }

    /// Display name: the file stem or directory name.
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
    pub fn context_length(&self) -> usize {
        self.context_length
    }
    /// An upper bound on the bytes of text one token stands for: a text longer than
    /// `context_length × max_token_bytes` bytes cannot fit the context, whatever its tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.codec.tokenizer
    }
    pub fn template(&self) -> &ChatTemplate {
        &self.codec.template
    }
    pub fn codec(&self) -> &ChatCodec {
        &self.codec
    }
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }
    pub fn eos_ids(&self) -> &[u32] {
        &self.codec.eos_ids
    }

    fn gen_err(&self, message: impl std::fmt::Display) -> EngineError {
        EngineError::Generate {
            model: self.name.clone(),
            message: message.to_string(),
        }
    }

    /// The chat prompt as the model's own template writes it.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.render_conversation(messages, true)
    }

    /// The conversation as the model's own template writes it, with the assistant's opening
    /// when `add_generation_prompt`.
    pub fn render_conversation(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        self.codec
            .template
            .render(messages, add_generation_prompt)
            .map_err(|e| match e {
                super::chat_template::TemplateError::Missing { .. } => {
                    EngineError::NoChatTemplate(e.to_string())
                }
                e => self.gen_err(e),
            })
    }

    /// Token ids of a text whose special tokens are written out (as a rendered template is);
    /// no BOS/EOS is added, as in `apply_chat_template(tokenize=True)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.codec
            .tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| self.gen_err(format!("tokenizing: {e}")))
    }

    /// Token ids of raw prompt text as the tokenizer itself encodes it (`tokenizer(text)` in
    /// transformers: with the BOS a model's tokenizer adds, but not a second one when the text
    /// writes it out, see [`Engine::tokenize_text`]), refused when it cannot fit.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let ids = self.tokenize_text(text, true)?;
        self.check_prompt_ids(&ids)?;
        Ok(ids)
    }

    /// Token ids of `text`, refused only when its bytes alone prove it cannot fit the context.
    /// With `add_special_tokens` the tokenizer adds what it adds to a text (a BOS for most
    /// SentencePiece and Llama 3 vocabularies), except that a text which already starts with
    /// the BOS token gets no second one, as llama.cpp's server reads it: harnesses that
    /// decode token prompts back to text (lm-evaluation-harness with `add_bos_token`) write
    /// it out, and two BOS tokens put the model off-distribution.
    pub fn tokenize_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.check_prompt_bytes(text)?;
        let tokenizer = &self.codec.tokenizer;
        let encode = |text: &str, special: bool| {
            tokenizer
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| self.gen_err(format!("tokenizing: {e}")))
        };
        let mut ids = encode(text, add_special_tokens)?;
        if !add_special_tokens {
            return Ok(ids);
        }
        if let Some(bos) = self.added_bos()? {
            let written = tokenizer
                .id_to_token(bos)
                .is_some_and(|t| text.starts_with(t.as_str()));
            if written && ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                ids.remove(0);
                if !self.bos_noted.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        model = %self.name,
                        "a text prompt starts with the BOS token written out: it is read \
                         with that one BOS, none added (said once)"
                    );
                }
            }
        }
        Ok(ids)
    }

    /// The BOS id the tokenizer puts before every text it encodes with special tokens, if
    /// it adds one (what it makes of the empty text).
    pub fn added_bos(&self) -> Result<Option<u32>, EngineError> {
        let added = self
            .codec
            .tokenizer
            .encode("", true)
            .map_err(|e| self.gen_err(format!("tokenizing: {e}")))?;
        let bos = self
            .codec
            .tokenizer
            .token_to_id(self.codec.template.bos_token());
        Ok(added
            .get_ids()
            .first()
            .copied()
            .filter(|&id| Some(id) == bos))
    }

    /// The text of `ids` with their special tokens written out (`tokenizer.decode(ids)` in
    /// transformers, vLLM's `/detokenize`): encoded again with [`Engine::tokenize_text`] it
    /// gives the ids back. Ids outside the vocabulary are refused.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String, EngineError> {
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidPrompt {
                model: self.name.clone(),
                message: format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            });
        }
        self.codec
            .tokenizer
            .decode(ids, false)
            .map_err(|e| self.gen_err(format!("decoding: {e}")))
    }

    /// Refuses, before tokenizing (megabytes take seconds), text whose bytes alone prove it
    /// cannot fit the context.
    fn check_prompt_bytes(&self, text: &str) -> Result<(), EngineError> {
        if text.len() > self.context_length.saturating_mul(self.max_token_bytes) {
            return Err(EngineError::PromptTooManyBytes {
                model: self.name.clone(),
                bytes: text.len(),
                context: self.context_length,
                max_token_bytes: self.max_token_bytes,
            });
        }
        Ok(())
    }

    /// Refuses token ids outside the vocabulary, an empty prompt, or one that fills the context.
    pub fn check_prompt_ids(&self, ids: &[u32]) -> Result<(), EngineError> {
        if ids.is_empty() {
            return Err(EngineError::InvalidPrompt {
                model: self.name.clone(),
                message: "the prompt has no tokens".into(),
            });
        }
        if ids.len() >= self.context_length {
            return Err(EngineError::PromptTooLong {
                model: self.name.clone(),
                prompt: ids.len(),
                context: self.context_length,
            });
        }
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::InvalidPrompt {
                model: self.name.clone(),
                message: format!("token id {bad} is outside the vocabulary (0..{vocab})"),
            });
        }
        Ok(())
    }

    /// Each prompt token's log-probability given the tokens before it, from the second token
    /// on, with the `top` most likely alternatives (`echo` with `logprobs`). The prompt runs
    /// in pieces so that only one piece's vocabulary logits are held at once. Its keys and
    /// values are then stored as a prefilled prompt, so a continuation of it (the one token
    /// lm-evaluation-harness asks after each scored prompt) needs no second prefill.
    pub fn prompt_logprobs(
        &self,
        ids: &[u32],
        top: usize,
    ) -> Result<Vec<TokenLogprob>, EngineError> {
        const PIECE: usize = 128;
        self.check_prompt_ids(ids)?;
        let err = |e: candle_core::Error| self.gen_err(format!("scoring the prompt: {e}"));
        // A prompt that starts like a scored one (the same question before another choice)
        // takes that start's scores and stored keys and values, and runs only the rest.
        let reuse = {
            let mut stored = self.prefix_cache();
            match stored.scored_start(ids, top) {
                Some((shared, scores)) => stored
                    .lookup(ids)
                    .map_err(err)?
                    .map(|hit| (shared, scores, hit)),
                None => None,
            }
        };
        let (begin, mut out, mut cache) = match reuse {
            Some((shared, scores, Hit::Exact { .. })) if shared == ids.len() => {
                // The same prompt again: its scores, and its cache is already stored.
                return Ok(scores);
            }
            Some((shared, scores, hit)) => {
                let (cache, len) = match hit {
                    Hit::Exact { cache, .. } => (cache, ids.len()),
                    Hit::Prefix { cache, len } => (cache, len),
                };
                // Positions whose cache and next token's score are both stored.
                let begin = len.min(shared - 1);
                let cache = cache.prefix(begin, ids.len()).map_err(err)?;
                let mut out = scores;
                out.truncate(begin);
                (begin, out, cache)
            }
            None => (0, Vec::new(), self.model.new_cache(ids.len())),
        };
        out.reserve(ids.len() - 1 - out.len());
        let mut last = Vec::new();
        for (p, piece) in ids[begin..].chunks(PIECE).enumerate() {
            let t = Tensor::new(piece, self.model.device())
                .and_then(|t| t.unsqueeze(0))
                .map_err(err)?;
            let mut logits: Vec<Vec<f32>> = self
                .model
                .forward_all(&t, &mut cache)
                .and_then(|l| l.squeeze(0)?.to_dtype(DType::F32)?.to_vec2())
                .map_err(err)?;
            for (j, row) in logits.iter().enumerate() {
                let Some(&next) = ids.get(begin + p * PIECE + j + 1) else {
                    break;
                };
                let (lp, alts) = log_softmax_at(row, next, top);
                out.push(self.token_logprob(next, lp, &alts, false)?);
            }
            last = logits.pop().unwrap_or_default();
        }
        let mut stored = self.prefix_cache();
        stored.insert(ids, cache, last);
        stored.insert_scored(ids, top, out.clone());
        Ok(out)
    }

    /// The token ids of the chat prompt for `messages`, refused before tokenizing when its
    /// bytes alone prove it cannot fit the context (tokenizing megabytes takes seconds).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        let text = self.render(messages)?;
        self.check_prompt_bytes(&text)?;
        let ids = self.encode(&text)?;
        if ids.is_empty() {
            return Err(EngineError::EmptyChatPrompt {
                model: self.name.clone(),
                template: self.codec.template.source_name().to_string(),
            });
        }
        if ids.len() >= self.context_length {
            return Err(EngineError::PromptTooLong {
                model: self.name.clone(),
                prompt: ids.len(),
                context: self.context_length,
            });
        }
        Ok(ids)
    }

    /// A sampled token's log-probability record, each token's text decoded on its own and
    /// its bytes read from the vocabulary. `first`: the reply's first token, whose leading
    /// space a SentencePiece decoder drops from the reply's text (so its bytes drop it too).
    fn token_logprob(
        &self,
        id: u32,
        logprob: f32,
        top: &[(u32, f32)],
        first: bool,
    ) -> Result<TokenLogprob, EngineError> {
        let text_and_bytes = |id: u32| -> Result<(String, Vec<u8>), EngineError> {
            let text = self.decode(&[id])?;
            let mut bytes = detok::token_bytes(&self.codec.tokenizer, id);
            if first && bytes.first() == Some(&b' ') && !text.starts_with(' ') {
                bytes.remove(0);
            }
            Ok((text, bytes))
        };
        let (token, bytes) = text_and_bytes(id)?;
        Ok(TokenLogprob {
            id,
            token,
            bytes,
            logprob,
            top: top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = text_and_bytes(id)?;
                    Ok(TopLogprob {
                        id,
                        token,
                        bytes,
                        logprob,
                    })
                })
                .collect::<Result<_, EngineError>>()?,
        })
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.codec
            .tokenizer
            .decode(ids, true)
            .map_err(|e| self.gen_err(format!("decoding: {e}")))
    }

    /// Logits of the token that follows `ids` (through the prompt cache, like a generation).
    pub fn next_token_logits(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        if ids.is_empty() {
            return Err(self.gen_err("no tokens to continue"));
        }
        self.prefill_whole(ids)?
            .logits
            .ok_or_else(|| self.gen_err("internal: a finished prefill without logits"))
    }

    /// Probabilities of each option's first token after `prefix` opens the assistant's reply
    /// to `messages`, renormalised over the options.
    pub fn option_probs(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<super::messages::OptionProbs, EngineError> {
        let (ids, option_ids) = self.option_prompt(messages, prefix, options)?;
        let logits = self.next_token_logits(&ids)?;
        Ok(option_probs_after(ids.len(), &logits, &option_ids))
    }

    /// What [`Engine::option_probs`] prefills (the chat template's rendering of `messages`,
    /// then `prefix`) and each option's first token.
    pub fn option_prompt(
        &self,
        messages: &[ChatMessage],
        prefix: &str,
        options: &[String],
    ) -> Result<(Vec<u32>, Vec<u32>), EngineError> {
        let text = format!("{}{}", self.render(messages)?, prefix);
        let ids = self.encode(&text)?;
        let option_ids = options
            .iter()
            .map(|o| {
                self.encode(o)?
                    .first()
                    .copied()
                    .ok_or_else(|| self.gen_err(format!("option `{o}` has no tokens")))
            })
            .collect::<Result<Vec<u32>, _>>()?;
        Ok((ids, option_ids))
    }

    /// Generates `params.n` continuations of `prompt`: one prefill, then the samples decode
    /// together as one batch; a finished sample leaves the batch.
    pub fn generate(&self, prompt: &[u32], params: &GenParams) -> Result<GenOutput, EngineError> {
        self.generate_cancellable(prompt, params, &CancelFlag::default())
    }

    /// [`Engine::generate`] that stops with [`EngineError::Cancelled`] once `cancel` is set
    /// (checked before the prefill and before each decode step).
    pub fn generate_cancellable(
        &self,
        prompt: &[u32],
        params: &GenParams,
        cancel: &CancelFlag,
    ) -> Result<GenOutput, EngineError> {
        if cancel.is_cancelled() {
            return Err(self.cancelled(0));
        }
        let mut state = self.start(prompt, params)?;
        while !state.is_finished() {
            if cancel.is_cancelled() {
                return Err(self.cancelled(state.generated()));
            }
            self.step(&mut [&mut state])?;
        }
        self.finish(state)
    }

    /// The error of a generation stopped after `tokens` tokens because its caller left.
    pub fn cancelled(&self, tokens: usize) -> EngineError {
        EngineError::Cancelled {
            model: self.name.clone(),
            tokens,
        }
    }

    /// Starts a generation: checks the prompt, prefills it once and copies its cache into
    /// `params.n` rows. [`Engine::step`] then decodes it, alone or beside others.
    pub fn start(&self, prompt: &[u32], params: &GenParams) -> Result<GenState, EngineError> {
        let prefill = self.prefill_whole(prompt)?;
        self.start_prefilled(prefill, params)
    }

    /// The whole prompt prefilled at once (from the longest stored prompt that begins the
    /// same way).
    fn prefill_whole(&self, prompt: &[u32]) -> Result<Prefill, EngineError> {
        let mut prefill = self.begin_prefill(prompt)?;
        self.prefill_chunk(&mut prefill, usize::MAX)?;
        Ok(prefill)
    }

    /// Checks a prompt and starts its prefill from the longest stored prompt that begins
    /// the same way ([`Engine::prefill_chunk`] runs the rest, in pieces of any size: the
    /// cache and logits come out the same bits as one whole prefill).
    pub fn begin_prefill(&self, prompt: &[u32]) -> Result<Prefill, EngineError> {
        let context = self.context_length;
        if prompt.is_empty() || prompt.len() >= context {
            return Err(EngineError::PromptTooLong {
                model: self.name.clone(),
                prompt: prompt.len(),
                context,
            });
        }
        let started = std::time::Instant::now();
        let hit = self
            .prefix_cache()
            .lookup(prompt)
            .map_err(|e| self.gen_err(e))?;
        let (cache, done, logits) = match hit {
            Some(Hit::Exact { cache, logits }) => (cache, prompt.len(), Some(logits)),
            Some(Hit::Prefix { cache, len }) => (cache, len, None),
            None => (self.model.new_cache(prompt.len()), 0, None),
        };
        Ok(Prefill {
            prompt: prompt.to_vec(),
            cached_tokens: done,
            done,
            cache,
            logits,
            secs: started.elapsed().as_secs_f64(),
        })
    }

    /// Runs up to `max_tokens` more prompt positions of `prefill`; true once the whole
    /// prompt is in its cache (the finished prompt is then stored for later ones).
    pub fn prefill_chunk(
        &self,
        prefill: &mut Prefill,
        max_tokens: usize,
    ) -> Result<bool, EngineError> {
        if prefill.logits.is_some() {
            return Ok(true);
        }
        let started = std::time::Instant::now();
        let err = |e: candle_core::Error| self.gen_err(e);
        let end = prefill
            .prompt
            .len()
            .min(prefill.done.saturating_add(max_tokens.max(1)));
        let input = Tensor::new(&prefill.prompt[prefill.done..end], self.model.device())
            .and_then(|t| t.unsqueeze(0))
            .map_err(err)?;
        let last = self
            .model
            .forward_last(&input, &mut prefill.cache)
            .map_err(err)?;
        prefill.done = end;
        if end == prefill.prompt.len() {
            let logits = last
                .squeeze(0)
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(err)?;
            self.prefix_cache()
                .insert(&prefill.prompt, prefill.cache.clone(), logits.clone());
            prefill.logits = Some(logits);
        }
        prefill.secs += started.elapsed().as_secs_f64();
        Ok(prefill.logits.is_some())
    }

    /// Runs up to `max_tokens[i]` more prompt positions of each of `prefills` (at least one
    /// each while any remain) in one forward pass on the CPU, whose linear layers then read
    /// their weights once for all of them (one prefill after another on other devices).
    /// Each cache and its logits come out the bits of [`Engine::prefill_chunk`] on that prefill
    /// alone. Returns which prefills are finished.
    pub fn prefill_chunks(
        &self,
        prefills: &mut [&mut Prefill],
        max_tokens: &[usize],
    ) -> Result<Vec<bool>, EngineError> {
        if prefills.len() != max_tokens.len() {
            return Err(self.gen_err(format!(
                "internal: {} prefills with {} chunk sizes",
                prefills.len(),
                max_tokens.len()
            )));
        }
        let pending = prefills.iter().filter(|p| p.logits.is_none()).count();
        if pending <= 1 || !self.model.device().is_cpu() {
            return prefills
                .iter_mut()
                .zip(max_tokens)
                .map(|(p, &n)| self.prefill_chunk(p, n))
                .collect();
        }
        let started = std::time::Instant::now();
        let mut tokens: Vec<&[u32]> = Vec::with_capacity(pending);
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(pending);
        let mut ends = Vec::with_capacity(pending);
        for (p, &n) in prefills.iter_mut().zip(max_tokens) {
            let Prefill {
                prompt,
                done,
                cache,
                logits,
                ..
            } = &mut **p;
            if logits.is_none() {
                let end = prompt.len().min(done.saturating_add(n.max(1)));
                tokens.push(&prompt[*done..end]);
                caches.push(cache);
                ends.push(end);
            }
        }
        let last = self
            .model
            .forward_prefill(&tokens, &mut caches)
            .map_err(|e| self.gen_err(e))?;
        drop((tokens, caches));
        let mut last = last.into_iter().zip(ends);
        for p in prefills.iter_mut().filter(|p| p.logits.is_none()) {
            let (logits, end) = last.next().expect("one result per pending prefill");
            p.done = end;
            if end == p.prompt.len() {
                let logits = logits
                    .squeeze(0)
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| self.gen_err(e))?;
                self.prefix_cache()
                    .insert(&p.prompt, p.cache.clone(), logits.clone());
                p.logits = Some(logits);
            }
            p.secs += started.elapsed().as_secs_f64();
        }
        Ok(prefills.iter().map(|p| p.logits.is_some()).collect())
    }

    /// Bytes of key/value cache a generation of `n` rows and at most `max_new_tokens` from
    /// `prefill` will hold beyond what the prompt cache stores: the prompt positions the
    /// prefill computes (one row), what [`Engine::start_prefilled`]'s fork copies into each
    /// row (on the CPU nothing for a cold prompt, which the rows share; a prompt begun from
    /// a stored prefix copies the positions after it), and each row's room for new tokens
    /// as it grows ([`KV_GROWTH`] positions at a time). An upper bound, exact for a cold
    /// prompt on the CPU (tested).
    pub fn kv_reservation(&self, prefill: &Prefill, n: usize, max_new_tokens: usize) -> usize {
        let prompt = prefill.prompt.len();
        let shared = prefill.cache.shared_len().min(prompt);
        let max_new = self.new_tokens_after(prompt, max_new_tokens);
        let room = if max_new <= KV_GROWTH {
            max_new.max(1)
        } else {
            max_new.div_ceil(KV_GROWTH) * KV_GROWTH
        };
        let computed = prompt - shared;
        let copied = match (self.model.device().is_cpu(), shared) {
            (false, _) => prompt,
            (true, 0) => 0,
            (true, _) => computed,
        };
        let positions = computed.saturating_add(n.saturating_mul(copied + room));
        positions.saturating_mul(self.model.kv_bytes_per_position())
    }

    /// Tokens a generation after a prompt of `prompt` tokens may produce when `max_tokens`
    /// are asked for: what the context leaves, at most.
    pub fn new_tokens_after(&self, prompt: usize, max_tokens: usize) -> usize {
        max_tokens.min(self.context_length.saturating_sub(prompt))
    }

    /// Bytes one cached position takes over all layers (keys and values).
    pub fn kv_bytes_per_position(&self) -> usize {
        self.model.kv_bytes_per_position()
    }

    /// A generation from a finished prefill: its cache copied into `params.n` rows.
    pub fn start_prefilled(
        &self,
        prefill: Prefill,
        params: &GenParams,
    ) -> Result<GenState, EngineError> {
        let Prefill {
            prompt,
            cached_tokens,
            cache: prefill_cache,
            logits,
            secs: prefill_secs,
            ..
        } = prefill;
        let Some(first_logits) = logits else {
            return Err(EngineError::Generate {
                model: self.name.clone(),
                message: "internal: a generation started before its prompt was prefilled".into(),
            });
        };
        let max_new = self.new_tokens_after(prompt.len(), params.max_new_tokens);
        let err = |e: candle_core::Error| self.gen_err(e);
        let started = std::time::Instant::now();
        // Room for the first KV_GROWTH new tokens; the cache grows as needed, so many
        // requests with a large `max_tokens` in one batch do not reserve it all up front.
        let cache = prefill_cache
            .fork(params.n, max_new.min(KV_GROWTH))
            .map_err(err)?;
        drop(prefill_cache);

        let base_seed = params.seed.unwrap_or_else(rand::random);
        let rows: Vec<Row> = (0..params.n)
            .map(|i| Row {
                sample: i,
                sampler: Sampler::new(
                    params.temperature,
                    params.top_p,
                    base_seed.wrapping_add(i as u64),
                ),
                ids: Vec::new(),
                end: None,
                logprobs: params.logprobs.map(|_| Vec::new()),
                token_ends: Vec::new(),
                logprobs_sent: 0,
                detok: IncrementalText::default(),
                text: String::new(),
                tokens: 0,
                sent: 0,
            })
            .collect();
        Ok(GenState {
            prompt_tokens: prompt.len(),
            cached_tokens,
            stop: params.stop.clone(),
            eos: params.eos,
            logprobs: params.logprobs,
            max_new,
            step: 0,
            generated: 0,
            rows,
            done: vec![None; params.n],
            logits: RowLogits::Host(vec![first_logits; params.n]),
            cache,
            prefill_secs,
            started,
            stream: None,
        })
    }

    fn prefix_cache(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        // The cache holds no invariant a panicking holder could break halfway.
        self.prefix_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets the stored prompts (the next prompt is prefilled cold).
    pub fn clear_prefix_cache(&self) {
        self.prefix_cache().clear();
    }

    /// Bytes the stored prompt caches hold.
    pub fn prefix_cache_bytes(&self) -> usize {
        self.prefix_cache().used_bytes()
    }

    /// One token for every unfinished row of `states`: each row samples from its logits
    /// (finished rows leave their state), then the remaining rows of all states run one
    /// forward pass together. A state's tokens are the same whatever else is in the batch.
    pub fn step(&self, states: &mut [&mut GenState]) -> Result<(), EngineError> {
        let err = |e: candle_core::Error| self.gen_err(e);
        let next = self.sample_states(states)?;
        let mut tokens: Vec<&[u32]> = Vec::with_capacity(states.len());
        let mut caches: Vec<&mut KvCache> = Vec::with_capacity(states.len());
        let mut live: Vec<usize> = Vec::with_capacity(states.len());
        for (i, (state, toks)) in states.iter_mut().zip(&next).enumerate() {
            if !toks.is_empty() {
                tokens.push(toks);
                caches.push(&mut state.cache);
                live.push(i);
            }
        }
        if live.is_empty() {
            return Ok(());
        }
        let logits = self
            .model
            .forward_decode(&tokens, &mut caches)
            .map_err(err)?;
        drop(caches);
        // Host copies (other devices) on the compute threads.
        let rows = team::map(logits.len(), |g| RowLogits::of(&logits[g]));
        for (i, r) in live.into_iter().zip(rows) {
            states[i].logits = r.map_err(err)?;
        }
        Ok(())
    }

    /// [`Engine::sample_state`] for every unfinished state (no tokens for finished ones),
    /// the states spread over the compute threads (greedy over 49k logits and the
    /// detokenization, per request and step).
    fn sample_states(&self, states: &mut [&mut GenState]) -> Result<Vec<Vec<u32>>, EngineError> {
        team::map_mut(states, |_, state| {
            if state.is_finished() {
                Ok(Vec::new())
            } else {
                self.sample_state(state)
            }
        })
        .into_iter()
        .collect()
    }

    /// Samples one token per row of `state`; finished rows are recorded and leave its cache.
    /// Returns the tokens of the rows that go on.
    fn sample_state(&self, state: &mut GenState) -> Result<Vec<u32>, EngineError> {
        let mut next = Vec::with_capacity(state.rows.len());
        let mut keep = Vec::with_capacity(state.rows.len());
        let last = state.step + 1 == state.max_new;
        for (r, row) in state.rows.iter_mut().enumerate() {
            let banned: &[u32] = match state.eos {
                EosRule::Ignore => &self.codec.eos_ids,
                EosRule::AfterText if row.text.trim().is_empty() => &self.codec.eos_ids,
                EosRule::AfterText | EosRule::Stop => &[],
            };
            let (tok, scored) = state
                .logits
                .with_row(r, |logits| {
                    let tok = row.sampler.sample(logits, banned);
                    (tok, state.logprobs.map(|k| log_softmax_at(logits, tok, k)))
                })
                .map_err(|e| self.gen_err(e))?;
            row.tokens += 1;
            state.generated += 1;
            let finish = if self.codec.eos_ids.contains(&tok) {
                row.end = Some(tok);
                if let (EosRule::Stop, Some(list), Some((logprob, top))) =
                    (state.eos, row.logprobs.as_mut(), scored)
                {
                    let first = list.is_empty();
                    let mut entry = self.token_logprob(tok, logprob, &top, first)?;
                    // A special token decodes to nothing; its name says what ended the text.
                    if entry.token.is_empty() {
                        entry.token = self.codec.tokenizer.id_to_token(tok).unwrap_or_default();
                    }
                    list.push(entry);
                    row.token_ends.push(row.text.len());
                }
                Some(FinishReason::Stop)
            } else {
                if let (Some(list), Some((logprob, top))) = (row.logprobs.as_mut(), scored) {
                    let first = list.is_empty();
                    list.push(self.token_logprob(tok, logprob, &top, first)?);
                }
                row.ids.push(tok);
                row.detok.update(&row.ids, |ids| self.decode(ids))?;
                row.text.clear();
                row.text.push_str(row.detok.text());
                if row.logprobs.is_some() {
                    row.token_ends.push(row.text.len());
                }
                if first_stop(&row.text, &state.stop).is_some() {
                    Some(FinishReason::Stop)
                } else if last {
                    Some(FinishReason::Length)
                } else {
                    None
                }
            };
            if finish.is_some() {
                // The finished reply is one decode of all its tokens (what the windowed
                // text equals, step by step), cut at a stop string.
                row.text = self.decode(&row.ids)?;
                if let Some(cut) = first_stop(&row.text, &state.stop) {
                    row.text.truncate(cut);
                }
            }
            if let Some(sink) = state.stream.as_mut() {
                row.send_delta(sink, &state.stop, finish.is_some());
            }
            match finish {
                Some(f) => state.done[row.sample] = Some(row.finish(f)),
                None => {
                    keep.push(r);
                    next.push(tok);
                }
            }
        }
        state.step += 1;
        if keep.is_empty() {
            state.rows.clear();
            return Ok(Vec::new());
        }
        if keep.len() < state.rows.len() {
            state
                .cache
                .retain_rows(&keep)
                .map_err(|e| self.gen_err(e))?;
            let rows = std::mem::take(&mut state.rows);
            state.rows = rows
                .into_iter()
                .enumerate()
                .filter(|(r, _)| keep.contains(r))
                .map(|(_, row)| row)
                .collect();
        }
        Ok(next)
    }

    /// The finished generation's samples, in order.
    pub fn finish(&self, state: GenState) -> Result<GenOutput, EngineError> {
        let samples = state
            .done
            .into_iter()
            .map(|g| g.ok_or_else(|| self.gen_err("a sample ended without a result")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(GenOutput {
            prompt_tokens: state.prompt_tokens,
            cached_tokens: state.cached_tokens,
            samples,
            prefill_secs: state.prefill_secs,
            decode_secs: state.started.elapsed().as_secs_f64(),
        })
    }
}

/// `model`'s prompt caches under the budget `opts` give.
fn new_prefix_cache(model: &LlamaModel, opts: &LoadOptions) -> Mutex<PrefixCache> {
    let budget = opts
        .prefix_cache_mb
        .map_or(prefix_cache::DEFAULT_BUDGET_BYTES, |mb| mb << 20);
    Mutex::new(PrefixCache::new(budget, model.kv_bytes_per_position()))
}

/// Positions a generation's cache reserves beyond the prompt before it has to grow.
const KV_GROWTH: usize = 256;

/// Text as it is generated: sample index and the new text (the deltas of a sample
/// concatenate to its final text).
/// Receives each sample's settled new text, with the log-probabilities of the tokens that
/// text completes (empty unless they were asked for).
pub type TokenSink = Box<dyn FnMut(usize, &str, &[TokenLogprob]) + Send>;

/// A prompt being prefilled (see [`Engine::begin_prefill`] and [`Engine::prefill_chunk`]).
pub struct Prefill {
    prompt: Vec<u32>,
    /// Positions taken from a stored prompt's cache.
    cached_tokens: usize,
    /// Positions in `cache` so far.
    done: usize,
    cache: KvCache,
    /// The last position's logits, once the whole prompt is in.
    logits: Option<Vec<f32>>,
    secs: f64,
}

impl Prefill {
    /// Tokens of the whole prompt.
    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Prompt positions still to run.
    pub fn remaining(&self) -> usize {
        self.prompt.len() - self.done
    }

    /// The last position's next-token logits, once the whole prompt is in.
    pub fn logits(&self) -> Option<&[f32]> {
        self.logits.as_deref()
    }
}

/// [`Engine::option_probs`]' answer from its prompt's length and next-token logits.
pub fn option_probs_after(
    prompt_tokens: usize,
    logits: &[f32],
    option_ids: &[u32],
) -> super::messages::OptionProbs {
    super::messages::OptionProbs {
        probs: restricted_probs(logits, option_ids),
        prompt_tokens: prompt_tokens as u64,
        cached: false,
    }
}

/// The next-token logits of a generation's rows.
enum RowLogits {
    /// One vector per row (after a prefill, or copied from another device).
    Host(Vec<Vec<f32>>),
    /// A decode step's (rows, vocab) CPU f32 rows of the output head, read where they are:
    /// copying them out cost ~1.5 % of a 16-request step (3 MB).
    Head(Tensor),
}

impl RowLogits {
    /// `f` on row `r`'s logits.
    fn with_row<R>(&self, r: usize, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
        match self {
            RowLogits::Host(rows) => match rows.get(r) {
                Some(row) => Ok(f(row)),
                None => candle_core::bail!("no logits for row {r} of {}", rows.len()),
            },
            RowLogits::Head(t) => {
                let (rows, vocab) = t.dims2()?;
                if r >= rows {
                    candle_core::bail!("no logits for row {r} of {rows}");
                }
                let (storage, layout) = t.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*storage else {
                    candle_core::bail!("head logits off the CPU");
                };
                let at = layout.start_offset() + r * layout.stride()[0];
                Ok(f(&cpu.as_slice::<f32>()?[at..][..vocab]))
            }
        }
    }

    /// A decode step's logits for a state: kept in place when they are CPU f32 rows with
    /// contiguous values, else copied to the host.
    fn of(t: &Tensor) -> candle_core::Result<RowLogits> {
        let in_place = t.device().is_cpu()
            && t.dtype() == candle_core::DType::F32
            && t.rank() == 2
            && t.stride().get(1) == Some(&1);
        if in_place {
            Ok(RowLogits::Head(t.clone()))
        } else {
            t.to_vec2::<f32>().map(RowLogits::Host)
        }
    }
}

/// One generation in flight (see [`Engine::start`] and [`Engine::step`]).
pub struct GenState {
    prompt_tokens: usize,
    cached_tokens: usize,
    stop: Vec<String>,
    eos: EosRule,
    logprobs: Option<usize>,
    max_new: usize,
    step: usize,
    generated: usize,
    rows: Vec<Row>,
    done: Vec<Option<Generation>>,
    logits: RowLogits,
    cache: KvCache,
    prefill_secs: f64,
    started: std::time::Instant,
    stream: Option<TokenSink>,
}

impl GenState {
    /// Every sample has ended.
    pub fn is_finished(&self) -> bool {
        self.rows.is_empty() || self.step >= self.max_new
    }
    /// Tokens generated so far over all samples.
    pub fn generated(&self) -> usize {
        self.generated
    }
    /// Rows still decoding (the samples not yet ended).
    pub fn rows(&self) -> usize {
        self.rows.len()
    }
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }
    /// Sends each sample's text to `sink` as it is generated. Text that may still turn into
    /// a stop string, or that ends in an incomplete character, is held back until it is
    /// settled, so the deltas never contain what the final text cuts.
    pub fn set_stream(&mut self, sink: TokenSink) {
        self.stream = Some(sink);
    }
}

struct Row {
    sample: usize,
    sampler: Sampler,
    ids: Vec<u32>,
    /// The end-of-turn token that ended the sample, if one did (never part of `ids`).
    end: Option<u32>,
    /// The log-probabilities of `ids`, when asked for.
    logprobs: Option<Vec<TokenLogprob>>,
    /// With log-probabilities: the length of `text` once each of `ids` was decoded, so a
    /// stream sends a token's log-probability with the text that completes it.
    token_ends: Vec<usize>,
    /// Log-probabilities already sent to the stream.
    logprobs_sent: usize,
    /// The text of `ids`, a token at a time.
    detok: IncrementalText,
    /// The text so far (once finished: cut at the stop string).
    text: String,
    tokens: usize,
    /// Bytes of `text` already sent to the stream.
    sent: usize,
}

impl Row {
    fn finish(&self, finish: FinishReason) -> Generation {
        Generation {
            text: self.text.clone(),
            finish,
            tokens: self.tokens,
            token_ids: self.ids.iter().copied().chain(self.end).collect(),
            logprobs: self.logprobs.clone(),
        }
    }

    /// Sends the settled new part of the text (all of it when the sample has ended).
    fn send_delta(&mut self, sink: &mut TokenSink, stop: &[String], ended: bool) {
        let settled = if ended {
            self.text.len()
        } else {
            settled_len(&self.text, stop)
        };
        // The text decoded so far only ever grows at the end once settled; should a
        // tokenizer rewrite earlier text, nothing more is sent until the end.
        let text_due = settled > self.sent && self.text.is_char_boundary(self.sent);
        // The log-probabilities of the tokens whose text is settled (all of them at the end).
        let lps: &[TokenLogprob] = match &self.logprobs {
            Some(all) => {
                let done = if ended {
                    all.len()
                } else if text_due {
                    self.token_ends.partition_point(|&end| end <= settled)
                } else {
                    self.logprobs_sent
                };
                &all[self.logprobs_sent.min(done)..done]
            }
            None => &[],
        };
        if text_due || !lps.is_empty() {
            let text = if text_due {
                &self.text[self.sent..settled]
            } else {
                ""
            };
            sink(self.sample, text, lps);
            self.logprobs_sent += lps.len();
            if text_due {
                self.sent = settled;
            }
        }
    }
}

/// `tok`'s log-softmax in `logits` and the `k` most likely (id, log-prob), best first;
/// the normaliser is summed in f64.
fn log_softmax_at(logits: &[f32], tok: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let mut top: Vec<u32> = Vec::with_capacity(k + 1);
    for (i, &x) in logits.iter().enumerate() {
        if top.len() < k || top.last().is_some_and(|&j| x > logits[j as usize]) {
            let at = top.partition_point(|&j| logits[j as usize] >= x);
            top.insert(at, i as u32);
            top.truncate(k);
        }
    }
    let chosen = logits
        .get(tok as usize)
        .map_or(f32::NEG_INFINITY, |&x| lp(x));
    (
        chosen,
        top.into_iter()
            .map(|j| (j, lp(logits[j as usize])))
            .collect(),
    )
}

/// Length of the prefix of `text` that no later token can change: trailing replacement
/// characters (a multi-byte character split across tokens) and a tail that begins a stop
/// string are held back.
fn settled_len(text: &str, stop: &[String]) -> usize {
    let base = text.trim_end_matches(char::REPLACEMENT_CHARACTER).len();
    let mut end = base;
    for s in stop.iter().filter(|s| !s.is_empty()) {
        // The longest tail of text[..base] that `s` starts with.
        for (i, _) in text[..base].char_indices().rev().take(s.chars().count()) {
            if s.starts_with(&text[i..base]) {
                end = end.min(i);
            }
        }
    }
    end
}

/// The longest token's text in bytes (added tokens included), times a margin when a
/// normalizer may shorten text before it is split (NFKC or lowercasing can shrink a character
/// to a third of its bytes). The stored token text never stands for fewer bytes than it has:
/// byte-level BPE writes each byte as one char of 1–2 bytes, SentencePiece writes `▁` (3
/// bytes) for a space and `<0x0A>` for one byte.
fn max_token_bytes(tokenizer: &Tokenizer) -> usize {
    let longest = tokenizer
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(1);
    if tokenizer.get_normalizer().is_some() {
        longest * 3
    } else {
        longest
    }
}

/// Byte offset of the earliest stop string in `text`.
fn first_stop(text: &str, stop: &[String]) -> Option<usize> {
    stop.iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// The declared end ids plus every known end-of-turn token the vocabulary has.
fn end_ids(tokenizer: &Tokenizer, declared: impl Iterator<Item = u32>) -> Vec<u32> {
    let mut ids: Vec<u32> = declared.collect();
    ids.extend(
        END_OF_TURN_TOKENS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t)),
    );
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn model_name(path: &Path) -> String {
    let p = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    p.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// HF-named f32 tensors of a local base model (GGUF dequantized and un-permuted), with its
/// config, rope factors and the files that identify it.
#[allow(clippy::type_complexity)]
pub fn base_hf_tensors(
    files: &LocalModelFiles,
    device: &Device,
) -> Result<
    (
        LlamaConfig,
        std::collections::HashMap<String, Tensor>,
        Option<Vec<f32>>,
        Vec<PathBuf>,
    ),
    EngineError,
> {
    match files {
        LocalModelFiles::Gguf(path) => {
            let (cfg, t, f) =
                super::llama::hf_tensors_from_gguf(path, device).map_err(|e| load_err(path, e))?;
            Ok((cfg, t, f, vec![path.clone()]))
        }
        LocalModelFiles::HfDir(dir) => {
            let cfg = read_hf_config(dir)?;
            let weights = safetensors_in(dir)?;
            let mut tensors = std::collections::HashMap::new();
            for w in &weights {
                let loaded =
                    candle_core::safetensors::load(w, device).map_err(|e| load_err(w, e))?;
                for (k, v) in loaded {
                    let v = v
                        .to_dtype(candle_core::DType::F32)
                        .map_err(|e| load_err(w, e))?;
                    tensors.insert(k, v);
                }
            }
            Ok((cfg, tensors, None, weights))
        }
        LocalModelFiles::Adapter { dir, .. } => Err(load_err(
            dir,
            "an adapter's base model must be a full model",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::tiny_engine;
    use super::*;

    /// Decodes `max_new` tokens of `n` rows from `prompt`; returns the reservation made
    /// before its prefill and the key/value bytes the generation held at the end beyond the
    /// stored prompt it began from.
    fn reserved_and_held(
        engine: &Engine,
        prompt: &[u32],
        n: usize,
        max_new: usize,
    ) -> (usize, usize, usize) {
        let mut prefill = engine.begin_prefill(prompt).unwrap();
        let cached = prefill.cached_tokens;
        let reserved = engine.kv_reservation(&prefill, n, max_new);
        engine.prefill_chunk(&mut prefill, usize::MAX).unwrap();
        let computed = prefill.cache.own_bytes();
        let params = GenParams {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: max_new,
            stop: Vec::new(),
            seed: Some(1),
            n,
            eos: EosRule::Ignore,
            logprobs: None,
        };
        let mut state = engine.start_prefilled(prefill, &params).unwrap();
        while !state.is_finished() {
            engine.step(&mut [&mut state]).unwrap();
        }
        assert_eq!(state.generated(), n * max_new);
        (reserved, computed + state.cache.own_bytes(), cached)
    }

    /// A prompt scored after another with the same start (a second choice after the same
    /// question) takes that start's scores and keys and values and scores as it does cold;
    /// the same prompt again gives its scores back; a continuation of a scored prompt finds
    /// it prefilled.
    #[test]
    fn prompts_that_start_like_a_scored_one_score_as_they_do_cold() {
        let (_dir, engine) = tiny_engine();
        let question = engine
            .encode_raw(&"Question: which of these is the sea? ".repeat(4))
            .unwrap();
        let with = |choice: &str| {
            let mut ids = question.clone();
            ids.extend(engine.encode(choice).unwrap());
            ids
        };
        let (a, b) = (with(" the ocean"), with(" a river and a lake"));
        let cold_b = engine.prompt_logprobs(&b, 2).unwrap();
        engine.clear_prefix_cache();
        let cold_a = engine.prompt_logprobs(&a, 2).unwrap();
        let warm_b = engine.prompt_logprobs(&b, 2).unwrap();
        assert_eq!(warm_b.len(), b.len() - 1);
        for (i, (w, c)) in warm_b.iter().zip(&cold_b).enumerate() {
            assert_eq!((w.id, &w.token), (c.id, &c.token), "token {}", i + 1);
            // f32 sums in another order over passes of other sizes: equal to float noise.
            assert!((w.logprob - c.logprob).abs() < 1e-5, "token {}", i + 1);
            let alts = |t: &TokenLogprob| t.top.iter().map(|a| a.id).collect::<Vec<_>>();
            assert_eq!(alts(w), alts(c), "token {}", i + 1);
        }
        assert_eq!(engine.prompt_logprobs(&a, 2).unwrap(), cold_a, "a repeat");
        let prefill = engine.begin_prefill(&b).unwrap();
        assert_eq!(
            prefill.cached_tokens,
            b.len(),
            "the scored prompt is stored"
        );
    }

    /// A generation never holds more key/value memory than it reserved (the scheduler's
    /// budget counts reservations), and for a cold prompt on the CPU the reservation is
    /// exactly what it holds: short and long replies (past the cache's growth step), one
    /// row and several, cold prompts and prompts that begin from a stored one.
    #[test]
    fn reservations_bound_what_generations_hold() {
        let (_dir, engine) = tiny_engine();
        let short = engine
            .encode_chat(&[ChatMessage::user("one two three four")])
            .unwrap();
        let long = engine
            .encode_chat(&[
                ChatMessage::user("one two three four"),
                ChatMessage::assistant("five six"),
                ChatMessage::user("seven eight nine"),
            ])
            .unwrap();
        for (n, max_new) in [(1, 5), (3, 5), (1, KV_GROWTH + 44), (2, KV_GROWTH + 44)] {
            engine.clear_prefix_cache();
            let (reserved, held, _) = reserved_and_held(&engine, &short, n, max_new);
            assert_eq!(reserved, held, "cold prompt, {n} rows, {max_new} tokens");
            // `long` begins from the stored `short`: its rows copy their own positions.
            let (reserved, held, cached) = reserved_and_held(&engine, &long, n, max_new);
            assert!(cached > 0, "the longer prompt began from the stored one");
            assert!(
                held <= reserved,
                "stored start, {n} rows, {max_new} tokens: {held} > {reserved}"
            );
            assert!(reserved <= held + long.len() * engine.kv_bytes_per_position());
        }
    }
}
