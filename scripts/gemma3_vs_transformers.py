#!/usr/bin/env python3
"""Real-weights check of our engine against transformers on Gemma 3 270M (base, Q4_K_M GGUF).

Both sides read the same GGUF. transformers (float32, eager attention) dequantizes every tensor
to f32 and builds a Gemma3TextConfig from the GGUF metadata; our engine runs
`cargo run --release --example raw_logits -- <model.gguf> <weights> <max_new> <prompt>...`
(or `<examples-dir>/raw_logits ...`) once with weights `f32` and once with `native`, which prints
one JSON line per prompt:
    {"prompt": str, "prompt_ids": [int], "next_logits": [float x vocab], "tokens": [int x max_new]}
(prompt ids include BOS; greedy decoding does not stop at EOS).

For a few raw-text prompts (a base model: no chat template; BOS added) it compares, per prompt
and weights mode: prompt ids (first difference), max |delta logit| of the last position's
next-token logits over the whole vocabulary, top-1 agreement, and how many greedy tokens agree
before the first difference, and whether that step is a near-tie (transformers' top-2 margin
< --near-tie). When our prompt ids differ, transformers is rerun from our ids so that the
logits still compare like with like (the id mismatch alone fails the check).

Exits 1 when, in f32 mode, any prompt's ids differ, greedy tokens differ at a step that is not a
near-tie, or max |delta logit| > --tol; `native` (quantized kernels) is only reported. Exits 2
when our side cannot be run or prints something malformed. Writes <out>/gemma3_check.json and
<out>/gemma3_check.md. Nothing is downloaded (fetch the model once with
scripts/fetch_gemma3_270m.sh). Tested with torch 2.15 (CPU), transformers 5.24, gguf 0.19.

    python3 scripts/gemma3_vs_transformers.py [--model models/gemma-3-270m-q4_k_m.gguf]
        [--max-new 16] [--examples-dir target/release/examples] [--out outputs/gemma3_check]
        [--tol 1e-2] [--near-tie 1e-3] [--weights f32,native] [--prompt TEXT ...]
    python3 scripts/gemma3_vs_transformers.py --transformers-only   # reference side only
"""

import argparse
import hashlib
import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_MODEL = "models/gemma-3-270m-q4_k_m.gguf"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, there was a",
    "1, 2, 3, 5, 8, 13,",
    "Die Hauptstadt von Deutschland ist",
    "東京は日本の",
]


