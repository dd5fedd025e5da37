#!/usr/bin/env python3
"""Writes tests/fixtures/families/<family>/: a tiny random checkpoint of each model family that
the engine and trainers load besides llama (qwen2, qwen3, mistral, gemma3_text), made by
transformers, and transformers' answers on it (reference.json).

Each folder holds what `save_pretrained` writes (config.json, model.safetensors,
generation_config.json) plus a tokenizer with a chat template. qwen2, qwen3 and mistral get a
byte-level tokenizer (256 byte tokens, <|endoftext|>, <|im_start|>, <|im_end|>, and one merge:
two spaces) with a ChatML template. gemma3_text gets a SentencePiece-style BPE as Gemma's
tokenizer.json is (no pre-tokenizer, spaces written `▁`, no prefix space, byte fallback,
`<bos>` added by a post-processor): <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>
(ids 0-5), the 256 byte tokens `<0x00>`..`<0xFF>` (6-261), `▁` and a-z, then 26 merged pieces
in merge order (`▁t`, `he`, …, `▁the`, `▁there`, `▁▁`), so that upper case, digits,
punctuation, newlines and non-ASCII text go through byte fallback; its template is Gemma 3's
(a system message folded into the first user turn, `model` for the assistant), and its EOS
is <end_of_turn>. Its six layers are Gemma 3's pattern (five sliding-window layers with rope
base 1e4, one full-attention layer with 1e6), and its sequences stay shorter than the window.
Weights are drawn large enough that greedy choices are never near ties (the script checks a
margin at every greedy step). reference.json records, computed in float64 unless noted:

- `ids`, `next_logits` (the last position's logits) and `token_logps` (each token's log-prob
  given the ones before it) for a fixed sequence;
- `chat`, `chat_ids` (the template rendered by transformers' `apply_chat_template` with the
  generation prompt, tokenized) and `greedy` (8 tokens of `generate(do_sample=False)` in
  float32, the precision `serve --weights f32` runs in);
- one DPO case: prompt/chosen/rejected ids, beta, fixed reference log-probs, the policy's
  completion log-probs, TRL's sigmoid loss and the global gradient L2 norm;
- gemma3_text only: `past_window`, a 150-token sequence and a DPO pair past the sliding
  window (logits, log-probs); `text_ids`, texts (edge spaces, runs of spaces, upper case, digits,
  non-ASCII, a newline, a literal <start_of_turn>) and their ids from the HF tokenizer with
  `add_special_tokens=True`, for checking a tokenizer rebuilt from the GGUF.

Gemma 3 is run with eager attention (transformers' advice for it).

For the families llama.cpp writes under their own GGUF architecture (qwen2, qwen3, gemma3_text
as `gemma3`) the same weights are also written as `tests/fixtures/families/<family>.gguf` (f32
tensors, llama.cpp's names and keys as its converter writes them: Q/K rows not permuted,
`tokenizer.ggml.pre` `qwen2`; for Gemma 3 every norm weight stored as 1 + w, no `output.weight`
(tied), the global rope base and the window as keys, and a SentencePiece vocabulary
(`tokenizer.ggml.model` `llama`) whose scores and order both follow the merge order), which must
give the same logits as the HF folder. For gemma3_text the script checks that with transformers'
GGUF loader (logits, `text_ids` and chat ids); a GGUF has no `query_pre_attn_scalar`, so the
loader's default (256) is replaced by llama.cpp's head_dim (16, as in config.json).

Nothing is downloaded. Tested with torch 2.15, transformers 5.24, gguf 0.19.

    python scripts/make_family_fixtures.py [--out tests/fixtures/families]
"""

import argparse
import json
import os

FAMILIES = ["qwen2", "qwen3", "mistral", "gemma3_text"]
# Gemma ties its head to an embedding that dominates the residual stream, so from most seeds
# greedy decoding repeats one token; this one gives four different ones.
SEEDS = {"qwen2": 1000, "qwen3": 1001, "mistral": 1002, "gemma3_text": 1144}
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

