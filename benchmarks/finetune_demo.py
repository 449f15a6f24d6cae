"""Teach SmolLM2-135M-Instruct a format it does not follow, with LoRA on this CPU, and measure it.

The format: every reply is one JSON object, `{"answer": "…"}`, and nothing else. The script writes
a few hundred conversations of that shape (arithmetic, comparisons, capital letters, capitals of
countries; several phrasings each) to OUT/chat.jsonl and a held-out set of new items to
OUT/test.jsonl, then

1. measures the base model on the held-out prompts: greedy replies of up to 32 tokens
   (`decoderlm.generate`, ended at the chat template's end-of-turn token `<|im_end|>`; the text is
   also cut there; the file's Q4_1 weights dequantized to float32 for speed), the share whose
   whole reply is exactly that JSON shape (`FORMAT`), and the share whose answer is right;
2. fine-tunes it: `decoderlm train --init-from smollm2-135m-instruct --data OUT/chat.jsonl
   --lora-rank R …` (LoRA over the file's Q4_1 blocks, which stay quantized), timed;
3. measures the fine-tuned run (the merged float model) the same way;
4. exports it, `decoderlm convert --to-gguf RUN --type f32`, and loads the file in transformers:
   the largest difference of its logits from the run's on a held-out conversation.

    python benchmarks/finetune_demo.py --out runs/finetune-demo            # the recipe below
    python benchmarks/finetune_demo.py --out /tmp/demo --quick             # a smaller check

The figures, the command and the machine go to OUT/demo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import decoderlm
from decoderlm import DecoderLM
from decoderlm.chat_template import load_chat_template
from decoderlm.lora import merged_state_dict
from decoderlm.quant import quantization_of

MODEL = "smollm2-135m-instruct"
FORMAT = re.compile(r'\{"answer": "[^"\n]*"\}')  # the whole reply, nothing around it
END_OF_TURN = "<|im_end|>"
# The recipe: LoRA rank 8 on every projection, 60 steps of 8 conversations at lr 2e-3.
RECIPE = [
    *("--lora-rank", "8", "--lora-alpha", "16", "--batch-size", "8", "--max-steps", "60"),
    *("--lr", "2e-3", "--min-lr", "2e-4", "--warmup-steps", "6", "--weight-decay", "0"),
    *("--context-length", "128", "--eval-interval", "20", "--eval-iters", "1"),
    *("--checkpoint-interval", "0", "--sample-tokens", "24", "--temperature", "0"),
    *("--dtype", "fp32", "--peak-flops", "1e12", "--seed", "0"),
]

COUNTRIES = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Sweden": "Stockholm", "Greece": "Athens", "Poland": "Warsaw", "Portugal": "Lisbon",
    "Ireland": "Dublin", "Austria": "Vienna", "Chile": "Santiago", "Cuba": "Havana",
    "Thailand": "Bangkok", "Russia": "Moscow", "China": "Beijing", "India": "New Delhi",
    "Mexico": "Mexico City", "Argentina": "Buenos Aires", "Turkey": "Ankara", "Iran": "Tehran",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Belgium": "Brussels", "Hungary": "Budapest",
}  # fmt: skip
WORDS = [
    "apple",
    "river",
    "garden",
    "window",
    "silver",
    "planet",
    "orange",
    "market",
    "pencil",
    "rabbit",
    "castle",
    "dragon",
    "forest",
    "winter",
    "summer",
    "yellow",
    "purple",
    "bottle",
    "camera",
    "guitar",
    "jacket",
    "ladder",
    "mirror",
    "needle",
    "pillow",
    "rocket",
    "saddle",
    "tomato",
    "violin",
    "wallet",
    "anchor",
    "basket",
    "candle",
    "dinner",
    "engine",
    "feather",
    "harbor",
    "island",
    "jungle",
]


def question(rng: random.Random, held_out: bool) -> tuple[str, str]:
    """(a user's request, its answer); `held_out` items (numbers ≥ 50, the second half of the
    word and country lists) never occur in training."""
    lo, hi = (50, 99) if held_out else (2, 49)
    names = sorted(COUNTRIES)
    countries = names[len(names) // 2 :] if held_out else names[: len(names) // 2]
    words = WORDS[len(WORDS) // 2 :] if held_out else WORDS[: len(WORDS) // 2]
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        text = rng.choice(["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}."])
        return text.format(a=a, b=b), str(a + b)
    if kind == 1:
        a, b = rng.sample(range(lo, hi + 1), 2)
        text = rng.choice(["Which is larger, {a} or {b}?", "What is the maximum of {a} and {b}?"])
        return text.format(a=a, b=b), str(max(a, b))
    if kind == 2:
        word = rng.choice(words)
        text = rng.choice(["Write '{w}' in capital letters.", "Uppercase the word {w}."])
        return text.format(w=word), word.upper()
    country = rng.choice(countries)
    text = rng.choice(["What is the capital of {c}?", "Name the capital city of {c}."])
    return text.format(c=country), COUNTRIES[country]


def conversations(n: int, seed: int, held_out: bool) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        user, answer = question(rng, held_out)
        reply = json.dumps({"answer": answer})
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": reply}]})  # fmt: skip
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def measure(checkpoint: str | Path, tests: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Greedy replies to the held-out prompts: the share in FORMAT, the share answered right."""
    model, tokenizer = decoderlm.load(checkpoint)
    if quantization_of(model) is not None:  # decoded in float32: the same weights, faster here
        plain = DecoderLM(model.config)
        plain.load_state_dict(merged_state_dict(model))
        model = plain.eval()
    template = load_chat_template(decoderlm.loading.resolve_checkpoint(checkpoint))
    end = tokenizer.backend.token_to_id(END_OF_TURN)
    prompts = [
        tokenizer.encode(template.render(row["messages"][:1], add_generation_prompt=True))
        for row in tests
    ]
    replies = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        rows = decoderlm.generate(model, chunk, 32, temperature=0, eos_id=end)
        replies += [tokenizer.decode(r[len(p) :]) for r, p in zip(rows, chunk, strict=True)]
    replies = [r.split(END_OF_TURN)[0].strip() for r in replies]
    formatted = [FORMAT.fullmatch(r) is not None for r in replies]
    right = [
        ok and json.loads(r)["answer"] == json.loads(row["messages"][1]["content"])["answer"]
        for ok, r, row in zip(formatted, replies, tests, strict=True)
    ]
    return {
        "format_exact_match": sum(formatted) / len(tests),
        "answer_accuracy": sum(right) / len(tests),
        "examples": replies[:5],
    }


