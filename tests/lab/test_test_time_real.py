"""The real-model test-time study at micro scale, on a tiny random model written as a Q4_1 GGUF
file with a chat template (the study's path for SmolLM2): every strategy runs at every N on every
problem; the pooled strategies at one N spend the same tokens and a guided search never more;
pass@N is their ceiling; the report shows results.json's numbers. And its parts: the dequantized
model computes what the quantized one does, the paired comparison calls a difference only when
its interval excludes 0, and the quick spec and the command refuse what they should."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from decoderlm import DecoderLM, ModelConfig
from decoderlm.cli import main
from decoderlm.gguf.writer import export_gguf
from decoderlm.lab import test_time_real, test_time_real_report
from decoderlm.loading import load
from decoderlm.quant.blocks import BlockLinear
from decoderlm.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n'"
    " }}{% endif %}"
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (Q4_1 blocks) whose tokenizer spells the word problems."""
    text = "Tom has 12 apples and buys 3 more. How many? 12 + 3 = 15\nanswer: 15\n" * 30
    tokenizer = Tokenizer.train_bpe([text], vocab_size=320)
    torch.manual_seed(0)
    config = ModelConfig.from_preset(
        "llama-tiny", vocab_size=tokenizer.vocab_size, context_length=512, d_model=32,
        n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, tie_embeddings=True,  # as SmolLM2
    )  # fmt: skip
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return export_gguf(DecoderLM(config).eval(), tokenizer, path, "q4_1", chat_template=CHATML)


def micro_spec(model: Path) -> test_time_real.TestTimeRealSpec:
    return test_time_real.TestTimeRealSpec(
        model=str(model), dtype="float32", screen_problems=2, problems=3, samples=4,
        ns=(1, 2, 4), step_ns=(2, 4), max_tokens=6, verifier_problems=10, verifier_samples=2,
        verifier_layers=(1, 2), head_steps=5, step_tokens=3, expand=2, concurrency=2,
        bootstrap=50,
    )  # fmt: skip


@pytest.fixture(scope="module")
def study(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ttc-real")
    results = test_time_real.run_study(micro_spec(tiny_gguf), out, progress=False)
    test_time_real_report.write_report(results, out)
    return out, results


def runs_of(results: dict, strategy: str, n: int) -> list[dict]:
    found = [r for r in results["runs"] if r["strategy"] == strategy and r["n"] == n]
    return sorted(found, key=lambda r: r["problem"])


def test_every_strategy_runs_at_every_n_on_every_problem(study) -> None:
    _, results = study
    spec = micro_spec(Path("m"))
    for name in test_time_real.STRATEGIES:
        ns = (
            (1,) if name == "greedy" else spec.step_ns if name in test_time_real.GUIDED else spec.ns
        )
        for n in ns:
            assert [r["problem"] for r in runs_of(results, name, n)] == [0, 1, 2], (name, n)
            runs = spec.samples // n if name in test_time_real.POOLED else 1  # the N-groups
            for r in runs_of(results, name, n):  # a share of its runs
                assert r["correct"] * runs == pytest.approx(round(r["correct"] * runs))


def test_guided_searches_never_get_more_tokens_than_the_pooled_strategies_at_their_n(study) -> None:
    _, results = study
    for n in micro_spec(Path("m")).ns:
        tokens = {name: [r["tokens"] for r in runs_of(results, name, n)]
                  for name in test_time_real.POOLED}  # fmt: skip
        assert len({tuple(t) for t in tokens.values()}) == 1  # the same samples: the same tokens
        assert max(tokens["self-consistency"]) <= n * 6  # N samples of ≤ max_tokens
        for name in test_time_real.GUIDED:
            for guided, pooled in zip(runs_of(results, name, n), tokens["self-consistency"],
                                      strict=False):  # fmt: skip
                assert guided["tokens"] <= pooled  # the budget: the N-groups' mean spend
        ceiling = runs_of(results, "pass@N (oracle)", n)
        for name in test_time_real.POOLED:
            assert all(r["correct"] <= c["correct"]
                       for r, c in zip(runs_of(results, name, n), ceiling, strict=True))  # fmt: skip


def test_the_report_shows_results_json_and_its_plots(study) -> None:
    out, results = study
    report = (out / "report.md").read_text()
    assert json.loads((out / "results.json").read_text())["summary"] == results["summary"]
    cell = results["summary"]["best-of-N (verifier)"]["2"]
    assert (
        f"{cell['accuracy']:.0%} [{cell['low']:.0%}, {cell['high']:.0%}] ({cell['tokens']:.0f})"
        in (report)
    )
    assert f"date: {results['date']}" in report and "git commit" in report
    assert str(out) not in report and "/tmp" not in report  # no machine paths
    assert [r["task"] for r in results["screen"]] == list(test_time_real.CANDIDATES)
    assert results["verifier"]["layer"] in (1, 2)
    for name in ("accuracy_vs_tokens.png", "task_screen.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_the_dequantized_model_computes_what_the_quantized_one_does(tiny_gguf: Path) -> None:
    quantized, _ = load(tiny_gguf)
    assert any(isinstance(m, BlockLinear) for m in quantized.modules())
    ids = torch.randint(0, quantized.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = quantized(ids)
        floats = test_time_real.dequantized(quantized, "float32")
        assert not any(isinstance(m, BlockLinear) for m in floats.modules())
        # the block products round each activation to 16 bits (decoderlm.cpu.block_linear):
        # ~2e-5 on these logits (measured)
        torch.testing.assert_close(floats(ids), expected, rtol=0, atol=1e-4)
    assert floats.head.weight is floats.tok_emb.weight  # still tied


def test_a_difference_is_called_only_when_its_paired_interval_excludes_zero() -> None:
    spec = dataclasses.replace(test_time_real.quick_spec(), ns=(2,), step_ns=())

    def runs(a: list[float], b: list[float]) -> list[dict]:
        return [test_time_real._run(name, 2, 0, i, v, 10)
                for name, values in (("best-of-N (verifier)", a), ("self-consistency", b))
                for i, v in enumerate(values)]  # fmt: skip

    better = test_time_real.comparisons(runs([1.0] * 20, [0.0] * 20), spec, 200)
    assert [(c["verdict"], c["difference"], c["low"]) for c in better] == [("higher", 1.0, 1.0)]
    noisy = test_time_real.comparisons(runs([1, 0] * 10, [0, 1] * 10), spec, 200)
    assert noisy[0]["verdict"] == "not distinguishable" and noisy[0]["low"] < 0 < noisy[0]["high"]
    mean, low, high = test_time_real.bootstrap([0.5] * 7, 100)
    assert (mean, low, high) == (0.5, 0.5, 0.5)


def test_the_quick_spec_is_smaller_everywhere_and_the_command_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full, quick = test_time_real.TestTimeRealSpec(), test_time_real.quick_spec()
    for field in ("screen_problems", "problems", "samples", "verifier_problems", "max_tokens"):
        assert getattr(quick, field) < getattr(full, field), field
    assert max(quick.ns) == quick.samples and max(full.ns) == full.samples
    out = ["lab", "test-time-real", "--quick", "--quiet", "--out", str(tmp_path)]
    assert main([*out, "--seeds", "0"]) == 2
    assert "--seeds=0 must be ≥ 1" in capsys.readouterr().err
    assert main([*out, "--input", "x.txt"]) == 2  # the lab's own options
    assert "drop --input" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{}")
    assert main(out) == 2
    assert "--overwrite" in capsys.readouterr().err
