#!/usr/bin/env python3
"""Baseline for `bench`'s RL step figure (BENCHMARKS.md, "rl_train step vs TRL GRPOTrainer"): TRL's GRPOTrainer on the
default model (read from the same GGUF, dequantized to f32), one optimizer step per
2 prompts x n generations, a fixed number of new tokens, a programmatic length reward and the
recipe's settings (KL coefficient 0.001 against a reference model, 1 PPO epoch, lr 1e-6).

    python scripts/bench_trl_grpo.py --steps 3 --threads 2 --json out.json

Prints seconds per step (the first step is reported apart: it includes warm-up) and peak RSS.
Needs torch, transformers, trl, datasets, gguf (pip); reads models/<default>.gguf.
"""
import argparse
import json
import os
import resource
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

PROMPTS = [
    "Write a short note inviting my team to a Friday lunch.",
    "Explain what a hash map is to a new programmer.",
]


def length_reward(completions, **_):
    """-1e-4 per word, as the recipe's token_amount term (any programmatic reward would do)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(-1e-4 * len(text.split()))
    return out


class StepTimer(TrainerCallback):
    def __init__(self):
        self.starts, self.seconds = {}, []

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.seconds.append(time.perf_counter() - self.t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # The GGUF loader marks the model as quantized, which trainers refuse: rebuild a plain
    # f32 model from its dequantized weights.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    # GRPOTrainer builds its reference model from the policy's path: give it a plain HF folder.
    hf_dir = "/tmp/trl_grpo_bench/model"
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    del model
    n_prompts = len(PROMPTS)
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS] * (a.steps + 1)
    )
    cfg = GRPOConfig(
        output_dir="/tmp/trl_grpo_bench",
        use_cpu=True,
        per_device_train_batch_size=n_prompts * a.group_size,
        num_generations=a.group_size,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        beta=0.001,
        learning_rate=1e-6,
        weight_decay=0.01,
        max_grad_norm=1.0,
        num_iterations=1,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        shuffle_dataset=False,
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
        # Every completion exactly --new-tokens long, as in our figure (end-of-turn ignored).
        generation_kwargs={"min_new_tokens": a.new_tokens},
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=hf_dir,
        reward_funcs=length_reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steady = timer.seconds[1:] or timer.seconds
    figures = {
        "first_step_s": timer.seconds[0],
        "step_s_median": sorted(steady)[len(steady) // 2],
        "steps": timer.seconds,
        "peak_rss_mb": peak_mb,
        "completion_tokens_per_step": n_prompts * a.group_size * a.new_tokens,
    }
    print(json.dumps(figures, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
