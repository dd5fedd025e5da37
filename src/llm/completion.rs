//! Raw-text completions (`POST /v1/completions`): a prompt tokenized as it is, with no chat
//! template, continued by the model — how base models are served, and how harnesses score
//! log-likelihoods (`echo` with `logprobs` returns every prompt token's log-probability).

use super::{Choice, LlmError, RequestSampling, TokenLogprob, TokenUsage};

/// What to continue: text (tokenized with the tokenizer's own special tokens, a BOS where
/// the model's tokenizer adds one) or token ids as they are.
#[derive(Clone, Debug, PartialEq)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A completion request, independent of the transport.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionRequest {
    pub prompt: CompletionPrompt,
    pub temperature: f32,
    pub top_p: f32,
    /// New tokens at most; 0 (only with `echo`) scores the prompt without generating.
    pub max_tokens: usize,
    pub n: usize,
    pub stop: Vec<String>,
    /// Sample `i` is drawn with seed `seed + i`.
    pub seed: Option<u64>,
    /// Each token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Return the prompt with each choice (and, with `logprobs`, its tokens' log-probs).
    pub echo: bool,
    /// Refuse, rather than shorten, a request whose prompt leaves no room for `max_tokens`.
    pub strict_max_tokens: bool,
}

impl CompletionRequest {
    pub fn new(prompt: CompletionPrompt) -> Self {
        Self {
            prompt,
            temperature: 1.0,
            top_p: 1.0,
            max_tokens: 16,
            n: 1,
            stop: Vec::new(),
            seed: None,
            logprobs: None,
            echo: false,
            strict_max_tokens: false,
        }
    }

    pub fn validate(&self) -> Result<(), LlmError> {
        if self.max_tokens == 0 && !self.echo {
            return Err(LlmError::InvalidRequest(
                "`max_tokens` must be at least 1 (0 only with `echo`)".into(),
            ));
        }
        self.sampling().validate("logprobs")
    }

    /// The settings the continuations are sampled with.
    pub fn sampling(&self) -> RequestSampling<'_> {
        RequestSampling {
            temperature: self.temperature,
            top_p: self.top_p,
            max_tokens: self.max_tokens,
            n: self.n,
            stop: &self.stop,
            seed: self.seed,
            logprobs: self.logprobs,
        }
    }
}

/// A finished completion: the prompt as the model read it, and `n` continuations.
#[derive(Clone, Debug, PartialEq)]
pub struct CompletionResponse {
    /// The prompt's token ids.
    pub prompt_ids: Vec<u32>,
    /// The prompt's text (a token prompt decoded), what `echo` puts before each choice.
    pub prompt_text: String,
    /// With `echo` and `logprobs`: the prompt's tokens and their log-probabilities.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// The continuations (empty texts when `max_tokens` is 0); `content` excludes the prompt.
    pub choices: Vec<Choice>,
    pub usage: TokenUsage,
}

/// A prompt's tokens as the model scored them.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprobs {
    /// The first token's text: nothing precedes it, so it has no log-probability.
    pub first_token: String,
    /// Every later token's log-probability given the tokens before it, with alternatives.
    pub rest: Vec<TokenLogprob>,
}

/// What vLLM's `/tokenize` reads: text as a raw completion prompt is read, or a
/// conversation as the model's chat template renders it for a chat request.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizeInput {
    /// With `add_special_tokens` (vLLM's default for text) the tokens a text prompt of
    /// `/v1/completions` is read as: the BOS the tokenizer adds, none when the text writes
    /// one out.
    Text {
        text: String,
        add_special_tokens: bool,
    },
    /// The rendered conversation; the template writes the special tokens, so
    /// `add_special_tokens` (default false, as vLLM) adds the tokenizer's on top.
    Chat {
        messages: Vec<super::ChatMessage>,
        add_generation_prompt: bool,
        add_special_tokens: bool,
    },
}

/// The tokens of a [`TokenizeInput`]: ids and each one's vocabulary string.
#[derive(Clone, Debug, PartialEq)]
pub struct Tokenized {
    pub ids: Vec<u32>,
    pub token_strs: Vec<String>,
}

/// A model's tokenizer as vLLM's `/tokenizer_info` reports it (the fields of an HF
/// `tokenizer_config.json` that clients read): enough for lm-evaluation-harness's remote
/// tokenizer, which asks `/tokenize` for the ids of `eos_token` and `bos_token` and renders
/// `chat_template` itself.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerInfo {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
    /// The Jinja chat template, when the model has one.
    pub chat_template: Option<String>,
    /// The context the server reads: prompt and completion tokens together.
    pub model_max_length: usize,
    /// Whether text is encoded with a BOS in front ([`TokenizeInput::Text`] with special
    /// tokens, and text prompts of `/v1/completions`).
    pub add_bos_token: bool,
}