# gemma3_text: a SentencePiece-style BPE as Gemma's tokenizer.json is. Specials, then the 256
# byte tokens, then `▁` and a-z, then the merged pieces in merge order (each has exactly one
# split into two tokens of the vocabulary, so the merges can be recovered from the pieces).
SP = "\u2581"
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_PAD, GEMMA_BOS, GEMMA_UNK, SOT, EOT = 0, 2, 3, 4, 5
# fmt: off
GEMMA_MERGES = [
    (SP, "t"), ("h", "e"), (SP, "a"), ("i", "n"), ("e", "r"), (SP + "t", "he"), ("o", "n"),
    (SP, "s"), ("r", "e"), ("a", "n"), ("in", "g"), (SP, "b"), (SP + "b", "e"), ("n", "d"),
    (SP + "a", "nd"), (SP, SP), ("i", "s"), (SP, "is"), (SP + "the", "re"), ("o", "u"),
    (SP, "y"), (SP + "y", "ou"), ("m", "e"), (SP, "n"), (SP + "n", "a"), (SP + "na", "me"),
]
# fmt: on
GEMMA_CHARS = [SP] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
GEMMA_TOKENS = (
    GEMMA_SPECIALS
    + [f"<0x{b:02X}>" for b in range(256)]
    + GEMMA_CHARS
    + [left + right for left, right in GEMMA_MERGES]
)
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = 'model' -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
GEMMA_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name  a prime?"},
]
# "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\nthe"
GEMMA_SEQUENCE = [GEMMA_BOS, SOT, 283, 281, 293, 16, 78, 271, 39, EOT, 16]
GEMMA_SEQUENCE += [SOT, 275, 277, 266, 267, 274, 16, 282, 290]
# "<bos><start_of_turn>user\nOk?<end_of_turn>\n<start_of_turn>model\n", then "Yes" / "No"
GEMMA_PROMPT = [GEMMA_BOS, SOT, 283, 281, 293, 16, 85, 273, 69, EOT, 16]
GEMMA_PROMPT += [SOT, 275, 277, 266, 267, 274, 16]
GEMMA_CHOSEN = [95, 267, 281, EOT]
GEMMA_REJECTED = [84, 277, EOT]
GEMMA_TEXTS = [
    "",
    " the  Answer is 42. ",
    "  there in   the Bin\nYou and me!",
    "caf\u00e9 \u65e5\u672c",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "being   spaced   out   ",
]


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


def gemma_tokenizer():
    """Gemma's tokenizer.json shape: BPE with byte fallback over `▁`-spelled text, no
    pre-tokenizer, and a post-processor that puts <bos> first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {t: i for i, t in enumerate(GEMMA_TOKENS)}
    for left, right in GEMMA_MERGES:
        piece = left + right
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        if [s for s in splits if s[0] in vocab and s[1] in vocab] != [(left, right)]:
            raise SystemExit(f"merged piece {piece!r} must have exactly one split in the vocabulary")
    model = models.BPE(
        vocab=vocab,
        merges=GEMMA_MERGES,
        unk_token="<unk>",
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SP)
    tok.decoder = decoders.Sequence([decoders.Replace(SP, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos>:1 $B:1", special_tokens=[("<bos>", GEMMA_BOS)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA_SPECIALS])
    return tok


def fast_tokenizer(family: str):
    from transformers import PreTrainedTokenizerFast

    if family == "gemma3_text":
        return PreTrainedTokenizerFast(
            tokenizer_object=gemma_tokenizer(),
            bos_token="<bos>",
            eos_token="<end_of_turn>",
            unk_token="<unk>",
            pad_token="<pad>",
            add_bos_token=True,
            add_eos_token=False,
            chat_template=GEMMA_TEMPLATE,
            model_max_length=256,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATE,
        model_max_length=256,
    )


def case(family: str) -> dict:
    """The family's fixed sequence, chat, DPO case and EOS id."""
    if family == "gemma3_text":
        return {
            "sequence": GEMMA_SEQUENCE,
            "chat": GEMMA_CHAT,
            "prompt": GEMMA_PROMPT,
            "chosen": GEMMA_CHOSEN,
            "rejected": GEMMA_REJECTED,
            "eos": EOT,
        }
    return {
        "sequence": SEQUENCE,
        "chat": CHAT,
        "prompt": PROMPT,
        "chosen": CHOSEN,
        "rejected": REJECTED,
        "eos": IM_END,
    }


def config(family: str):
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "gemma3_text":
        # Gemma 3's layer pattern (every sixth layer global) written out, its two rope bases,
        # and query_pre_attn_scalar = head_dim (llama.cpp's scale for every size but 27B).
        return Gemma3TextConfig(
            vocab_size=len(GEMMA_TOKENS),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=64,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            bos_token_id=GEMMA_BOS,
            eos_token_id=EOT,
            pad_token_id=GEMMA_PAD,
        )

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


def randomize(model, torch, seed: int, gemma: bool = False):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if name.endswith("norm.weight"):
                # Gemma stores w and scales by 1 + w.
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.35 * noise)