def gguf_check(run: Path, out: Path, tests: list[dict[str, Any]]) -> dict[str, Any]:
    """`decoderlm convert --to-gguf RUN --type f32`, loaded by transformers: the largest logit
    difference from the run's own on a held-out prompt, both sides in float32 (their sums'
    orders differ: ~1e-4 on logits of tens) and in float64 (~2e-5: transformers computes its RoPE
    frequencies in float32, 7e-8 from the float64 ones)."""
    from transformers import AutoModelForCausalLM

    gguf = out / "tuned.f32.gguf"
    command = ["decoderlm", "convert", "--to-gguf", str(run), "--out", str(gguf), "--type", "f32"]
    subprocess.run([sys.executable, "-m", *command, "--force"], check=True)
    model, tokenizer = decoderlm.load(run)
    template = load_chat_template(run)
    ids = tokenizer.encode(template.render(tests[0]["messages"], add_generation_prompt=False))
    theirs = AutoModelForCausalLM.from_pretrained(str(out), gguf_file=gguf.name).eval()
    x = torch.tensor([ids])
    diffs = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            mine, other = model.to(dtype), theirs.to(dtype)
            diffs[str(dtype)] = (mine(x) - other(input_ids=x).logits).abs().max().item()
    return {
        "command": " ".join(command),
        "transformers_max_logit_diff": diffs["torch.float32"],
        "transformers_max_logit_diff_float64": diffs["torch.float64"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=400, help="conversations to train on")
    parser.add_argument("--test", type=int, default=40, help="held-out prompts measured")
    parser.add_argument("--quick", action="store_true", help="20 steps, 20 prompts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    recipe = list(RECIPE)
    if args.quick:
        recipe[recipe.index("--max-steps") + 1] = "20"
        args.test = 20
    write_jsonl(args.out / "chat.jsonl", conversations(args.train, seed=0, held_out=False))
    tests = conversations(args.test, seed=1, held_out=True)
    write_jsonl(args.out / "test.jsonl", tests)

    before = measure(MODEL, tests, batch=20)
    print(
        f"base: format {before['format_exact_match']:.0%}, answers {before['answer_accuracy']:.0%}"
    )
    run = args.out / "run"
    command = [
        *("decoderlm", "train", "--init-from", MODEL, "--data", str(args.out / "chat.jsonl")),
        *("--out", str(run), "--overwrite", *recipe),
    ]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", *command], check=True)
    minutes = (time.perf_counter() - start) / 60
    after = measure(run, tests, batch=20)
    print(
        f"tuned: format {after['format_exact_match']:.0%}, answers {after['answer_accuracy']:.0%}"
    )
    exported = gguf_check(run, args.out, tests)
    print(f"GGUF f32 in transformers: max |Δlogit| {exported['transformers_max_logit_diff']:.2e} "
          f"in float32, {exported['transformers_max_logit_diff_float64']:.2e} in float64")  # fmt: skip
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "command": " ".join(command),
        "train_minutes": minutes,
        "before": before,
        "after": after,
        "gguf": exported,
        "metrics": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
    }
    (args.out / "demo.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"training took {minutes:.1f} min; wrote {args.out / 'demo.json'}")


if __name__ == "__main__":
    main()
