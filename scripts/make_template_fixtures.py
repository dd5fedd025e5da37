#!/usr/bin/env python3
"""Writes tests/fixtures/templates/cases.json: transformers' renderings of the Qwen2.5, Qwen3
and Gemma 3 chat templates (tests/fixtures/templates/*.jinja, as the models' tokenizer files
ship them; Gemma 3's folds a system message into the first user turn and names the assistant
`model`) for a few conversations: with and without a system message, multi-turn, with a
reasoning trace in an earlier assistant turn (Qwen3 drops it), with and without the
generation prompt. The Rust test renders the same templates with the crate's template
engine and compares. Tested with transformers 5.24.

    python scripts/make_template_fixtures.py
"""

import json
import os

HERE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "templates")
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is 2+2?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "<think>\nsmall ones\n</think>\n\n7"},
        {"role": "user", "content": "Another,  please.\n"},
        {"role": "assistant", "content": "11"},
        {"role": "user", "content": "And one above 100?"},
    ],
}


def main() -> int:
    from transformers.utils.chat_template_utils import render_jinja_template

    cases = []
    # Each template with the special tokens its tokenizer gives it.
    for name, (bos, eos) in {
        "qwen2.5": ("", "<|im_end|>"),
        "qwen3": ("", "<|im_end|>"),
        "gemma3": ("<bos>", "<eos>"),
    }.items():
        template = open(os.path.join(HERE, f"{name}.jinja")).read()
        for conv, messages in CONVERSATIONS.items():
            for gen in [True, False]:
                rendered, _ = render_jinja_template(
                    conversations=[messages],
                    chat_template=template,
                    add_generation_prompt=gen,
                    bos_token=bos,
                    eos_token=eos,
                )
                cases.append(
                    {
                        "template": f"{name}.jinja",
                        "conversation": conv,
                        "messages": messages,
                        "add_generation_prompt": gen,
                        "bos_token": bos,
                        "eos_token": eos,
                        "rendered": rendered[0],
                    }
                )
    with open(os.path.join(HERE, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{len(cases)} cases")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
