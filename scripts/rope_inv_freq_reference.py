#!/usr/bin/env python3
"""Writes tests/fixtures/rope_inv_freq.json: transformers' rotary inverse frequencies.

For a few llama rope settings (default, `linear`, `llama3` as in Llama-3.2-1B-Instruct and
Llama-3.1-8B, and a small llama3 setting with many frequencies in the smoothing band), builds
transformers' own `LlamaRotaryEmbedding` from a `LlamaConfig` in the transformers-5 form
(`rope_parameters`) and records its `inv_freq` buffer (float32, as transformers computes it).
`tests/rope_config.rs` reads each setting through our config reader, in both the
`rope_parameters` form and the classic `rope_theta` + `rope_scaling` form, and compares our
frequencies at 1e-6 relative. Nothing is downloaded. Tested with torch 2.x, transformers 5.23.

    /work/venv/bin/python scripts/rope_inv_freq_reference.py [--out PATH]
"""

import argparse
import json
import os

import torch
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

# (name, head_dim, max_position_embeddings, rope_parameters)
SETTINGS = [
    ("default_smollm2", 64, 8192, {"rope_type": "default", "rope_theta": 100000.0}),
    ("linear_2", 64, 4096, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    ("linear_4_theta_1e5", 64, 8192, {"rope_type": "linear", "rope_theta": 100000.0, "factor": 4.0}),
    (
        "llama3_llama_3_2_1b",
        64,
        131072,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    (
        "llama3_llama_3_1_8b",
        128,
        131072,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    (
        "llama3_small_band",
        32,
        4096,
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 1024,
        },
    ),
]


def inv_freq(head_dim, max_pos, rope_parameters):
    heads = 4
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=head_dim * heads,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        rope_parameters=dict(rope_parameters),
    )
    rotary = LlamaRotaryEmbedding(config)
    return [float(x) for x in rotary.inv_freq.to(torch.float32)], float(rotary.attention_scaling)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(here, "..", "tests", "fixtures", "rope_inv_freq.json"))
    args = parser.parse_args()
    cases = []
    for name, head_dim, max_pos, params in SETTINGS:
        freqs, scaling = inv_freq(head_dim, max_pos, params)
        assert scaling == 1.0, (name, scaling)
        cases.append(
            {
                "name": name,
                "head_dim": head_dim,
                "max_position_embeddings": max_pos,
                "rope_parameters": params,
                "inv_freq": freqs,
            }
        )
    out = {
        "generator": "scripts/rope_inv_freq_reference.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(cases)} settings")


if __name__ == "__main__":
    main()
