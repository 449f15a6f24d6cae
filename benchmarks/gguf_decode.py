"""Real GGUF files on the CPU: decoderlm against llama.cpp on the very same file, decode and prefill.

The files: SmolLM2-135M-Instruct as shipped (`decoderlm.load("smollm2-135m-instruct")`: Q4_1
layers, a tied Q8_0 embedding and head) and Q8_0, BF16 and F32 files made from it by llama.cpp's
`llama-quantize --allow-requantize` (by decoderlm's `export_gguf` where llama.cpp is not given).
For each file:

- decoderlm: `decoderlm.load(file)` (the weights stay in their blocks; `--dtype bfloat16` runs
  the activations in bfloat16; `--matmul-precision medium`, torch's float32 matmul precision,
  lets a prefill's float32 products round x and the weights to bfloat16, as llama.cpp's BF16
  products do), `generate(..., compile=True)`: batch-1 decode tok/s after a prompt
  of 128 and of 2,048 tokens (N / the time of the N steps after the first token: the prefill is
  not timed, as llama-bench's `-d` prefill is not) and prefill-512 tok/s (512 / time to the first
  token);
- llama.cpp: `llama-bench -t T -p 0 -n N -d 128` (and `-d 2048`), `-p 512 -n 0`;
- logits error: max |logit − reference| over the 64 tokens of a text, the reference being the
  file's weights dequantized to float32 and run in float64; decoderlm's through its prefill path
  (the tokens as one batch: the integer panels on AVX-512 VNNI, else a GEMM on dequantized
  weights) and its decode path (one token at a time through the cache: the block kernels),
  llama.cpp's through `llama_logits.c` (one batch).

Both sides run --threads threads, one after the other, run by run interleaved; the ratios are
medians of per-run ratios. The CPU, its flags, the load average and the kernel each layer runs
are printed beside the tables. `--avx2` runs decoderlm as on a CPU without AVX-512 (in a child
process with DECODERLM_CPU_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and
MKL_ENABLE_INSTRUCTIONS=AVX2; llama.cpp runs as built). `--llama-build` names the build directory
of llama.cpp's checkout to run; for both sides as on an AVX2-only CPU, give `--avx2` a build of
ggml's AVX2 code alone (as a native build on such a CPU compiles it):

    cmake -S LLAMA -B LLAMA/build-avx2 -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF && \
        cmake --build LLAMA/build-avx2 --target llama-bench llama-quantize llama -j 2

`--quick`: the Q4_1 file, 16 new tokens, context 128, one run.

    HF_HUB_OFFLINE=1 python benchmarks/gguf_decode.py --llama-cpp LLAMA --threads 2 \
        [--avx2 [--llama-build build-avx2]]

(LLAMA: a llama.cpp checkout with build/bin/llama-bench, llama-quantize and libllama built, as
benchmarks/llama_cpp.py describes.)
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from decode import median_ratio
from llama_cpp import build_llama_logits, interleaved_runs, llama_bench, llama_logits
from torch import nn

import decoderlm
from decoderlm.cpu import bf16_linear, block_linear, features, gemv
from decoderlm.gguf import export_gguf
from decoderlm.inference.generate import decode_steps, evaluating, generate, next_logits
from decoderlm.inference.options import DecodeOptions, float_probe
from decoderlm.inference.sampling import SamplingParams
from decoderlm.loading import resolve_checkpoint
from decoderlm.model.cache import CacheStep, make_cache
from decoderlm.quant.blocks import BlockEmbedding, BlockLinear

MODEL = "smollm2-135m-instruct"
KINDS = ("Q4_1", "Q8_0", "BF16", "F32")
AVX2_ENV = {
    features.ISA_ENV: "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from winemaking. "
    "Within fifty years presses had spread to more than two hundred cities across Europe, and the "
    "number of books in circulation grew from thousands to millions, changing how ideas moved."
)


def gguf_files(llama_bin: Path | None, out: Path, kinds: list[str]) -> dict[str, Path]:
    """The shipped Q4_1 file and the others made from it, by llama-quantize where given."""
    source = resolve_checkpoint(MODEL)
    files = {}
    for kind in kinds:
        if kind == "Q4_1":
            files[kind] = source
            continue
        files[kind] = out / f"{MODEL}-{kind}.gguf"
        quantize = llama_bin / "llama-quantize" if llama_bin else None
        if quantize is not None and quantize.is_file():
            command = [str(quantize), "--allow-requantize", str(source), str(files[kind]), kind]
            subprocess.run(command, check=True, capture_output=True)
        else:
            model, tokenizer = decoderlm.load(source)
            export_gguf(model, tokenizer, files[kind], kind.lower())
    return files


def float_reference(model: nn.Module) -> nn.Module:
    """A copy of `model` whose block layers are plain float64 ones of the dequantized weights."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BlockLinear):
                plain = nn.Linear(
                    child.in_features, child.out_features, bias=child.bias is not None
                )
                plain.weight.data = child.dequantized()
                if child.bias is not None:
                    plain.bias.data = child.bias.float()
                setattr(parent, name, plain)
            elif isinstance(child, BlockEmbedding):
                setattr(parent, name, nn.Embedding.from_pretrained(child.weight.float()))
    if ref.config.tie_embeddings:
        ref.head.weight = ref.tok_emb.weight
    return ref.double()