def completion_logp(model, torch, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
    start = len(prompt)
    return logp[start - 1 : -1].gather(1, ids[0, start:].unsqueeze(1)).sum()


def greedy(model, torch, ids, eos):
    """Greedy tokens, refusing a step whose top two logits are within MIN_MARGIN."""
    out = list(ids)
    for _ in range(GREEDY_TOKENS):
        logits = model(input_ids=torch.tensor([out])).logits[0, -1]
        top = torch.topk(logits, 2)
        margin = float(top.values[0] - top.values[1])
        if margin < MIN_MARGIN:
            raise SystemExit(f"greedy step near a tie (margin {margin}): change the seed")
        out.append(int(top.indices[0]))
        if out[-1] == eos:
            break
    return out[len(ids) :]


def check_gemma_ids(tok, c, chat_ids) -> None:
    """The Gemma id constants are the tokenizer's own spelling of their text, the template gives
    one <bos>, and every sequence stays well inside the sliding window (64)."""
    for ids in (c["sequence"], c["prompt"] + c["chosen"], c["prompt"] + c["rejected"]):
        text = tok.decode(ids)
        if tok(text, add_special_tokens=False)["input_ids"] != ids:
            raise SystemExit(f"gemma3_text: {ids} is not how the tokenizer spells {text!r}")
    if chat_ids[0] != GEMMA_BOS or chat_ids.count(GEMMA_BOS) != 1:
        raise SystemExit(f"gemma3_text: chat ids must start with exactly one <bos>: {chat_ids}")
    completion = max(len(c["chosen"]), len(c["rejected"]))
    longest = max(len(c["sequence"]), len(chat_ids) + GREEDY_TOKENS, len(c["prompt"]) + completion)
    if longest > 48:
        raise SystemExit(f"gemma3_text: a sequence of {longest} tokens is too close to the window")


def past_window(model, torch):
    """gemma3_text: a sequence of 150 tokens, past the 64-token window of the sliding layers:
    its logits and log-probs, and a DPO pair whose prompt (100 tokens) and completions reach
    past the window, computed in float64."""
    ids = [GEMMA_BOS] + [6 + (i * 97 + 13) % (len(GEMMA_TOKENS) - 6) for i in range(149)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        prompt, chosen, rejected = ids[:100], ids[100:140] + [EOT], ids[120:150] + [EOT]
        return {
            "ids": ids,
            "next_logits": [float(v) for v in logits[-1]],
            "token_logps": [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))],
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "policy_chosen_logp": float(completion_logp(model, torch, prompt, chosen)),
            "policy_rejected_logp": float(completion_logp(model, torch, prompt, rejected)),
        }


def make(family: str, out_dir: str, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    c = case(family)
    gemma = family == "gemma3_text"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    randomize(model, torch, seed, gemma=gemma)
    model.generation_config.eos_token_id = c["eos"]
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast_tokenizer(family).save_pretrained(out_dir)

    # Load back what was written, as a user would.
    tok = PreTrainedTokenizerFast.from_pretrained(out_dir)
    attn = {"attn_implementation": "eager"} if gemma else {}
    f32 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, **attn).eval()
    f64 = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float64, **attn).eval()
    chat_ids = tok.apply_chat_template(c["chat"], add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    chat_ids = [int(i) for i in chat_ids]
    seq = c["sequence"]
    if gemma:
        check_gemma_ids(tok, c, chat_ids)
    with torch.no_grad():
        logits = f64(input_ids=torch.tensor([seq])).logits[0]
        logp = torch.log_softmax(logits, dim=-1)
        token_logps = [float(logp[t - 1, seq[t]]) for t in range(1, len(seq))]
        greedy_ids = greedy(f32, torch, chat_ids, c["eos"])
        if greedy(f64, torch, chat_ids, c["eos"]) != greedy_ids:
            raise SystemExit(f"{family}: float32 and float64 greedy tokens differ")

    pc = completion_logp(f64, torch, c["prompt"], c["chosen"])
    pr = completion_logp(f64, torch, c["prompt"], c["rejected"])
    f64.zero_grad(set_to_none=True)
    h = (pc - REF_CHOSEN) - (pr - REF_REJECTED)
    loss = -torch.nn.functional.logsigmoid(BETA * h)
    loss.backward()
    norm = sum(float(p.grad.pow(2).sum()) for p in f64.parameters() if p.grad is not None) ** 0.5

    ref = {
        "family": family,
        "ids": seq,
        "next_logits": [float(v) for v in logits[-1]],
        "token_logps": token_logps,
        "chat": c["chat"],
        "chat_ids": chat_ids,
        "greedy": greedy_ids,
        "greedy_text": tok.decode(greedy_ids, skip_special_tokens=True),
        "dpo": {
            "prompt": c["prompt"],
            "chosen": c["chosen"],
            "rejected": c["rejected"],
            "beta": BETA,
            "ref_chosen_logp": REF_CHOSEN,
            "ref_rejected_logp": REF_REJECTED,
            "policy_chosen_logp": float(pc),
            "policy_rejected_logp": float(pr),
            "loss": float(loss),
            "total_grad_norm": norm,
        },
    }
    if gemma:
        ref["text_ids"] = [
            {"text": t, "ids": tok(t, add_special_tokens=True)["input_ids"]} for t in GEMMA_TEXTS
        ]
        ref["past_window"] = past_window(f64, torch)
    ref["made_with"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"{family}: greedy {greedy_ids}, loss {float(loss):.6f}, grad norm {norm:.6f}")


GGUF_FAMILIES = ["qwen2", "qwen3", "gemma3_text"]
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


# Gemma 3's four norms a layer: llama.cpp calls the one before the MLP `ffn_norm`.
GEMMA3_GGUF_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf: str, names: dict = GGUF_NAMES) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{names[rest]}"


