//! Rebuilds a tokenizer (the HF `tokenizers` kind) from a GGUF file's metadata: byte-level
//! BPE, and Gemma's SentencePiece vocabulary (see `gemma_sentencepiece`).
//!
//! candle's own `Tokenizer::from_gguf` adds a prefix space to the byte-level pre-tokenizer,
//! which turns SmolLM2's "system" into "Ġsystem". Here the pieces are assembled as
//! the model's own `tokenizer.json` does: the pre-tokenizer named by `tokenizer.ggml.pre`,
//! byte-level without prefix space, byte-level decoding, and every control token registered
//! as a special token so that chat-template markers encode to one id each.

use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
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

/// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata: byte-level
/// BPE (`gpt2`), or the SentencePiece vocabulary of a Gemma 3 file (`llama`).
pub fn tokenizer_from_gguf(content: &Content) -> Result<Tokenizer, String> {
    let model = meta_str(content, "tokenizer.ggml.model").unwrap_or("");
    let arch = meta_str(content, "general.architecture").unwrap_or("");
    match model {
        "gpt2" => byte_level_bpe(content),
        "llama" if arch == "gemma3" => gemma_sentencepiece(content),
        _ => Err(format!(
            "tokenizer model `{model}` is not supported for architecture `{arch}` (byte-level \
             BPE, `gpt2`; SentencePiece, `llama`, for gemma3); load the model from its HF \
             directory (tokenizer.json) instead"
        )),
    }
}

/// Gemma's SentencePiece vocabulary as the BPE that its `tokenizer.json` is (and that
/// transformers rebuilds from the same file): byte fallback, spaces as `▁` by a normalizer,
/// no prefix space. The file has no merges: they are every split of a token into two tokens
/// of the vocabulary, ranked by the token's place in the file (Gemma's scores do not follow
/// its merge order), then the longer left piece, then the longer right one.
fn gemma_sentencepiece(content: &Content) -> Result<Tokenizer, String> {
    // A token of two or more spaces is stored as spaces; the vocabulary spells spaces `▁`.
    let tokens: Vec<String> = string_array(content, "tokenizer.ggml.tokens")?
        .into_iter()
        .map(|t| {
            if t.contains(' ') && t.trim().is_empty() {
                SPM_SPACE.to_string().repeat(t.chars().count())
            } else {
                t
            }
        })
        .collect();
    let types = int_array(content, "tokenizer.ggml.token_type").unwrap_or_default();
    let vocab: HashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges_by_position(&tokens, &vocab);
    let token_at = |key: &str| -> Option<String> {
        meta_u32(content, key).and_then(|id| tokens.get(id as usize).cloned())
    };
    let mut bpe = BPE::builder()
        .vocab_and_merges(
            vocab
                .iter()
                .map(|(t, &i)| (t.clone(), i))
                .collect::<tokenizers::models::bpe::Vocab>(),
            merges,
        )
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = token_at("tokenizer.ggml.unknown_token_id") {
        bpe = bpe.unk_token(unk);
    }
    let bpe = bpe.build().map_err(|e| format!("building BPE: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let space = SPM_SPACE.to_string();
    let normalizer = Replace::new(" ", space.as_str()).map_err(|e| format!("normalizer: {e}"))?;
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| format!("normalizer: {e}"))?;
    tokenizer.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        DecoderWrapper::Replace(Replace::new(space.as_str(), " ").map_err(|e| e.to_string())?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ]))));
    // Control tokens are special; user-defined ones (Gemma's runs of newlines, HTML tags) are
    // plain added tokens, matched whole in the text as llama.cpp does.
    let typed = |want: i32| -> Vec<&String> {
        tokens
            .iter()
            .zip(types.iter().chain(std::iter::repeat(&1)))
            .filter(|(_, &t)| t == want)
            .map(|(tok, _)| tok)
            .collect()
    };
    let special: Vec<AddedToken> = typed(TOKEN_TYPE_CONTROL)
        .into_iter()
        .map(|t| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| format!("special tokens: {e}"))?;
    let user: Vec<AddedToken> = typed(TOKEN_TYPE_USER_DEFINED)
        .into_iter()
        .map(|t| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    tokenizer
        .add_tokens(user)
        .map_err(|e| format!("added tokens: {e}"))?;
    // llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    let add_bos = content
        .metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    if let (true, Some(bos)) = (add_bos, token_at("tokenizer.ggml.bos_token_id")) {
        let id = vocab[&bos];
        let processor = TemplateProcessing::builder()
            .try_single(vec![bos.clone(), "$A".to_string()])
            .map_err(|e| format!("BOS template: {e}"))?
            .try_pair(vec![bos.clone(), "$A".into(), "$B".into()])
            .map_err(|e| format!("BOS template: {e}"))?
            .special_tokens(vec![(bos, id)])
            .build()
            .map_err(|e| format!("BOS template: {e}"))?;
        tokenizer.with_post_processor(Some(processor));
    }
    Ok(tokenizer)
}

/// SentencePiece's space.
const SPM_SPACE: char = '\u{2581}';

/// The merges a SentencePiece vocabulary implies, best first: for each token in file order,
/// each split into two tokens of the vocabulary (by the pieces' ids), all ranked by the
/// token's position, then the longer left piece, then the longer right one (transformers'
/// `generate_merges` with positions as scores, so that both tokenize alike).
fn merges_by_position(tokens: &[String], vocab: &HashMap<String, u32>) -> Vec<(String, String)> {
    struct Merge<'a> {
        rank: u32,
        left: &'a str,
        right: &'a str,
        left_chars: usize,
        right_chars: usize,
    }
    let mut merges = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for token in tokens {
        if !seen.insert(token.as_str()) {
            continue;
        }
        let rank = vocab[token];
        let mut local: Vec<(u32, u32, Merge)> = token
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = token.split_at(at);
                let (l, r) = (*vocab.get(left)?, *vocab.get(right)?);
                let merge = Merge {
                    rank,
                    left,
                    right,
                    left_chars: left.chars().count(),
                    right_chars: right.chars().count(),
                };
                Some((l, r, merge))
            })
            .collect();
        local.sort_by_key(|(l, r, _)| (*l, *r));
        merges.extend(local.into_iter().map(|(_, _, m)| m));
    }
    // Stable: equal keys keep the order above, as Python's reversed sort does.
    merges.sort_by(|a, b| {
        a.rank
            .cmp(&b.rank)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges
        .into_iter()
        .map(|m| (m.left.to_string(), m.right.to_string()))
        .collect()
}

fn byte_level_bpe(content: &Content) -> Result<Tokenizer, String> {
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
