"""The anchor for CPU decoding: llama.cpp against decoderlm on the same weights, measured in one run.

The "llama-55m" model of `decode.py` (random init, seed 0) is written as a Hugging Face Llama
directory (`decoderlm.hf.to_hf`, with a Llama-style byte-fallback BPE tokenizer of 32000 tokens:
3 specials, 256 byte tokens, the rest single CJK characters) and converted to GGUF by llama.cpp's
own `convert_hf_to_gguf.py` at f32, bf16 and q8_0. llama.cpp's `llama-bench` times decoding
(`-p 0 -n N`: N tokens generated one at a time) and prefill (`-p 512 -n 0`); decoderlm's
`generate` is timed on the same shapes as in `decode.py` (N / (t(N + 1) − t(1)), 16-token prompt;
prefill: 512 / time to the first token), compiled, in fp32, bf16, with bf16 weights under fp32
activations (`quantize(to="bf16")`: what llama.cpp's bf16 file stores, but its products round the
activations to bf16 as well) and with int8 weight-only quantization (`decoderlm.quant`,
per-output-channel scales, as Q8_0 but one scale per row rather than per 32 weights). Both use
--threads threads, one after the other (never at once), run by run
interleaved so that both see the same spells of a shared CPU; ratios are medians of per-run ratios.
"logits err" is each side's max |logit − decoderlm's fp32 logit| over one 64-token sequence,
decoded as one batch: decoderlm's forward, and llama.cpp's through `llama_logits.c` (built here against the
checkout's libllama), so the two engines' rounding is compared on the same weights and tokens.

llama.cpp is not a dependency: build `llama-bench` from a llama.cpp checkout (the `llama-cpp-python`
source package vendors one under vendor/llama.cpp: `pip download llama-cpp-python --no-deps
--no-binary :all:`), `pip install sentencepiece` (its converter imports it), and pass its directory:

    cmake -S LLAMA -B LLAMA/build -G Ninja -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && \
        cmake --build LLAMA/build --target llama-bench -j 2

Where the native build's Q8_0 prefill dies of SIGILL (seen on a Sapphire Rapids VM, in ggml's
AMX int8 path), build without AMX instead:
-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF.
    HF_HUB_OFFLINE=1 python benchmarks/llama_cpp.py --llama-cpp LLAMA --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode import build_models, median_ratio, per_token

from decoderlm import DecoderLM
from decoderlm.cpu.features import cpu_name
from decoderlm.inference.generate import generate
from decoderlm.quant import quantize

GGUF_TYPES = ("f32", "bf16", "q8_0")


def llama_tokenizer_files(directory: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json of a Llama-2-style BPE tokenizer (byte fallback,
    "▁" for spaces), the kind llama.cpp's converter reads as a "llama" vocabulary."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    rest = vocab_size - len(specials) - len(byte_tokens)
    characters = [chr(0x4E00 + i) for i in range(rest - 1)]
    vocab = {t: i for i, t in enumerate([*specials, *byte_tokens, "▁", *characters])}
    tokenizer = Tokenizer(BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def gguf_files(theirs: torch.nn.Module, llama_cpp: Path, out: Path) -> dict[str, Path]:
    """The HF model as GGUF files, one per type in GGUF_TYPES, by llama.cpp's converter."""
    hf_dir = out / "hf"
    theirs.to(torch.float32).save_pretrained(hf_dir, safe_serialization=True)
    llama_tokenizer_files(hf_dir, theirs.config.vocab_size)
    files = {}
    for kind in GGUF_TYPES:
        files[kind] = out / f"model-{kind}.gguf"
        convert = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_dir)]
        subprocess.run(
            [*convert, "--outtype", kind, "--outfile", str(files[kind])],
            check=True,
            capture_output=True,
        )
    return files


def build_llama_logits(llama_cpp: Path, out: Path, build: str = "build") -> Path:
    """`llama_logits.c` compiled against the checkout's llama.h and `build`/bin/libllama.so."""
    binary, lib = out / "llama-logits", llama_cpp / build / "bin"
    includes = ["-I", str(llama_cpp / "include"), "-I", str(llama_cpp / "ggml" / "include")]
    source = Path(__file__).with_name("llama_logits.c")
    link = ["-L", str(lib), "-lllama", f"-Wl,-rpath,{lib}"]
    subprocess.run(
        [os.environ.get("CC", "cc"), "-O2", *includes, str(source), *link, "-o", str(binary)],
        check=True,
    )
    return binary


def llama_logits(binary: Path, model: Path, threads: int, ids: torch.Tensor) -> torch.Tensor:
    """llama.cpp's logits (T, V) in float32 for the token ids (T,), decoded as one batch."""
    text = " ".join(map(str, ids.tolist()))
    cmd = [str(binary), str(model), str(threads)]
    result = subprocess.run(cmd, input=text.encode(), check=True, capture_output=True)
    return torch.frombuffer(bytearray(result.stdout), dtype=torch.float32).view(len(ids), -1)


