"""Collects the studies of scripts/method_results.sh into one results file.

Usage: python3 scripts/method_results_collect.py OUT RESULTS ONLY [RECORDED]
  OUT       the script's working directory
  RESULTS   the results JSON (updated: a study not run keeps its section)
  ONLY      "", "20q" or "clarify"
  RECORDED  the clarify seeds pooled from their records ("1 2"): their probes, GRPO curves and
            pair counts are kept from RESULTS
"""
import glob
import json
import os
import sys


def of_seeds(entries, seeds):
    """The entries of `seeds` (keys `sN/...` or `...-sN`)."""
    return {
        k: v
        for k, v in entries.items()
        if any(k.startswith(f"s{s}/") or k.endswith(f"-s{s}") for s in seeds)
    }


def clarify(out, old, recorded):
    """The clarify section; a seed pooled from its record (RECORDED_SEEDS) keeps its probes,
    GRPO curves and pair counts from the previous results file."""
    c = {}
    for mode in ("greedy", "sampled"):
        c[mode] = {
            held: json.load(open(f"{out}/study-clarify-{held}-{mode}-task_reward/study.json"))
            for held in ("heldout", "near", "far")
        }
        c[mode]["heldout_detail_used"] = json.load(
            open(f"{out}/study-clarify-heldout-{mode}-detail_used/study.json")
        )
    # Sampled ask rates on training requests: each seed's warm start before any training, and
    # each DPO round's model. GRPO's are logged every step (clarify/asked_* in logs.jsonl).
    probes = {}
    for d in sorted(glob.glob(f"{out}/clarify/probe/*")):
        metrics = json.load(open(f"{d}/summary.json"))["models"][0]["metrics"]
        probes[os.path.basename(d)] = {
            k: (metrics.get(k) or {}).get("mean")
            for k in (
                "asked_vague",
                "asked_stated",
                "repeated_question",
                "task_reward",
                "detail_used",
            )
        }
    c["ask_rate_probes"] = {**of_seeds(old.get("ask_rate_probes", {}), recorded), **probes}
    keys = (
        "step",
        "reward",
        "clarify/asked_vague",
        "clarify/asked_stated",
        "clarify/asked_again",
        "num_tokens",
    )
    c["grpo_ask_rates"] = of_seeds(old.get("grpo_ask_rates", {}), recorded) | {
        d.split("/clarify/")[1]: [
            {k: row.get(k) for k in keys}
            for row in map(json.loads, open(f"{d}/logs.jsonl"))
        ]
        for d in sorted(glob.glob(f"{out}/clarify/s*/grpo_*"))
    }
    c["pairs"] = of_seeds(old.get("pairs", {}), recorded) | {
        d.split("/clarify/")[1]: json.load(open(f"{d}/manifest.json"))["counts"]
        for d in sorted(glob.glob(f"{out}/clarify/s*/pairs-*"))
    }
    return c


def main():
    out, results, only = sys.argv[1:4]
    recorded = sys.argv[4].split() if len(sys.argv) > 4 else []
    doc = json.load(open(results)) if os.path.exists(results) else {}
    if only != "clarify":
        doc["twenty_questions"] = json.load(open(f"{out}/study-20q/study.json"))
    if only != "20q":
        doc["clarify"] = clarify(out, doc.get("clarify", {}), recorded)
    with open(results, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