def write_gguf(family: str, hf_dir: str, path: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    if family == "gemma3_text":
        return write_gemma3_gguf(hf_dir, path)
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


def write_gemma3_gguf(hf_dir: str, path: str) -> None:
    """As llama.cpp's converter writes Gemma 3 (architecture `gemma3`): norm weights as 1 + w,
    no `output.weight` (tied), the global rope base (llama.cpp fixes the local one at 1e4 and the
    pattern at 6), and a SentencePiece vocabulary without merges: each merged piece scores below
    the ones merged before it and comes after them in the file, so merges recovered from either
    the scores or the order are the HF tokenizer's."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_name("tiny-gemma3_text")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    specials, chars = len(GEMMA_SPECIALS), len(GEMMA_CHARS)
    merged = [-1.0 - k for k in range(len(GEMMA_MERGES))]
    # SentencePiece scores its single characters below every merged piece.
    scores = [0.0] * (specials + 256) + [merged[-1] - 1.0 - k for k in range(chars)] + merged
    types = [gguf.TokenType.CONTROL] * specials
    types[GEMMA_UNK] = gguf.TokenType.UNKNOWN
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (chars + len(GEMMA_MERGES))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(GEMMA_TOKENS)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(GEMMA_BOS)
    w.add_eos_token_id(EOT)
    w.add_unk_token_id(GEMMA_UNK)
    w.add_pad_token_id(GEMMA_PAD)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(GEMMA_TEMPLATE)
    for name, t in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        if name.endswith("norm.weight"):
            t = t + 1.0
        w.add_tensor(gguf_name(name, GEMMA3_GGUF_NAMES), t.astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_gemma3_gguf(hf_dir: str, path: str) -> None:
    """transformers' GGUF loader on the file against the HF folder: next-token logits, the
    `text_ids` encodings and the chat ids.

    A GGUF has no key for `query_pre_attn_scalar`: llama.cpp scales by 1/sqrt(head_dim) (here
    16, as in config.json), transformers' loader takes Gemma3TextConfig's default 256. The
    logits are compared with the loader's config as it is (reported only) and with 16."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(hf_dir, "reference.json")) as f:
        ref = json.load(f)
    ids = torch.tensor([ref["ids"]])
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(path, tmp)
        name = os.path.basename(path)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
        for extra in ({}, {"query_pre_attn_scalar": hf.config.head_dim}):
            gg = AutoModelForCausalLM.from_pretrained(
                tmp, gguf_file=name, dtype=torch.float32, attn_implementation="eager", **extra
            )
            with torch.no_grad():
                diff = float((logits - gg(input_ids=ids).logits).abs().max())
            scalar = gg.config.query_pre_attn_scalar
            print(f"gemma3_text GGUF, query_pre_attn_scalar {scalar}: max |Δlogit| {diff:.3e}")
        if diff > 1e-4:
            raise SystemExit("gemma3_text: the GGUF's logits are not the HF folder's")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=name)
        texts = ref["text_ids"]
        bad = [
            (t["text"], t["ids"], got)
            for t in texts
            if (got := tok(t["text"], add_special_tokens=True)["input_ids"]) != t["ids"]
        ]
        for text, want, got in bad:
            print(f"gemma3_text GGUF tokenizer: {text!r}: {got} vs {want}")
        print(f"gemma3_text GGUF tokenizer: {len(texts) - len(bad)}/{len(texts)} texts agree")
        chat_ids = tok.apply_chat_template(ref["chat"], add_generation_prompt=True, tokenize=True)
        if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
            chat_ids = chat_ids["input_ids"]
        print(f"gemma3_text GGUF tokenizer and template: chat ids agree: {list(chat_ids) == ref['chat_ids']}")
        if bad or list(chat_ids) != ref["chat_ids"]:
            raise SystemExit("gemma3_text: the GGUF's tokenizer is not the HF folder's")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/families")
    ap.add_argument("--family", choices=FAMILIES, action="append")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)
    for family in a.family or FAMILIES:
        make(family, os.path.join(a.out, family), seed=SEEDS[family])
        if family in GGUF_FAMILIES:
            write_gguf(family, os.path.join(a.out, family), os.path.join(a.out, f"{family}.gguf"))
        if family == "gemma3_text":
            check_gemma3_gguf(os.path.join(a.out, family), os.path.join(a.out, f"{family}.gguf"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
