#!/usr/bin/env python3
"""Writes the Qwen2.5-0.5B-shaped random model of BENCHMARKS.md ("A Qwen2.5-0.5B-shaped model"):
an HF folder in f32 (transformers' `Qwen2Config` of Qwen2.5-0.5B-Instruct's sizes, random
weights, the default model's tokenizer files) and the same weights as a Q8_0 GGUF with
llama.cpp's names and keys (architecture `qwen2`, the default model's tokenizer metadata,
the token list padded to the model's vocabulary with [PAD] tokens as llama.cpp's converter
does). Nothing is downloaded.

    python scripts/make_qwen_shaped_bench_model.py TOKENIZER_DIR [--out models]

TOKENIZER_DIR: a folder with the default model's tokenizer.json and tokenizer_config.json
(any `dpo_train` checkpoint of `default`). Needs torch, transformers, safetensors and gguf.
"""

import argparse
import json
import os
import shutil

import numpy as np


def hf_folder(out: str, tokenizer_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, use_sliding_window=False, bos_token_id=1,
                      eos_token_id=2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(tokenizer_dir, f), os.path.join(out, f))


def gguf_file(src: str, path: str, default_gguf: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(f"{src}/config.json"))
    tok = gguf.GGUFReader(default_gguf)
    def field(name):
        f = tok.fields[name]
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [int(f.parts[i][0]) for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return int(f.parts[f.data[0]][0])
    tokens = field("tokenizer.ggml.tokens"); types = field("tokenizer.ggml.token_type")
    n = cfg["vocab_size"]
    tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), n)]
    types = types + [gguf.TokenType.UNUSED] * (n - len(types))
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name("qwen2.5-0.5b-random")
    w.add_context_length(cfg["max_position_embeddings"]); w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"]); w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"]); w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"] if "rope_parameters" in cfg else cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"]); w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(tokens); w.add_token_types(types); w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id")); w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False); w.add_chat_template(field("tokenizer.chat_template"))
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
     "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
     "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
     "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for name, t in sorted(load_file(f"{src}/model.safetensors").items()):
        if name == "model.embed_tokens.weight": g = "token_embd.weight"
        elif name == "model.norm.weight": g = "output_norm.weight"
        elif name == "lm_head.weight": g = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3); g = f"blk.{i}.{names[rest]}"
        t = t.astype(np.float32)
        if t.ndim == 2:
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, t)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--out", default="models")
    ap.add_argument("--default-gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="the embedded default model, whose tokenizer metadata the GGUF takes")
    a = ap.parse_args()
    src = os.path.join(a.out, "qwen2.5-0.5b-random")
    hf_folder(src, a.tokenizer_dir)
    gguf_file(src, os.path.join(a.out, "qwen2.5-0.5b-random-q8_0.gguf"),
              a.default_gguf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