def die(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def peak_rss_mib(who=resource.RUSAGE_SELF):
    return resource.getrusage(who).ru_maxrss / 1024  # Linux: KiB


# ----------------------------------------------------------------------------- our engine


def run_ours(model, weights, max_new, prompts, examples_dir):
    args = [model, weights, str(max_new), *prompts]
    if examples_dir:
        exe = os.path.join(examples_dir, "raw_logits")
        if not os.path.isfile(exe):
            die(f"{exe} not found: build it with `cargo build --release --example raw_logits`")
        cmd = [exe, *args]
    else:
        cmd = ["cargo", "run", "--quiet", "--release", "--example", "raw_logits", "--", *args]
    shown = " ".join(shlex.quote(a) for a in cmd[: len(cmd) - len(prompts)]) + f" <{len(prompts)} prompts>"
    log(f"ours ({weights}): {shown}")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError as e:
        die(f"could not start our side ({e}); pass --examples-dir or put cargo on PATH")
    seconds = time.time() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        die(f"our raw_logits example ({weights}) exited with status {proc.returncode}")
    rows = []
    for n, line in enumerate(proc.stdout.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            die(f"raw_logits ({weights}) stdout line {n} is not JSON ({e}): {line[:200]!r}")
    if len(rows) != len(prompts):
        die(f"raw_logits ({weights}) printed {len(rows)} JSON lines for {len(prompts)} prompts")
    for row, prompt in zip(rows, prompts):
        for key in ("prompt", "prompt_ids", "next_logits", "tokens"):
            if key not in row:
                die(f"raw_logits ({weights}) line for {prompt!r} lacks {key!r}")
        if row["prompt"] != prompt:
            die(f"raw_logits ({weights}) answered prompt {row['prompt']!r} where {prompt!r} was expected")
        if len(row["tokens"]) != max_new:
            die(f"raw_logits ({weights}) gave {len(row['tokens'])} tokens for {prompt!r}, expected {max_new} "
                "(greedy must not stop at EOS)")
    return rows, seconds


# ----------------------------------------------------------------------------- transformers


class Reference:
    def __init__(self, model_path):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        try:
            import gguf
            self.versions["gguf"] = getattr(gguf, "__version__", None) or _dist_version("gguf")
        except ImportError:
            die("transformers needs the `gguf` package to read GGUF files: pip install gguf")
        folder, name = os.path.split(model_path)
        t0 = time.time()
        self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        self.tokenizer_s = time.time() - t0
        t0 = time.time()
        self.model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self.model_s = time.time() - t0
        self.config = self.model.config.to_dict()
        self.vocab = self.model.config.vocab_size

    def encode(self, prompt):
        return self.tok(prompt, add_special_tokens=True)["input_ids"]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)

    def greedy(self, ids, max_new):
        """Argmax loop over full forward passes (no KV cache, no EOS stop); returns the first
        step's logits (the prompt's next-token logits), the tokens, and each step's top-2 margin."""
        torch = self.torch
        seq = list(ids)
        tokens, margins, first = [], [], None
        with torch.no_grad():
            for _ in range(max_new):
                x = torch.tensor([seq])
                logits = self.model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False,
                                    logits_to_keep=1).logits[0, -1].float()
                if first is None:
                    first = logits.clone()
                top = torch.topk(logits, 2)
                nxt = int(top.indices[0])
                margins.append(float(top.values[0] - top.values[1]))
                tokens.append(nxt)
                seq.append(nxt)
        return first, tokens, margins


def _dist_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def reference_row(ref, ids, max_new, prompt=None):
    t0 = time.time()
    logits, tokens, margins = ref.greedy(ids, max_new)
    top5 = ref.torch.topk(logits, 5)
    row = {
        "prompt": prompt,
        "prompt_ids": list(ids),
        "prompt_pieces": ref.tok.convert_ids_to_tokens(list(ids)),
        "next_top5": [[int(i), float(v), ref.decode([int(i)])] for v, i in zip(top5.values, top5.indices)],
        "tokens": tokens,
        "text": ref.decode(tokens),
        "margins": margins,
        "near_ties": [k for k, m in enumerate(margins) if m < NEAR_TIE],
        "seconds": time.time() - t0,
    }
    return row, logits


# ----------------------------------------------------------------------------- comparison


NEAR_TIE = 1e-3


