#!/usr/bin/env python3
"""Greedy tokens of our engine (f32 weights) vs transformers on the default model saved with a
transformers-5 style config (rope base only under `rope_parameters`).

Exports the default model as an HF folder with our own code
(`cargo run --release --example export_default_model`), rewrites its config.json to the
transformers-5 form (no top-level `rope_theta`; `rope_parameters: {rope_type: default,
rope_theta: 100000}`), then decodes a few chat prompts greedily with our engine
(`--example greedy_tokens`) and with transformers (float32, eager attention) from the same
prompt ids, and prints how many generated tokens agree (up to the first difference). Also
runs our engine on the folder with the base forced to 10000 (what the old reader did with
this config) as the control. Nothing is downloaded. Tested with torch 2.15, transformers 5.23.

    /work/venv/bin/python scripts/rope_greedy_vs_transformers.py [--max-new 48]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in one sentence.",
    "List three colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for sleeping better.",
]


EXAMPLES_DIR = None  # --examples-dir: run already built examples instead of `cargo run`


def cargo_example(root, name, *args):
    if EXAMPLES_DIR:
        cmd = [os.path.join(EXAMPLES_DIR, name), *args]
    else:
        cmd = ["cargo", "run", "--quiet", "--release", "--example", name, "--", *args]
    return subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout


def ours(root, model_dir, max_new):
    out = cargo_example(root, "greedy_tokens", model_dir, str(max_new), *PROMPTS)
    return [json.loads(l) for l in out.splitlines() if l.strip()]


def agree(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def rewrite_config(model_dir, theta_top_level=None):
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling", None)
    if theta_top_level is None:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        cfg["rope_theta"] = theta_top_level
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return theta


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--examples-dir", help="e.g. target/release/examples (already built)")
    args = parser.parse_args()
    global EXAMPLES_DIR
    EXAMPLES_DIR = args.examples_dir
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        v5 = os.path.join(tmp, "v5")
        cargo_example(root, "export_default_model", v5)
        theta = rewrite_config(v5)
        print(f"exported; rope_parameters.rope_theta = {theta}", file=sys.stderr)
        control = os.path.join(tmp, "control")
        cargo_example(root, "export_default_model", control)
        rewrite_config(control, theta_top_level=10000.0)

        ours_v5 = ours(root, v5, args.max_new)
        ours_control = ours(root, control, args.max_new)

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(v5, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        print(f"transformers {transformers.__version__} reads rope_parameters = {model.config.rope_parameters}", file=sys.stderr)
        totals = {"tokens": 0, "agree": 0, "control_agree": 0, "prompts_identical": 0}
        for mine, ctrl in zip(ours_v5, ours_control):
            ids = torch.tensor([mine["prompt_ids"]])
            with torch.no_grad():
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=args.max_new,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            theirs = gen[0, ids.shape[1]:].tolist()[: len(mine["tokens"])]
            n = agree(mine["tokens"], theirs)
            c = agree(ctrl["tokens"], theirs)
            totals["tokens"] += len(theirs)
            totals["agree"] += n
            totals["control_agree"] += c
            totals["prompts_identical"] += int(n == len(theirs))
            print(json.dumps({"prompt": mine["prompt"], "tokens": len(theirs), "agree": n, "control_agree": c}))
        print(json.dumps({"summary": totals, "prompts": len(PROMPTS), "max_new": args.max_new,
                          "transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
