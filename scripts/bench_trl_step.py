#!/usr/bin/env python3
"""Baseline for `bench train-step`: PyTorch + TRL DPO steps on the same workload.

One pair per step, a prompt of PROMPT tokens and chosen / rejected completions of COMPLETION
tokens each, f32 on the CPU, TRL's sigmoid loss (beta 0.1), AdamW, gradient clipping 1.0.
Seconds per optimizer step (median after one warm-up step) and peak RSS are printed as JSON,
like `bench train-step`. Needs torch, transformers, trl (tested: torch 2.5.1,
transformers 4.46.3, trl 0.12.2) and an HF model directory, e.g. the `final/` of a one-step
`dpo_train` run of the default model (see BENCHMARKS.md). Nothing is downloaded.

    python scripts/bench_trl_step.py MODEL_DIR [--threads 2] [--steps 3] [--lora]
        [--precompute-ref]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--completion-tokens", type=int, default=128)
    ap.add_argument("--lora", action="store_true", help="LoRA r=32, alpha=16 on all 7 projections")
    ap.add_argument(
        "--precompute-ref",
        action="store_true",
        help="reference log-probs computed once before training (as bench train-step caches them)",
    )
    a = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.float32)

    # " hello" and " world" are single tokens that BPE never merges across words, so the
    # texts below tokenize to exactly the requested lengths (TRL appends one EOS to each
    # completion; the script prints the lengths it got).
    prompt = " hello" * a.prompt_tokens
    chosen = " world" * (a.completion_tokens - 1)
    rejected = " hello" * (a.completion_tokens - 1)
    data = Dataset.from_dict(
        {"prompt": [prompt] * 64, "chosen": [chosen] * 64, "rejected": [rejected] * 64}
    )

    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=32,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )

    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        # TRL 1.x dropped `max_prompt_length`; the prompts here are shorter than any cap.
        cfg = DPOConfig(
            output_dir=out,
            per_device_train_batch_size=1,
            max_steps=a.steps + 1,
            learning_rate=5e-6,
            beta=0.1,
            max_grad_norm=1.0,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            max_length=a.prompt_tokens + a.completion_tokens + 8,
            precompute_ref_log_probs=a.precompute_ref,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        trainer = DPOTrainer(
            model=model,
            ref_model=None,
            args=cfg,
            train_dataset=data,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[Timer()],
        )
        row = trainer.train_dataset[0]
        lengths = {
            k: len(row[k])
            for k in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
            if k in row
        }
        trainer.train()

    step = statistics.median(times[1:]) if len(times) > 1 else times[0]
    tokens = 2 * (a.prompt_tokens + a.completion_tokens)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # KiB on Linux
    print(
        json.dumps(
            {
                "bench": "trl-train-step",
                "mode": "lora r=32" if a.lora else "full",
                "precompute_ref": a.precompute_ref,
                "threads": a.threads,
                "step_s": step,
                "steps_s": times,
                "tokens_per_s": tokens / step,
                "peak_rss_mb": peak_mb,
                "token_lengths": lengths,
                "torch": torch.__version__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