def first_diff(a, b):
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(ref, prompt, ours_row, tf_row, tf_logits, max_new, tol, strict):
    torch = ref.torch
    ids_diff = first_diff(ours_row["prompt_ids"], tf_row["prompt_ids"])
    res = {"prompt": prompt, "ids_equal": ids_diff is None, "compared_on": "same ids"}
    if ids_diff is not None:
        res["ids_first_diff"] = {
            "index": ids_diff,
            "ours": ours_row["prompt_ids"][ids_diff:ids_diff + 4],
            "transformers": tf_row["prompt_ids"][ids_diff:ids_diff + 4],
        }
        # Rerun the reference from our ids so logits and greedy compare on the same input.
        tf_row, tf_logits = reference_row(ref, ours_row["prompt_ids"], max_new)
        res["compared_on"] = "our ids (transformers rerun)"
        res["reference_on_our_ids"] = {k: tf_row[k] for k in ("tokens", "text", "margins")}
    mine = torch.tensor(ours_row["next_logits"], dtype=torch.float32)
    if mine.numel() != tf_logits.numel():
        res.update(vocab_ours=mine.numel(), vocab_transformers=tf_logits.numel(), max_abs_dlogit=math.inf,
                   top1_equal=False)
    else:
        d = (mine - tf_logits).abs()
        worst = int(torch.nan_to_num(d, nan=math.inf).argmax())
        res["max_abs_dlogit"] = float(d[worst]) if torch.isfinite(mine).all() else math.inf
        res["max_abs_dlogit_at"] = worst
        res["mean_abs_dlogit"] = float(d.mean())
        top_ours = torch.topk(mine, 2)
        res["top1_ours"] = int(top_ours.indices[0])
        res["top1_transformers"] = int(tf_logits.argmax())
        res["top1_equal"] = res["top1_ours"] == res["top1_transformers"]
        res["top2_margin_ours"] = float(top_ours.values[0] - top_ours.values[1])
    k = first_diff(ours_row["tokens"], tf_row["tokens"])
    res["greedy_agree"] = len(tf_row["tokens"]) if k is None else k
    res["greedy_total"] = len(tf_row["tokens"])
    res["greedy_ours"] = ours_row["tokens"]
    res["greedy_text_ours"] = ref.decode(ours_row["tokens"])
    if k is not None and k < len(tf_row["margins"]):
        res["first_diff_margin"] = tf_row["margins"][k]
        res["first_diff_near_tie"] = tf_row["margins"][k] < NEAR_TIE
    failures = []
    if ids_diff is not None:
        failures.append(f"prompt ids differ at {ids_diff}")
    if k is not None and not res.get("first_diff_near_tie", False):
        failures.append(f"greedy differs at step {k}")
    if not res["max_abs_dlogit"] <= tol:
        failures.append(f"max |dlogit| {res['max_abs_dlogit']:.3g} > {tol:g}")
    res["failures"] = failures
    res["status"] = ("FAIL" if failures else "ok") if strict else ("differs" if failures else "ok")
    return res


# ----------------------------------------------------------------------------- reporting


