#!/usr/bin/env python3
"""Writes tests/fixtures/default_model_dpo_grads.json: PyTorch's gradients of one DPO step.

The default model is exported by our own code (GGUF dequantized to f32, Q/K rows in the HF
layout) with `cargo run --release --example export_default_model -- DIR`, loaded here with
transformers, and run in float64 on one preference pair (token ids below, each completion
scored after the prompt as TRL does). The loss is TRL's sigmoid DPO loss with beta 0.1 and
two kinds of reference log-probs: fixed values, and the policy's own (a run's first step,
h = 0, where a log-sigmoid built from relu/abs has the wrong slope). The fixture records the
weights' digest (see
tests/common/weights_digest.rs), the inputs, the policy log-probs, the global gradient L2
norm and, for a handful of tensors, the gradient's L2 norm, sum, sum of absolute values and
values at fixed indices. Nothing is downloaded. Tested with torch 2.15, transformers 5.23.

    python scripts/make_grad_fixture.py [--export-dir DIR] [--out PATH]
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
CHOSEN = [504, 3575, 282, 4649, 314, 7042, 30, 2]
REJECTED = [57, 1341, 5248, 30, 2]
# Near the policy's log-probs (about -1.2 and -53.7) but not at them: the loss is neither
# at its ln 2 start nor saturated, so every gradient is well above rounding.
REF_CHOSEN = -5.0
REF_REJECTED = -50.0
BETA = 0.1
TENSORS = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.14.mlp.gate_proj.weight",
    "model.layers.29.mlp.down_proj.weight",
    "model.layers.29.input_layernorm.weight",
    "model.norm.weight",
]
SAMPLES = 16


def sample_indices(numel: int) -> list:
    """16 spread, deterministic flat indices (the Rust test reads them from the fixture)."""
    return [(i * 2654435761 + 12345) % numel for i in range(SAMPLES)]


def weights_digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().contiguous().numpy().astype("<f4").tobytes())
    return h.hexdigest()


def export(dir_: str) -> None:
    cmd = ["cargo", "run", "--release", "--example", "export_default_model", "--", dir_]
    subprocess.run(cmd, check=True)


def completion_logp(model, torch, completion: list):
    ids = torch.tensor([PROMPT + completion])
    logits = model(input_ids=ids).logits[0]  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    start = len(PROMPT)
    targets = ids[0, start:]
    return logp[start - 1 : -1].gather(1, targets.unsqueeze(1)).sum()


def case(model, torch, pc, pr, ref_chosen: float, ref_rejected: float) -> dict:
    """TRL's sigmoid loss for fixed reference log-probs and the gradients it gives."""
    model.zero_grad(set_to_none=True)
    h = (pc - ref_chosen) - (pr - ref_rejected)
    loss = -torch.nn.functional.logsigmoid(BETA * h)
    loss.backward(retain_graph=True)
    params = dict(model.named_parameters())
    total = sum(float(p.grad.pow(2).sum()) for p in params.values() if p.grad is not None)
    tensors = {}
    for name in TENSORS:
        g = params[name].grad.flatten()
        idx = sample_indices(g.numel())
        tensors[name] = {
            "numel": g.numel(),
            "l2_norm": float(g.norm()),
            "sum": float(g.sum()),
            "abs_sum": float(g.abs().sum()),
            "indices": idx,
            "values": [float(g[i]) for i in idx],
        }
    return {
        "reference": "given",
        "ref_chosen_logp": ref_chosen,
        "ref_rejected_logp": ref_rejected,
        "loss": loss.item(),
        "total_grad_norm": total**0.5,
        "tensors": tensors,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export-dir", help="an existing export (default: export to a temp dir)")
    ap.add_argument("--out", default="tests/fixtures/default_model_dpo_grads.json")
    a = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        dir_ = a.export_dir or tmp
        if not a.export_dir:
            export(dir_)
        digest = weights_digest(load_file(os.path.join(dir_, "model.safetensors")))
        model = AutoModelForCausalLM.from_pretrained(
            dir_, dtype=torch.float64, attn_implementation="eager"
        )
    model.train(False)  # no dropout; gradients are still computed
    pc = completion_logp(model, torch, CHOSEN)
    pr = completion_logp(model, torch, REJECTED)
    cases = {
        "ref_given": case(model, torch, pc, pr, REF_CHOSEN, REF_REJECTED),
        # A run's first step: the reference is the policy itself, h = 0.
        "ref_is_policy": {
            **case(model, torch, pc, pr, pc.item(), pr.item()),
            "reference": "policy",
        },
    }
    fixture = {
        "made_by": "scripts/make_grad_fixture.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": "float64",
        "weights_sha256": digest,
        "prompt": PROMPT,
        "chosen": CHOSEN,
        "rejected": REJECTED,
        "beta": BETA,
        "policy_chosen_logp": pc.item(),
        "policy_rejected_logp": pr.item(),
        "cases": cases,
    }
    tmp_out = a.out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    os.replace(tmp_out, a.out)
    for name, c in cases.items():
        print(f"{name}: loss {c['loss']:.6f}, grad norm {c['total_grad_norm']:.6f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