def llama_bench(binary: Path, model: Path, threads: int, args: list[str]) -> float:
    """llama-bench's tokens/s of one repetition of one test (`-p/-n` in args)."""
    cmd = [str(binary), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json"]
    result = subprocess.run([*cmd, *args], check=True, capture_output=True, text=True)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def interleaved_runs(fns: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    """Every fn once (a warm-up: compiles ours, maps llama.cpp's files), then `runs` rounds of
    every fn in turn: what it returns where that is a number (llama-bench's own tokens/s, a rate
    ours measures itself), else the seconds it took."""
    results: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            value = fn()
            elapsed = time.perf_counter() - start
            results[name].append(value if isinstance(value, float) else elapsed)
    return results


def ours_variants(model: DecoderLM) -> dict[str, DecoderLM]:
    return {
        "fp32": model,
        "bf16": copy.deepcopy(model).to(torch.bfloat16),
        "bf16 weights, fp32 activations": quantize(copy.deepcopy(model), to="bf16"),
        "int8 weights, fp32 activations": quantize(copy.deepcopy(model), to="int8"),
        "int8 weights, bf16 activations": quantize(copy.deepcopy(model), to="int8").to(
            torch.bfloat16
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    bench = args.llama_cpp / "build" / "bin" / "llama-bench"
    if not bench.is_file():
        sys.exit(f"{bench} not found: build llama-bench first (see this script's docstring)")
    ours, theirs = build_models("llama-55m")
    n, p = args.new_tokens, args.prefill_tokens
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ours.config.vocab_size, (1, 16), generator=g)
    long_prompt = torch.randint(0, ours.config.vocab_size, (1, p), generator=g)
    check = torch.randint(0, ours.config.vocab_size, (1, 64), generator=g)
    with torch.inference_mode():
        reference = ours(check).double()
    variants = ours_variants(ours)
    errors = {}
    for name, model in variants.items():
        with torch.inference_mode():
            errors[name] = float((model(check).double() - reference).abs().max())

    with tempfile.TemporaryDirectory(prefix="llama-cpp-") as tmp:
        files = gguf_files(theirs, args.llama_cpp, Path(tmp))
        logits_binary = build_llama_logits(args.llama_cpp, Path(tmp))
        for kind, path in files.items():
            theirs_logits = llama_logits(logits_binary, path, args.threads, check[0])
            errors[f"llama.cpp {kind}"] = float((theirs_logits.double() - reference[0]).abs().max())
        fns: dict[str, Callable[[], object]] = {}
        for kind, path in files.items():
            for test, flags in (("decode", ["-p", "0", "-n", str(n)]), ("prefill", ["-p", str(p), "-n", "0"])):  # fmt: skip
                fns[f"llama.cpp {kind} {test}"] = lambda path=path, flags=flags: llama_bench(
                    bench, path, args.threads, flags
                )
        for name, model in variants.items():
            for key, x, k in (("1", prompt, 1), ("n", prompt, n + 1), ("prefill", long_prompt, 1)):
                fns[f"{name}_{key}"] = lambda m=model, x=x, k=k: generate(
                    m, x, k, temperature=0, compile=True
                )
        results = interleaved_runs(fns, args.runs)

    speeds = {f"llama.cpp {k}": results[f"llama.cpp {k} decode"] for k in GGUF_TYPES}
    prefills = {f"llama.cpp {k}": results[f"llama.cpp {k} prefill"] for k in GGUF_TYPES}
    for name in variants:
        speeds[name] = per_token(results, name, n)
        prefills[name] = [p / t for t in results[f"{name}_prefill"]]
    print(f"CPU: {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print(f"llama-55m, batch 1: decode {n} tokens, prefill {p}; median of {args.runs} runs")
    print("| engine | weights | decode tok/s | prefill tok/s | logits err |")
    print("|---|---|---|---|---|")
    for name in speeds:
        engine, kind = name.split(" ", 1) if name.startswith("llama.cpp") else ("decoderlm", name)
        err = f"{errors[name]:.2e}" if name in errors else "—"
        print(
            f"| {engine} | {kind} | {statistics.median(speeds[name]):.1f} | "
            f"{statistics.median(prefills[name]):.0f} | {err} |"
        )
    pairs = [
        ("fp32", "llama.cpp f32"),
        ("bf16", "llama.cpp bf16"),
        ("bf16 weights, fp32 activations", "llama.cpp bf16"),
        ("int8 weights, fp32 activations", "llama.cpp q8_0"),
        ("int8 weights, bf16 activations", "llama.cpp q8_0"),
    ]
    for ours_name, theirs_name in pairs:
        print(
            f"decoderlm {ours_name} / {theirs_name}: decode "
            f"{median_ratio(speeds[ours_name], speeds[theirs_name]):.2f}×, prefill "
            f"{median_ratio(prefills[ours_name], prefills[theirs_name]):.2f}× (median of per-run ratios)"
        )


if __name__ == "__main__":
    main()