def md_escape(s, limit=48):
    s = s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("|", "\\|")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def reference_table(tf_rows):
    lines = ["| prompt | prompt ids | greedy text (transformers) | min top-2 margin | near-ties | s |",
             "|---|---|---|---|---|---|"]
    for r in tf_rows:
        lines.append(f"| `{md_escape(r['prompt'])}` | {len(r['prompt_ids'])} | `{md_escape(r['text'], 72)}` | "
                     f"{min(r['margins']):.3g} | {r['near_ties'] or '-'} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def comparison_table(results):
    lines = ["| weights | prompt | ids equal | max \\|Δ logit\\| | top-1 | greedy agree | first diff near-tie | status |",
             "|---|---|---|---|---|---|---|---|"]
    for weights, rows in results.items():
        for r in rows:
            ids = "yes" if r["ids_equal"] else f"no (@{r['ids_first_diff']['index']})"
            dl = r["max_abs_dlogit"]
            near = "-" if "first_diff_near_tie" not in r else (
                f"{'yes' if r['first_diff_near_tie'] else 'no'} (margin {r['first_diff_margin']:.2g})")
            lines.append(f"| {weights} | `{md_escape(r['prompt'], 32)}` | {ids} | {dl:.3g} | "
                         f"{'yes' if r['top1_equal'] else 'no'} | {r['greedy_agree']}/{r['greedy_total']} | "
                         f"{near} | {r['status']} |")
    return "\n".join(lines)


def meta_lines(meta):
    return [f"- {k}: {v}" for k, v in meta.items() if not isinstance(v, dict)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"GGUF file (default {DEFAULT_MODEL})")
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--examples-dir", help="run already built examples from here (e.g. target/release/examples)")
    parser.add_argument("--out", default="outputs/gemma3_check")
    parser.add_argument("--tol", type=float, default=1e-2, help="f32 mode: largest allowed max |delta logit|")
    parser.add_argument("--near-tie", type=float, default=1e-3,
                        help="a greedy step whose transformers top-2 margin is below this is a near-tie")
    parser.add_argument("--weights", default="f32,native", help="comma-separated modes of our side")
    parser.add_argument("--prompt", action="append", help="replace the built-in prompts (repeatable)")
    parser.add_argument("--transformers-only", action="store_true",
                        help="run and print only the transformers side (no cargo)")
    args = parser.parse_args()
    global NEAR_TIE
    NEAR_TIE = args.near_tie
    if args.max_new < 1:
        die("--max-new must be at least 1")
    prompts = args.prompt or PROMPTS
    weights_modes = [w.strip() for w in args.weights.split(",") if w.strip()]

    model = os.path.join(ROOT, args.model) if args.model == DEFAULT_MODEL else os.path.abspath(args.model)
    if not os.path.isfile(model):
        hint = " (fetch it with scripts/fetch_gemma3_270m.sh)" if args.model == DEFAULT_MODEL else ""
        die(f"model {model} not found{hint}")
    out_dir = os.path.join(ROOT, args.out) if not os.path.isabs(args.out) else args.out
    examples_dir = os.path.abspath(args.examples_dir) if args.examples_dir else None

    meta = {
        "model": model,
        "gguf_sha256": sha256_of(model),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "max_new": args.max_new,
        "tol": args.tol,
        "near_tie": args.near_tie,
    }

    # Our side first: fails fast when the example is missing, and keeps the two peaks apart.
    ours = {}
    if not args.transformers_only:
        for w in weights_modes:
            rows, seconds = run_ours(model, w, args.max_new, prompts, examples_dir)
            ours[w] = rows
            meta[f"ours_{w}_s"] = round(seconds, 2)
        meta["ours_peak_rss_mib"] = round(peak_rss_mib(resource.RUSAGE_CHILDREN), 1)

    log("transformers: loading the GGUF (dequantizes every tensor to f32)...")
    ref = Reference(model)
    meta.update(ref.versions)
    meta["transformers_tokenizer_load_s"] = round(ref.tokenizer_s, 2)
    meta["transformers_model_load_s"] = round(ref.model_s, 2)
    meta["torch_threads"] = ref.torch.get_num_threads()
    log("transformers built this config:\n" + json.dumps(ref.config, indent=2, default=str))

    tf_rows, tf_logits = [], []
    for p in prompts:
        row, logits = reference_row(ref, ref.encode(p), args.max_new, p)
        tf_rows.append(row)
        tf_logits.append(logits)
        log(f"transformers: {p!r} -> {row['text']!r} ({row['seconds']:.1f} s)")
    meta["transformers_greedy_s"] = round(sum(r["seconds"] for r in tf_rows), 2)
    meta["transformers_peak_rss_mib"] = round(peak_rss_mib(), 1)

    report = {"meta": meta, "transformers_config": ref.config, "transformers": tf_rows}
    md = ["# Gemma 3 270M: our engine vs transformers", "", *meta_lines(meta), "",
          "## transformers (reference)", "", reference_table(tf_rows), ""]
    failed = []
    if args.transformers_only:
        print(reference_table(tf_rows))
        for r in tf_rows:
            print(json.dumps({k: r[k] for k in ("prompt", "prompt_ids", "tokens", "text", "near_ties")},
                             ensure_ascii=False))
        name = "gemma3_transformers"
    else:
        results = {}
        for w in weights_modes:
            results[w] = [compare(ref, p, o, t, l, args.max_new, args.tol, strict=(w == "f32"))
                          for p, o, t, l in zip(prompts, ours[w], tf_rows, tf_logits)]
            if w == "f32":
                failed += [f"{r['prompt']!r}: {f}" for r in results[w] for f in r["failures"]]
        report["comparison"] = results
        report["passed"] = not failed
        table = comparison_table(results)
        print(table)
        md += ["## comparison", "", table, "",
               f"f32 mode: {'PASS' if not failed else 'FAIL'} (tol {args.tol:g}, near-tie {args.near_tie:g}); "
               "native mode is reported only.", ""]
        name = "gemma3_check"

    md += ["## transformers config", "", "```json", json.dumps(ref.config, indent=2, default=str), "```", ""]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False, default=str)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(md))
    print(f"wrote {os.path.join(out_dir, name + '.json')} and .md; "
          f"transformers load {ref.tokenizer_s + ref.model_s:.1f} s, greedy {meta['transformers_greedy_s']:.1f} s, "
          f"peak RSS {meta['transformers_peak_rss_mib']:.0f} MiB", file=sys.stderr)
    if failed:
        print("FAIL (f32):\n  " + "\n  ".join(failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
