#!/usr/bin/env python3
"""Writes tests/fixtures/families/<family>/: a tiny random checkpoint of each model family that
the engine and trainers load besides llama (qwen2, qwen3, mistral), made by transformers, and
transformers' answers on it (reference.json).

Each folder holds what `save_pretrained` writes (config.json, model.safetensors,
generation_config.json) plus a byte-level tokenizer (256 byte tokens, <|endoftext|>,
<|im_start|>, <|im_end|>, and one merge: two spaces) with a ChatML template.
Weights are drawn large enough that greedy choices are never near ties (the script checks a
margin at every greedy step). reference.json records, computed in float64 unless noted:

- `ids`, `next_logits` (the last position's logits) and `token_logps` (each token's log-prob
  given the ones before it) for a fixed sequence;
- `chat`, `chat_ids` (the template rendered by transformers' `apply_chat_template` with the
  generation prompt, tokenized) and `greedy` (8 tokens of `generate(do_sample=False)` in
  float32, the precision `serve --weights f32` runs in);
- one DPO case: prompt/chosen/rejected ids, beta, fixed reference log-probs, the policy's
  completion log-probs, TRL's sigmoid loss and the global gradient L2 norm.

For the families llama.cpp writes under their own GGUF architecture (qwen2, qwen3) the same
weights are also written as `tests/fixtures/families/<family>.gguf` (f32 tensors, llama.cpp's
names and keys as its converter writes them: Q/K rows not permuted, `tokenizer.ggml.pre`
`qwen2`), which must give the same logits as the HF folder.

Nothing is downloaded. Tested with torch 2.15, transformers 5.24, gguf 0.19.

    python scripts/make_family_fixtures.py [--out tests/fixtures/families]
"""

import argparse
import json
import os

FAMILIES = ["qwen2", "qwen3", "mistral"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# One merge (two spaces), so the BPE has merges as every real one does (GGUF cannot store an
# empty merge list): token 259.
DOUBLE_SPACE = "\u0120\u0120"
VOCAB = 256 + len(SPECIALS) + 1
IM_START, IM_END = 257, 258
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name   a prime."},
]
SEQUENCE = [IM_START, 117, 115, 101, 114, 10, 72, 105, 33, IM_END, 10, IM_START, 97]
PROMPT = [IM_START, 117, 10, 81, 63, IM_END, 10, IM_START, 97, 10]
CHOSEN = [89, 101, 115, IM_END]
REJECTED = [78, 111, IM_END]
REF_CHOSEN, REF_REJECTED, BETA = -12.0, -9.0, 0.1
GREEDY_TOKENS = 8
MIN_MARGIN = 1e-3


def byte_chars():
    """GPT-2's byte → printable character table (the ByteLevel pre-tokenizer's alphabet)."""
    out, extra = {}, 0
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            out[b] = chr(b)
        else:
            extra += 1
            out[b] = chr(255 + extra)
    return out


def tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in byte_chars().items()}
    for i, t in enumerate(SPECIALS):
        vocab[t] = 256 + i
    vocab[DOUBLE_SPACE] = 256 + len(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u0120", "\u0120")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return tok


def config(family: str):
    from transformers import MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=IM_END,
    )
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1e6, use_sliding_window=False, sliding_window=4096)
    if family == "qwen3":
        # head_dim given and not hidden / heads (Qwen3's shape: 4 × 16 = 64 ≠ 32).
        return Qwen3Config(**common, head_dim=16, rope_theta=1e6, attention_bias=False)
    if family == "mistral":
        # A window longer than the context: attention is full within it.
        return MistralConfig(**common, rope_theta=1e4, sliding_window=4096)
    raise ValueError(family)


def randomize(model, torch, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.35 * noise)


def completion_logp(model, torch, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
    start = len(prompt)
    return logp[start - 1 : -1].gather(1, ids[0, start:].unsqueeze(1)).sum()


def greedy(model, torch, ids):
    """Greedy tokens, refusing a step whose top two logits are within MIN_MARGIN."""
    out = list(ids)
    for _ in range(GREEDY_TOKENS):
        logits = model(input_ids=torch.tensor([out])).logits[0, -1]
        top = torch.topk(logits, 2)
        margin = float(top.values[0] - top.values[1])
        if margin < MIN_MARGIN:
            raise SystemExit(f"greedy step near a tie (margin {margin}): change the seed")
        out.append(int(top.indices[0]))
        if out[-1] == IM_END:
            break
    return out[len(ids) :]


def make(family: str, out_dir: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    randomize(model, torch, seed)
    model.generation_config.eos_token_id = IM_END
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
        model_max_length=256,
    )
    fast.save_pretrained(out_dir)

    # Load back what was written, as a user would.
    tok = PreTrainedTokenizerFast.from_pretrained(out_dir)
    f32 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    f64 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float64).eval()
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = [int(i) for i in chat_ids]
    with torch.no_grad():
        logits = f64(input_ids=torch.tensor([SEQUENCE])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        token_logps = [float(logp[t - 1, SEQUENCE[t]]) for t in range(1, len(SEQUENCE))]
        greedy_ids = greedy(f32, torch, chat_ids)
        if greedy(f64, torch, chat_ids) != greedy_ids:
            raise SystemExit(f"{family}: float32 and float64 greedy tokens differ")

    pc = completion_logp(f64, torch, PROMPT, CHOSEN)
    pr = completion_logp(f64, torch, PROMPT, REJECTED)
    f64.zero_grad(set_to_none=True)
    h = (pc - REF_CHOSEN) - (pr - REF_REJECTED)
    loss = -torch.nn.functional.logsigmoid(BETA * h)
    loss.backward()
    norm = sum(float(p.grad.pow(2).sum()) for p in f64.parameters() if p.grad is not None) ** 0.5

    ref = {
        "family": family,
        "ids": SEQUENCE,
        "next_logits": [float(v) for v in logits[-1]],
        "token_logps": token_logps,
        "chat": CHAT,
        "chat_ids": chat_ids,
        "greedy": greedy_ids,
        "greedy_text": tok.decode(greedy_ids, skip_special_tokens=True),
        "dpo": {
            "prompt": PROMPT,
            "chosen": CHOSEN,
            "rejected": REJECTED,
            "beta": BETA,
            "ref_chosen_logp": REF_CHOSEN,
            "ref_rejected_logp": REF_REJECTED,
            "policy_chosen_logp": float(pc),
            "policy_rejected_logp": float(pr),
            "loss": float(loss),
            "total_grad_norm": norm,
        },
        "made_with": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{family}: greedy {greedy_ids}, loss {float(loss):.6f}, grad norm {norm:.6f}")


GGUF_FAMILIES = ["qwen2", "qwen3"]
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_gguf(family: str, hf_dir: str, path: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    w = gguf.GGUFWriter(path, family)
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    chars = byte_chars()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([chars[b] for b in range(256)] + SPECIALS + [DOUBLE_SPACE])
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(SPECIALS)
    w.add_token_types(types + [gguf.TokenType.NORMAL])
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(IM_END)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        w.add_tensor(gguf_name(name), t.astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/families")
    ap.add_argument("--family", choices=FAMILIES, action="append")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)
    for i, family in enumerate(a.family or FAMILIES):
        make(family, os.path.join(a.out, family), seed=1000 + i)
        if family in GGUF_FAMILIES:
            write_gguf(family, os.path.join(a.out, family), os.path.join(a.out, f"{family}.gguf"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
