#!/usr/bin/env python3
"""Loads a checkpoint or LoRA adapter that dpo_train / rl_train wrote with transformers (or
PEFT, for an adapter folder) and prints its greedy reply to a fixed chat, as token ids and
text, and the log-prob of that reply: the numbers to compare with `serve --model DIR
--weights f32` on the same folder (docs/development.md). Offline; the adapter's base must be
a local folder, as dpo_train records it.

    python scripts/check_checkpoint_in_transformers.py DIR [--merged DIR2] [--tokens 8]

With --merged, also loads a merged export and prints the largest logit difference between it
and DIR over the chat.
"""

import argparse
import json
import os

CHAT = [{"role": "user", "content": "Is it?"}]


def load(path, torch):
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir")
    ap.add_argument("--merged")
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(2)
    model = load(a.dir, torch)
    tok_dir = a.dir
    if not os.path.isfile(os.path.join(a.dir, "tokenizer.json")):
        tok_dir = json.load(open(os.path.join(a.dir, "adapter_config.json")))["base_model_name_or_path"]
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    seq, logp = list(ids), 0.0
    with torch.no_grad():
        for _ in range(a.tokens):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1].double()
            nxt = int(torch.argmax(logits))
            logp += float(torch.log_softmax(logits, -1)[nxt])
            seq.append(nxt)
            if nxt == tok.eos_token_id:
                break
        reply = seq[len(ids):]
        out = {"dir": a.dir, "greedy": reply, "text": tok.decode(reply, skip_special_tokens=True), "logp": logp}
        if a.merged:
            merged = load(a.merged, torch)
            t = torch.tensor([seq])
            out["max_logit_diff_vs_merged"] = float((model(input_ids=t).logits - merged(input_ids=t).logits).abs().max())
    print(json.dumps(out, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
