#!/usr/bin/env python3
"""Reference answers of transformers for the lm-evaluation-harness test (tests/lm_eval_harness.rs).

Runs lm-evaluation-harness's own `hf` model (transformers, float32, the GGUF dequantized by
transformers' GGUF loader) on the tiny local tasks in tests/fixtures/lm_eval (a multiple-choice
task and a generate_until task), and stores, per task and document, what it answered: each
choice's log-likelihood and whether it is the greedy continuation, or the generated text. The
test runs the same harness with `local-completions` against `serve --model default --weights
f32` and compares (log-likelihoods within 1e-4, generations exactly).

The `hf` model is given `add_bos_token=False` because the harness's remote tokenizer (what
`local-completions` uses against a server with vLLM's tokenizer endpoints) never adds special
tokens: both sides then score and continue the same token ids. The script checks that the
transformers tokenizer and our /tokenize agree on the task's texts only indirectly (through the
answers); SmolLM2's tokenizer adds no BOS, so the setting changes nothing for it.

Needs torch, transformers, gguf, accelerate and lm-eval 0.4.13 (pip, in a scratch virtual environment; CI
never runs this). Nothing is downloaded: the model is the local GGUF, the tasks' data are local
JSON files, and the Hub is switched off.

    python3 -m venv /tmp/fixture-venv
    /tmp/fixture-venv/bin/pip install torch transformers gguf accelerate "lm-eval[api]==0.4.13"
    /tmp/fixture-venv/bin/python scripts/make_lm_eval_fixture.py \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out tests/fixtures/lm_eval/transformers_reference.json]
"""

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS_DIR = os.path.join(ROOT, "tests", "fixtures", "lm_eval")
TASKS = ["collab_mc", "collab_gen"]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run_harness(model, out_dir):
    model = os.path.abspath(model)
    args = ",".join([
        f"pretrained={os.path.dirname(model)}",
        f"gguf_file={os.path.basename(model)}",
        "dtype=float32",
        "add_bos_token=False",
    ])
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=os.path.join(out_dir, "datasets"))
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", args,
           "--tasks", ",".join(TASKS), "--include_path", TASKS_DIR, "--device", "cpu",
           "--batch_size", "1", "--log_samples", "--output_path", out_dir]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=TASKS_DIR, env=env, check=True)


def samples(out_dir, task):
    paths = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
    if len(paths) != 1:
        sys.exit(f"expected one samples file of {task} under {out_dir}, found {paths}")
    with open(paths[0]) as f:
        return [json.loads(line) for line in f]


def reference(rows):
    """Per document: the requests' arguments and what the model answered."""
    out = {}
    for row in sorted(rows, key=lambda r: r["doc_id"]):
        # The requests as the harness logs them (context and continuation, or context and
        # generation settings): the test checks it sent the same ones.
        entry = {"arguments": row["arguments"]}
        resps = [r[0] for r in row["resps"]]
        if all(isinstance(r, (list, tuple)) for r in resps):
            entry["loglikelihoods"] = [float(r[0]) for r in resps]
            entry["is_greedy"] = [str(r[1]) == "True" for r in resps]
        else:
            entry["generations"] = [str(r) for r in resps]
        out[str(row["doc_id"])] = entry
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--out", default=os.path.join(TASKS_DIR, "transformers_reference.json"))
    args = ap.parse_args()
    import lm_eval
    import torch
    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        run_harness(args.model, tmp)
        result = {
            "made_by": "scripts/make_lm_eval_fixture.py",
            "model_sha256": sha256(args.model),
            "versions": {"lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__")
                         else "0.4.13", "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "tasks": {task: reference(samples(tmp, task)) for task in TASKS},
        }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
