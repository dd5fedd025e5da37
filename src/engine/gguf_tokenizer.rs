//! Rebuilds a byte-level BPE tokenizer (the HF `tokenizers` kind) from a GGUF file's metadata.
//!
//! candle's own `Tokenizer::from_gguf` adds a prefix space to the byte-level pre-tokenizer,
//! which turns SmolLM2's "system" into "Ġsystem". Here the pieces are assembled as
//! the model's own `tokenizer.json` does: the pre-tokenizer named by `tokenizer.ggml.pre`,
//! byte-level without prefix space, byte-level decoding, and every control token registered
//! as a special token so that chat-template markers encode to one id each.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Llama-3 style pre-tokenizer regex (`tokenizer.ggml.pre = llama-bpe`).
/// Qwen2's (and Qwen2.5's, Qwen3's) split: Llama 3's with single digits.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Reads a string metadata key, if present.
pub fn meta_str<'a>(content: &'a Content, key: &str) -> Option<&'a str> {
    content
        .metadata
        .get(key)
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
}

/// Reads an unsigned integer metadata key of any width.
pub fn meta_u32(content: &Content, key: &str) -> Option<u32> {
    let v = content.metadata.get(key)?;
    v.to_u32()
        .ok()
        .or_else(|| v.to_u64().ok().and_then(|x| u32::try_from(x).ok()))
        .or_else(|| v.to_i32().ok().and_then(|x| u32::try_from(x).ok()))
}

fn string_array(content: &Content, key: &str) -> Result<Vec<String>, String> {
    let v = content
        .metadata
        .get(key)
        .ok_or_else(|| format!("missing metadata key `{key}`"))?;
    v.to_vec()
        .map_err(|e| format!("`{key}`: {e}"))?
        .iter()
        .map(|x| x.to_string().cloned().map_err(|e| format!("`{key}`: {e}")))
        .collect()
}

fn int_array(content: &Content, key: &str) -> Option<Vec<i32>> {
    let v = content.metadata.get(key)?.to_vec().ok()?;
    v.iter()
        .map(|x| match x {
            Value::I32(i) => Some(*i),
            Value::U32(u) => i32::try_from(*u).ok(),
            Value::I8(i) => Some(i32::from(*i)),
            Value::U8(u) => Some(i32::from(*u)),
            Value::I64(i) => i32::try_from(*i).ok(),
            _ => None,
        })
        .collect()
}

fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, String> {
    let byte_level =
        |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    match pre {
        // SmolLM / StarCoder family: every digit its own token, then GPT-2 byte-level.
        "smollm" | "starcoder" | "refact" => {
            Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ])))
        }
        "gpt2" | "default" => Ok(byte_level(true)),
        "llama-bpe" | "llama3" | "smaug-bpe" | "qwen2" => {
            let pattern = if pre == "qwen2" {
                QWEN2_PATTERN
            } else {
                LLAMA3_PATTERN
            };
            let split = Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("pre-tokenizer regex: {e}"))?;
            Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                byte_level(false),
            ])))
        }
        other => Err(format!(
            "pre-tokenizer `{other}` is not supported; load the model from its HF directory \
             (tokenizer.json) instead"
        )),
    }
}

/// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer, String> {
    let model = meta_str(content, "tokenizer.ggml.model").unwrap_or("");
    if model != "gpt2" {
        return Err(format!(
            "tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`); load the \
             model from its HF directory (tokenizer.json) instead"
        ));
    }
    let tokens = string_array(content, "tokenizer.ggml.tokens")?;
    let merges_raw = string_array(content, "tokenizer.ggml.merges")?;
    let types = int_array(content, "tokenizer.ggml.token_type").unwrap_or_default();

    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges_raw
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| format!("malformed merge `{m}`"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(false)
        .build()
        .map_err(|e| format!("building BPE: {e}"))?;

    let mut tokenizer = Tokenizer::new(bpe);
    let pre = meta_str(content, "tokenizer.ggml.pre").unwrap_or("default");
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(types.iter().chain(std::iter::repeat(&1)))
        .filter(|(_, &t)| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED)
        .map(|(tok, _)| AddedToken::from(tok.clone(), true))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| format!("special tokens: {e}"))?;
    Ok(tokenizer)
}
