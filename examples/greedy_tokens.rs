//! Greedy token ids of a local model through our inference engine at f32 weights, one JSON
//! line per prompt (`{"prompt", "prompt_ids", "tokens"}`), for
//! `scripts/rope_greedy_vs_transformers.py` to compare with transformers token for token.
//!
//! `cargo run --release --example greedy_tokens -- <model dir|.gguf> <max-new-tokens> <prompt>...`

use std::path::PathBuf;

use candle_core::Tensor;
use collabllm::engine::llama::WeightFormat;
use collabllm::engine::{Engine, LoadOptions};
use collabllm::llm::spec::LocalModelFiles;
use collabllm::llm::ChatMessage;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, max_new, prompts @ ..] = args.as_slice() else {
        anyhow::bail!("usage: greedy_tokens <model dir|.gguf> <max-new-tokens> <prompt>...");
    };
    let max_new: usize = max_new.parse()?;
    let path = PathBuf::from(model);
    let files = if path.is_dir() {
        LocalModelFiles::HfDir(path)
    } else {
        LocalModelFiles::Gguf(path)
    };
    let opts = LoadOptions {
        weights: WeightFormat::F32,
        ..LoadOptions::default()
    };
    let engine = Engine::load(&files, &opts)?;
    let m = engine.model();
    for prompt in prompts {
        let ids = engine.encode_chat(&[ChatMessage::user(prompt.as_str())])?;
        let mut cache = m.new_cache(ids.len() + max_new);
        let mut input = Tensor::new(ids.as_slice(), m.device())?.unsqueeze(0)?;
        let mut out = Vec::new();
        while out.len() < max_new {
            let logits = m.forward_last(&input, &mut cache)?.squeeze(0)?;
            let next = logits.argmax(0)?.to_scalar::<u32>()?;
            out.push(next);
            if engine.eos_ids().contains(&next) {
                break;
            }
            input = Tensor::new(&[next], m.device())?.unsqueeze(0)?;
        }
        let line = serde_json::json!({"prompt": prompt, "prompt_ids": ids, "tokens": out});
        println!("{line}");
    }
    Ok(())
}
