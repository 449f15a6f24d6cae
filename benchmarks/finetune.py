"""Fine-tuning SmolLM2-135M-Instruct on chat data: tokens/s and peak memory of full fine-tuning and
LoRA, decoderlm against transformers (+ peft for LoRA), on the same batches.

Every case runs in a fresh process: load the model, draw the same padded batches of conversations
(the demo's, `benchmarks/finetune_demo.py`, rendered and masked by `decoderlm.data.chat`), train
`--steps` AdamW steps on the assistant tokens, and report

- tokens/s: real (unpadded) tokens per second over the steps after the first (which warms up);
- peak memory: the process's peak resident set while training (Linux's VmHWM, reset after loading
  by writing 5 to /proc/self/clear_refs), and its resident set before training.

The cases: decoderlm full (float32 weights dequantized from the GGUF file), decoderlm LoRA (the
Q4_1 blocks kept, adapters in float32: QLoRA), transformers full and transformers + peft LoRA
(the same float32 weights, from `decoderlm convert --to-hf` of the dequantized model). LoRA: rank
8, α 16, on the attention and MLP projections (peft: q/k/v/o/gate/up/down_proj) in both.

    python benchmarks/finetune.py            # 8 steps of 8 conversations per case
    python benchmarks/finetune.py --quick    # 3 steps of 4

peft is not a dependency of decoderlm: `pip install peft` for the transformers LoRA case (it is
skipped, saying so, without it). Speed figures need a quiet machine; peak memory does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from decoderlm.cpu.features import cpu_name

CASES = ("decoderlm-full", "decoderlm-lora", "transformers-full", "transformers-peft-lora")
MODEL = "smollm2-135m-instruct"
RANK, ALPHA, LR = 8, 16, 1e-4


def peak_reset() -> int:
    """Reset the process's peak RSS (Linux) and return the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def batches(work: Path, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` padded (x, y) batches of the demo's conversations, y = −100 where not trained."""
    sys.path.insert(0, str(Path(__file__).parent))
    from finetune_demo import conversations, write_jsonl

    from decoderlm.data.chat import load_chat_split, prepare_chat
    from decoderlm.data.chat_batches import ChatBatches
    from decoderlm.training.run_data import chat_files

    write_jsonl(work / "chat.jsonl", conversations(400, seed=0, held_out=False))
    tokenizer, template, config = chat_files(MODEL)
    prepare_chat(work / "chat.jsonl", work / "data", tokenizer, template, 128, 0.05, config)
    sampler = ChatBatches(load_chat_split(work / "data", "train"), batch, 1, 0, pad_id=2)
    return [sampler.next_batch() for _ in range(steps)]


def model_for(case: str, work: Path) -> torch.nn.Module:
    """The case's model, ready to train (LoRA applied, the rest frozen)."""
    if case.startswith("decoderlm"):
        import decoderlm
        from decoderlm import DecoderLM
        from decoderlm.cpu.paths import SpeedPaths
        from decoderlm.lora import apply_lora, merged_state_dict

        model, _ = decoderlm.load(MODEL)  # Q4_1 blocks
        if case == "decoderlm-full":
            plain = DecoderLM(model.config)
            plain.load_state_dict(merged_state_dict(model))
            model = plain
        else:
            apply_lora(model, RANK, ALPHA)
        SpeedPaths.for_training().apply(model)
        return model.train()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)
    if case == "transformers-peft-lora":
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    return model.train()


def run_case(case: str, work: Path, batch: int, steps: int) -> dict:
    """Train `steps` steps of `case` in this process; its figures."""
    data = batches(work, batch, steps)
    model = model_for(case, work)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    rss_before = peak_reset()
    times, tokens = [], []
    for x, y in data:
        start = time.perf_counter()
        logits = model(x) if case.startswith("decoderlm") else model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        tokens.append(_real_tokens(x))
    return {
        "case": case,
        "trainable_parameters": sum(p.numel() for p in params),
        "tokens_per_s": sum(tokens[1:]) / sum(times[1:]),
        "peak_rss_training_bytes": _status("VmHWM"),
        "rss_before_training_bytes": rss_before,
        "last_loss": float(loss),
        "threads": torch.get_num_threads(),
    }


def _real_tokens(x: torch.Tensor, pad: int = 2) -> int:
    """Tokens of a right-padded batch (B, T) that are not padding: a conversation ends in "\n"
    after its last <|im_end|> (id 2, the padding), so the padding is each row's trailing 2s."""
    real = (x != pad).flip(-1).cumsum(-1).flip(-1) > 0  # True up to each row's last non-pad
    return int(real.sum())


def hf_dir(work: Path) -> None:
    """work/hf: the GGUF model's weights dequantized, as a Hugging Face directory."""
    import decoderlm
    from decoderlm import DecoderLM, checkpoint
    from decoderlm.hf import export_hf
    from decoderlm.lora import merged_state_dict

    model, tokenizer = decoderlm.load(MODEL)
    plain = DecoderLM(model.config)
    plain.load_state_dict(merged_state_dict(model))
    checkpoint.save_model(work / "run", plain, tokenizer)
    export_hf(work / "run", work / "hf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 steps of 4 conversations")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch = 3, 4
    if args.case:
        print(json.dumps(run_case(args.case, args.work, args.batch, args.steps)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf_dir(work)
        print(
            f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load average "
            f"{os.getloadavg()[0]:.1f}; {args.steps} steps of {args.batch} conversations"
        )
        for case in CASES:
            if case.endswith("peft-lora") and not _has("peft"):
                print(f"{case}: skipped (pip install peft)")
                continue
            cmd = [sys.executable, __file__, "--case", case, "--work", str(work)]
            cmd += ["--steps", str(args.steps), "--batch", str(args.batch)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"{case:<24} {r['tokens_per_s']:8.0f} tokens/s  peak RSS while training "
                f"{r['peak_rss_training_bytes'] / 2**20:7.0f} MiB (before: "
                f"{r['rss_before_training_bytes'] / 2**20:.0f} MiB)  trainable "
                f"{r['trainable_parameters'] / 1e6:.2f}M  loss {r['last_loss']:.3f}"
            )


def _has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


if __name__ == "__main__":
    main()