def decode_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) of ids (T,) fed one token at a time through a cache (the decode path)."""
    cache = make_cache(model.config, 1, len(ids), float_probe(model).dtype, ids.device)
    rows = []
    for t in range(len(ids)):
        cache.seek(CacheStep(torch.tensor([t]), t + 1))
        positions = torch.tensor([[t]])
        rows.append(next_logits(model, cache.layers, ids[None, t : t + 1], positions, None)[0])
    return torch.stack(rows)


def logits_errors(
    model: nn.Module, reference_model: nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """(the reference logits (T, V) float64 of the file loaded in float32, decoderlm's errors on
    its two paths)."""
    with torch.inference_mode():
        reference = float_reference(reference_model)(ids[None])[0]
        prefill = model(ids[None])[0].double()
        decode = decode_logits(model, ids).double()
    errors = {"prefill path": (prefill - reference).abs().max(), "decode path": (decode - reference).abs().max()}  # fmt: skip
    return reference, {name: float(e) for name, e in errors.items()}


def many_rows_kernel(ggml_type: str, dtype: torch.dtype) -> str:
    """What a prefill's product (more than MAX_PANEL_ROWS rows) of `dtype` runs on `ggml_type`
    weights here."""
    if dtype == torch.bfloat16 and features.bf16_emulated():  # BlockLinear.matmul widens x
        return f"in float32: {many_rows_kernel(ggml_type, torch.float32)}"
    rounding = torch.get_float32_matmul_precision() == "medium"
    if dtype == torch.float32 and not rounding and block_linear.integer_panels(ggml_type):
        width = "int16" if ggml_type == "Q8_0" else "int8"
        return f"integer panels, {width} dot products, AVX-512 VNNI"
    if dtype == torch.float32 and rounding and "avx512_bf16" in bf16_linear.kernels():
        weights = "as stored" if ggml_type == "BF16" else "dequantized, rounded to bfloat16"
        return f"{weights}, x rounded to bfloat16, VDPBF16PS (bf16_linear.float32_linear)"
    return "dequantized, GEMM (oneDNN)"


def kernel_table(model: nn.Module) -> list[tuple[str, str, str, str]]:
    """(layers, weights, kernel for a few rows, for many) of each kind of weighted layer (the
    head of a prefill multiplies the last row only: a few rows)."""
    dtype = float_probe(model).dtype
    rows: dict[tuple[str, ...], None] = {}
    for name, module in model.named_modules():
        layers = re.sub(r"\.\d+\.", ".*.", name)
        if isinstance(module, BlockLinear):
            kind = module.ggml_type
            row = (layers, kind, block_linear.kernel_name(kind), many_rows_kernel(kind, dtype))
        elif isinstance(module, BlockEmbedding):
            row = (layers, module.ggml_type, "rows dequantized", "rows dequantized")
        elif type(module) is nn.Linear:
            weight = module.weight.dtype
            one_row = "gemv AVX-512" if gemv.available(torch.float32, weight) else "PyTorch"
            row = (layers, str(weight).removeprefix("torch."), one_row, "GEMM (oneDNN)")
        else:
            continue
        rows[row] = None
    return list(rows)


def ours_fns(model: nn.Module, n: int, contexts: list[int], prefill: int) -> dict[str, Callable]:
    """Timed calls: decode at each context (returning its tokens/s), prefill."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    fns = {}
    for c in contexts:
        prompt = torch.randint(0, vocab, (1, c), generator=g)
        fns[f"decode {c}"] = lambda p=prompt: decode_rate(model, p, n)
    long = torch.randint(0, vocab, (1, prefill), generator=g)
    fns["prefill"] = lambda: generate(model, long, 1, temperature=0, compile=True)
    return fns


