//! A tiny random llama written as an HF directory (config.json, model.safetensors,
//! tokenizer.json, tokenizer_config.json with a chat template, generation_config.json), for
//! tests of every layer that needs a real model without downloading one. It loads through the
//! normal path, like any user checkpoint.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// ChatML, as SmolLM2 writes it.
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The special tokens, in id order after the 256 byte tokens.
pub const TINY_SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Shape of the tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub seed: u64,
    /// Standard deviation of the random weights.
    pub init_std: f32,
}

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            max_position_embeddings: 1024,
            tie_word_embeddings: true,
            seed: 42,
            init_std: 0.2,
        }
    }
}

/// Vocabulary size of the tiny model: 256 bytes + the special tokens.
pub fn tiny_vocab_size() -> usize {
    256 + TINY_SPECIAL_TOKENS.len()
}

pub(crate) fn tiny_tokenizer() -> anyhow::Result<Tokenizer> {
    let mut vocab: tokenizers::models::bpe::Vocab = super::byte_level::byte_to_char()
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    for (i, t) in TINY_SPECIAL_TOKENS.iter().enumerate() {
        vocab.insert((*t).to_string(), (256 + i) as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, Vec::new())
        .build()
        .map_err(|e| anyhow::anyhow!("tiny BPE: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    tok.add_special_tokens(
        TINY_SPECIAL_TOKENS
            .iter()
            .map(|t| AddedToken::from(*t, true))
            .collect::<Vec<_>>(),
    )
    .map_err(|e| anyhow::anyhow!("tiny tokenizer: {e}"))?;
    Ok(tok)
}

/// Writes the tiny model into `dir` (created if needed).
pub fn write_tiny_llama(dir: &Path, spec: &TinySpec) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let vocab = tiny_vocab_size();
    let h = spec.hidden_size;
    let hd = h / spec.num_attention_heads;
    let kv = spec.num_key_value_heads * hd;
    let im = spec.intermediate_size;
    let end_id = 256 + 2;

    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": h,
        "intermediate_size": im,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": 257,
        "eos_token_id": end_id,
        "torch_dtype": "float32",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&serde_json::json!({"eos_token_id": [end_id]}))?,
    )?;
    let tokenizer_config = serde_json::json!({
        "chat_template": TINY_CHAT_TEMPLATE,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "GPT2Tokenizer",
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config)?,
    )?;
    tiny_tokenizer()?
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("saving tiny tokenizer: {e}"))?;

    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut rand_t = |name: String, shape: (usize, usize)| -> anyhow::Result<()> {
        let data: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * spec.init_std * 1.732)
            .collect();
        tensors.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?);
        Ok(())
    };
    rand_t("model.embed_tokens.weight".into(), (vocab, h))?;
    if !spec.tie_word_embeddings {
        rand_t("lm_head.weight".into(), (vocab, h))?;
    }
    for i in 0..spec.num_hidden_layers {
        let p = format!("model.layers.{i}");
        rand_t(format!("{p}.self_attn.q_proj.weight"), (h, h))?;
        rand_t(format!("{p}.self_attn.k_proj.weight"), (kv, h))?;
        rand_t(format!("{p}.self_attn.v_proj.weight"), (kv, h))?;
        rand_t(format!("{p}.self_attn.o_proj.weight"), (h, h))?;
        rand_t(format!("{p}.mlp.gate_proj.weight"), (im, h))?;
        rand_t(format!("{p}.mlp.up_proj.weight"), (im, h))?;
        rand_t(format!("{p}.mlp.down_proj.weight"), (h, im))?;
    }
    let ones = |n: usize| Tensor::ones(n, candle_core::DType::F32, &Device::Cpu);
    for i in 0..spec.num_hidden_layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), ones(h)?);
        tensors.insert(format!("{p}.post_attention_layernorm.weight"), ones(h)?);
    }
    tensors.insert("model.norm.weight".into(), ones(h)?);
    super::weights::save_safetensors(&tensors, &dir.join("model.safetensors"))?;
    Ok(())
}
