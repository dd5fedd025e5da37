#!/usr/bin/env python3
"""Mean and spread over seeds of rl_train runs (logs.jsonl): reward, response length and KL
over the first and the last five steps, and a few sampled responses of the last step.

    python3 scripts/rl_seed_summary.py outputs/rl_learn_s1 outputs/rl_learn_s2 ...
"""
import json
import statistics as st
import sys


def logs(run):
    with open(f"{run}/logs.jsonl") as f:
        return [json.loads(line) for line in f]


def window_mean(rows, key, part):
    vals = [r[key] for r in (rows[:5] if part == "first" else rows[-5:])]
    return sum(vals) / len(vals)


def spread(vals):
    return f"{st.mean(vals):.3f} ± {st.stdev(vals) if len(vals) > 1 else 0.0:.3f}"


def main(runs):
    all_logs = {r: logs(r) for r in runs}
    print(f"{len(runs)} runs, steps: {[len(v) for v in all_logs.values()]}")
    keys = ["reward", "completion_length", "kl", "time/step"]
    keys += [k for k in ("rewards/info_gain/mean", "rewards/success/mean")
             if all(k in v[0] for v in all_logs.values())]
    for key in keys:
        first = [window_mean(v, key, "first") for v in all_logs.values()]
        last = [window_mean(v, key, "last") for v in all_logs.values()]
        print(f"{key:22} first 5 steps {spread(first):>16}   last 5 steps {spread(last):>16}")
    for r in runs:
        with open(f"{r}/rollouts.jsonl") as f:
            last = [json.loads(line) for line in f][-1]
        texts = [resp["text"].replace("\n", " ")[:160] for resp in last["responses"][:2]]
        print(f"{r} step {last['step']} ({last['task_id']}): {texts}")


if __name__ == "__main__":
    main(sys.argv[1:])
