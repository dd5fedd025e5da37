//! Writes the default model (GGUF, dequantized to f32, Q/K rows in the HF layout) as an HF
//! folder (`model.safetensors`, `config.json`, tokenizer files) and prints the weights digest that
//! `scripts/make_grad_fixture.py` records in `tests/fixtures/default_model_dpo_grads.json`.
//!
//! `cargo run --release --example export_default_model -- <out-dir>`

#[path = "../tests/common/weights_digest.rs"]
mod weights_digest;

use std::path::PathBuf;

use candle_core::{DType, Device};
use collabllm::engine::ChatCodec;
use collabllm::llm::spec::LocalModelFiles;
use collabllm::train::model::TrainLlama;

fn main() -> anyhow::Result<()> {
    let Some(out) = std::env::args().nth(1).map(PathBuf::from) else {
        anyhow::bail!("usage: export_default_model <out-dir>");
    };
    let gguf = collabllm::llm::spec::default_model_path()?;
    let model = TrainLlama::from_gguf(&gguf, DType::F32, &Device::Cpu)?;
    model.save_hf(&out, None)?;
    // The tokenizer and chat template too, so the folder is a model spec of its own.
    ChatCodec::load(&LocalModelFiles::Gguf(gguf.clone()))?.save_hf(&out)?;
    println!("{}", weights_digest::weights_digest(&model.hf_tensors()?));
    Ok(())
}
