//! Next-token logits and greedy tokens of raw text prompts (a base model: no chat template)
//! through our inference engine, one JSON line per prompt (`{"prompt", "prompt_ids",
//! "next_logits", "tokens"}`), for `scripts/gemma3_vs_transformers.py` to compare with
//! transformers on the same file. The prompt is encoded as the model's tokenizer encodes raw
//! text (with the BOS it adds); greedy decoding does not stop at EOS.
//!
//! `cargo run --release --example raw_logits -- <model dir|.gguf> <f32|auto|q8|native> <max-new-tokens> <prompt>...`

use std::path::PathBuf;

use candle_core::{DType, Tensor};
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::{Engine, LoadOptions};
use collabllm::llm::spec::LocalModelFiles;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, weights, max_new, prompts @ ..] = args.as_slice() else {
        anyhow::bail!(
            "usage: raw_logits <model dir|.gguf> <f32|auto|q8|native> <max-new-tokens> <prompt>..."
        );
    };
    let weights: WeightFormat = weights.parse().map_err(anyhow::Error::msg)?;
    let max_new: usize = max_new.parse()?;
    let path = PathBuf::from(model);
    let files = if path.is_dir() {
        LocalModelFiles::HfDir(path)
    } else {
        LocalModelFiles::Gguf(path)
    };
    let opts = LoadOptions {
        weights,
        ..LoadOptions::default()
    };
    let engine = Engine::load(&files, &opts)?;
    let m = engine.model();
    for prompt in prompts {
        let ids = engine.encode_raw(prompt)?;
        let mut cache = m.new_cache(ids.len() + max_new);
        let mut input = Tensor::new(ids.as_slice(), m.device())?.unsqueeze(0)?;
        let mut next_logits = Vec::new();
        let mut out = Vec::new();
        while out.len() < max_new {
            let logits = m.forward_last(&input, &mut cache)?.squeeze(0)?;
            if next_logits.is_empty() {
                next_logits = logits.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            }
            let next = logits.argmax(0)?.to_scalar::<u32>()?;
            out.push(next);
            input = Tensor::new(&[next], m.device())?.unsqueeze(0)?;
        }
        let line = serde_json::json!({
            "prompt": prompt,
            "prompt_ids": ids,
            "next_logits": next_logits,
            "tokens": out,
        });
        println!("{line}");
    }
    Ok(())
}
