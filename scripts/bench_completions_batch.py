#!/usr/bin/env python3
"""Batched against single `/v1/completions` scoring requests on a running `serve`.

Sends the requests lm-evaluation-harness's `local-completions` sends for log-likelihoods
(token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`, temperature 0): N prompts of about
T tokens, first one request per prompt, one after another, then all N in one request (a batch
of `prompt` lists), and prints the seconds of each and the prompts per second. Checks that the
batch's log-probs equal the single requests' (the answer must not depend on the batch). Uses
the standard library only.

    target/release/serve --model default --weights f32 --threads 1 --port 8000 &
    python3 scripts/bench_completions_batch.py --url http://127.0.0.1:8000 [--n 16] [--tokens 220]
        [--choices 4] [--repeat 2]
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

WORDS = ("river stone light garden window paper music winter morning harbor forest letter "
         "island bridge candle mirror orchard valley thunder meadow lantern village ocean "
         "mountain story").split()


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as resp:
        return json.load(resp)


def prompts(url, n, tokens, choices, offset=0):
    """N texts of about `tokens` tokens each, as the server tokenizes them: with `choices` > 1,
    groups of that many that share all but their last tokens (a harness's choices after one
    question), else all distinct."""
    out = []
    for i in range(offset, offset + n):
        q = i // choices if choices > 1 else i
        words = [WORDS[(q * 7 + j * (q + 3)) % len(WORDS)] for j in range(tokens)]
        if choices > 1:
            # The last tenth of the prompt is the choice.
            tail = max(1, tokens // 10)
            words[-tail:] = [WORDS[(i * 5 + j) % len(WORDS)] for j in range(tail)]
        text = f"Question {q}: " + " ".join(words)
        try:
            ids = post(f"{url}/tokenize", {"prompt": text, "add_special_tokens": False})
            out.append(ids["tokens"][:tokens])
        except urllib.error.HTTPError:
            # A server without vLLM's tokenizer endpoints: the text itself (~1 token a word).
            out.append(text)
    return out


def score(url, prompt):
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "echo": True, "seed": 1234}
    return post(f"{url}/v1/completions", body)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=220)
    ap.add_argument("--repeat", type=int, default=1, help="rounds of both (distinct prompts)")
    ap.add_argument("--choices", type=int, default=1,
                    help="prompts per shared question (lm-evaluation-harness's choices); 1: "
                         "every prompt distinct")
    args = ap.parse_args()
    url = args.url.rstrip("/")
    for r in range(args.repeat):
        base = r * 2 * args.n
        singles_ps = prompts(url, args.n, args.tokens, args.choices, base)
        batch_ps = prompts(url, args.n, args.tokens, args.choices, base + args.n)
        started = time.perf_counter()
        singles = [score(url, [p])["choices"][0] for p in singles_ps]
        single_s = time.perf_counter() - started
        started = time.perf_counter()
        batch = score(url, batch_ps)["choices"]
        batch_s = time.perf_counter() - started
        # The same prompts once more, singly, to compare the numbers with the batch's.
        again = [score(url, [p])["choices"][0] for p in batch_ps[:2]]
        diff = max(abs(a - b)
                   for s, c in zip(again, batch[:2])
                   for a, b in zip(s["logprobs"]["token_logprobs"][1:-1],
                                   c["logprobs"]["token_logprobs"][1:-1]))
        print(json.dumps({"round": r, "prompts": args.n, "tokens": args.tokens,
                          "choices": args.choices,
                          "single_s": round(single_s, 2),
                          "single_prompts_per_s": round(args.n / single_s, 2),
                          "batch_s": round(batch_s, 2),
                          "batch_prompts_per_s": round(args.n / batch_s, 2),
                          "max_abs_logprob_diff_batch_vs_single": diff}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