def decode_rate(model: nn.Module, prompt: torch.Tensor, n: int) -> float:
    """Tokens a second of n greedy decode steps of `generate(..., compile=True)`, timed from the
    prompt's first token on (its prefill is not timed: a difference of two calls' times, each
    with a 2,048-token prefill, moved by half with the prefill's noise)."""
    options = DecodeOptions.of(compile=True)
    with evaluating(model), options.paths.applied(model):
        steps = decode_steps(model, prompt.tolist(), n + 1, SamplingParams(temperature=0), None, options)  # fmt: skip
        next(steps)  # the prefill and the first token
        start = time.perf_counter()
        for _ in steps:
            pass
        return n / (time.perf_counter() - start)


def theirs_fns(bench: Path, path: Path, threads: int, n: int, contexts: list[int], prefill: int):
    fns = {
        f"decode {c}": lambda c=c: llama_bench(
            bench, path, threads, ["-p", "0", "-n", str(n), "-d", str(c)]
        )
        for c in contexts
    }
    fns["prefill"] = lambda: llama_bench(bench, path, threads, ["-p", str(prefill), "-n", "0"])
    return fns


def measure(
    args: argparse.Namespace,
    kind: str,
    path: Path,
    llama_bin: Path | None,
    logits_binary: Path | None,
) -> dict:
    """Speeds (lists over runs) and logits errors of both sides on one file."""
    torch._dynamo.reset()  # the compiled prefill's graphs of the files before: under the limit
    model, tokenizer = decoderlm.load(path, dtype=getattr(torch, args.dtype))
    ids = torch.tensor(tokenizer.encode(TEXT)[:64])
    reference, errors = logits_errors(model, decoderlm.load(path)[0], ids)
    bench = llama_bin / "llama-bench" if llama_bin else None
    if logits_binary is not None:
        theirs = llama_logits(logits_binary, path, args.threads, ids).double()
        errors["llama.cpp"] = float((theirs - reference).abs().max())
    n, contexts, prefill = args.new_tokens, args.contexts, args.prefill_tokens
    fns = {f"ours {k}": fn for k, fn in ours_fns(model, n, contexts, prefill).items()}
    if bench is not None:
        fns |= {f"llama.cpp {k}": fn for k, fn in theirs_fns(bench, path, args.threads, n, contexts, prefill).items()}  # fmt: skip
    results = interleaved_runs(fns, args.runs)
    speeds = {}
    for c in contexts:
        speeds[f"ours decode {c}"] = results[f"ours decode {c}"]
    speeds["ours prefill"] = [prefill / t for t in results["ours prefill"]]
    speeds |= {k: v for k, v in results.items() if k.startswith("llama.cpp")}
    return {"speeds": speeds, "errors": errors, "kernels": kernel_table(model)}


def report(args: argparse.Namespace, measured: dict[str, dict], load: float) -> None:
    flags = features.cpu_flags()
    print(f"CPU: {features.cpu_name()}; flags: {' '.join(f for f in FLAGS if f in flags)}")
    cap = features.isa_cap()
    print(
        f"{args.threads} threads, torch {torch.__version__}, decoderlm activations {args.dtype}, "
        f"float32 matmul precision {args.matmul_precision}, "
        f"load average {load:.2f} before / {os.getloadavg()[0]:.2f} after"
        + (f", kernels capped at {cap} ({AVX2_ENV})" if cap else "")
    )
    if args.llama_cpp:
        print(f"llama.cpp: {args.llama_cpp / args.llama_build}")
    print(f"{MODEL}; decode {args.new_tokens} tokens; median of {args.runs} runs (tok/s)")
    contexts = args.contexts
    head = [f"decode @{c}" for c in contexts] + ["prefill-512" if args.prefill_tokens == 512 else f"prefill-{args.prefill_tokens}"]  # fmt: skip
    print("| file | engine | " + " | ".join(head) + " | logits err (prefill / decode path) |")
    print("|---|---|" + "---|" * (len(head) + 1))
    for kind, m in measured.items():
        s, e = m["speeds"], m["errors"]
        for side in ("ours", "llama.cpp"):
            keys = [f"{side} decode {c}" for c in contexts] + [f"{side} prefill"]
            if keys[0] not in s:
                continue
            cells = [f"{statistics.median(s[k]):.1f}" for k in keys]
            err = (
                f"{e['prefill path']:.2e} / {e['decode path']:.2e}"
                if side == "ours"
                else (f"{e['llama.cpp']:.2e}" if "llama.cpp" in e else "—")
            )
            engine = "decoderlm" if side == "ours" else "llama.cpp"
            print(f"| {kind} | {engine} | " + " | ".join(cells) + f" | {err} |")
        if "llama.cpp prefill" in s:
            ratios = [
                f"{k.removeprefix('ours ')} {median_ratio(s[k], s['llama.cpp' + k[4:]]):.2f}×"
                for k in [f"ours decode {c}" for c in contexts] + ["ours prefill"]
            ]
            print(f"|  | ours ÷ llama.cpp | {' | '.join(ratios)} |  |")
    print("\nkernels (decoderlm):")
    print("| layers | weights | a few rows (decode) | many rows (prefill) |\n|---|---|---|---|")
    seen = set()
    for m in measured.values():
        for row in m["kernels"]:
            if row not in seen:
                seen.add(row)
                print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp checkout, built")
    parser.add_argument(
        "--llama-build", default="build", help="its build directory (default: build)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--matmul-precision", choices=["highest", "high", "medium"], default="highest"
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="Q4_1, 16 tokens, context 128, 1 run")
    parser.add_argument("--avx2", action="store_true", help="decoderlm as on an AVX2-only CPU")
    args = parser.parse_args()
    if args.avx2 and features.isa_cap() is None:  # again, in a child process under the cap
        argv = [a for a in sys.argv if a != "--avx2"]
        env = {**os.environ, **AVX2_ENV, "HF_HUB_OFFLINE": "1"}
        sys.exit(subprocess.run([sys.executable, *argv], env=env).returncode)
    if args.quick:
        args.kinds, args.new_tokens, args.contexts, args.runs = ["Q4_1"], 16, [128], 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)
    load = os.getloadavg()[0]
    llama_bin = args.llama_cpp / args.llama_build / "bin" if args.llama_cpp else None
    with tempfile.TemporaryDirectory(prefix="gguf-decode-") as tmp:
        files = gguf_files(llama_bin, Path(tmp), args.kinds)
        binary = (
            build_llama_logits(args.llama_cpp, Path(tmp), args.llama_build)
            if args.llama_cpp
            else None
        )
        measured = {
            kind: measure(args, kind, path, llama_bin, binary) for kind, path in files.items()
        }
    report(args, measured, load)


if __name__ == "__main__":
    main()
