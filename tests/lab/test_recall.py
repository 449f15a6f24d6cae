"""The associative-recall task: its examples, its accuracy, and a micro hybrid study around it."""

import dataclasses
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from test_lab import micro_spec
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.lab import recall, report, runner, studies
from decoderlm.lab.spec import StudySpec, Variant
from decoderlm.model.cache import kv_cache_bytes_per_token, recurrent_state_bytes
from decoderlm.model.config import ModelConfig

TASK = recall.RecallTask(n_pairs=5, n_keys=8, n_values=6, steps=3, batch_size=4, test_examples=40)


def test_examples_ask_every_shown_key_once_and_target_its_value():
    x, y = recall.make_examples(TASK, 50, torch.Generator().manual_seed(0))
    n = TASK.n_pairs
    assert x.shape == y.shape == (50, 4 * n - 1)
    seq = torch.cat([x, y[:, -1:]], 1)  # the last target is the last answer: the full sequence
    for row, target in zip(seq.tolist(), y.tolist(), strict=True):
        keys, values = row[0 : 2 * n : 2], row[1 : 2 * n : 2]
        asked, answers = row[2 * n :: 2], row[2 * n + 1 :: 2]
        assert len(set(keys)) == n and all(0 <= k < TASK.n_keys for k in keys)
        assert all(TASK.n_keys <= v < TASK.vocab_size for v in values)
        assert sorted(asked) == sorted(keys)  # each key asked once
        assert answers == [values[keys.index(k)] for k in asked]
        # the loss sees the answers only: the target after each asked key
        scored = [i for i, t in enumerate(target) if t != recall.IGNORE]
        assert scored == list(range(2 * n, 4 * n - 1, 2))
        assert [target[i] for i in scored] == answers


def test_examples_are_a_function_of_the_seed():
    a = recall.make_examples(TASK, 8, torch.Generator().manual_seed(3))
    b = recall.make_examples(TASK, 8, torch.Generator().manual_seed(3))
    c = recall.make_examples(TASK, 8, torch.Generator().manual_seed(4))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


class Lookup(nn.Module):
    """An oracle: at each position, all its logit on the token that followed the current token
    the first time it appeared (a perfect induction head), else on token 0."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, self.vocab)
        for b, row in enumerate(x.tolist()):
            for t, token in enumerate(row):
                first = row.index(token)
                logits[b, t, row[first + 1] if first < t else 0] = 1.0
        return logits


class Constant(nn.Module):
    def __init__(self, vocab: int, token: int) -> None:
        super().__init__()
        self.vocab, self.token = vocab, token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, self.vocab)
        logits[..., self.token] = 1.0
        return logits


def test_accuracy_is_one_for_a_lookup_oracle_and_near_chance_for_a_constant_guess():
    assert recall.accuracy(Lookup(TASK.vocab_size), TASK) == 1.0
    many = recall.RecallTask(n_pairs=5, n_keys=8, n_values=6, test_examples=2000)
    guess = recall.accuracy(Constant(many.vocab_size, many.n_keys), many)  # always value 0
    # 10,000 answers, each the guessed value with p = 1/6: within 4 standard deviations
    assert guess == pytest.approx(1 / 6, abs=4 * (1 / 6 * 5 / 6 / 10_000) ** 0.5)


def test_train_and_score_is_deterministic_and_keeps_the_variants_shape():
    config = studies.hybrid(quick=True).model_config(studies.hybrid(quick=True).variants[4])
    a = recall.train_and_score(config, TASK, seed=7, threads=1)
    b = recall.train_and_score(config, TASK, seed=7, threads=1)
    assert a == b and 0.0 <= a["recall_accuracy"] <= 1.0
    small = recall.recall_config(config, TASK)
    assert (small.vocab_size, small.context_length) == (TASK.vocab_size, 4 * TASK.n_pairs)
    assert (small.layer_types, small.d_ff, small.d_model) == (
        config.layer_types,
        config.d_ff,
        config.d_model,
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n_pair": 3}, "recall: unknown field 'n_pair'"),
        ({"n_pairs": 9, "n_keys": 8}, "n_pairs=9 must be in \\[1, n_keys=8\\]"),
        ({"steps": 0}, "recall steps=0 must be ≥ 1"),
    ],
)
def test_a_bad_recall_task_is_a_one_line_error(fields, message):
    with pytest.raises(DecoderLMError, match=message) as info:
        StudySpec("s", "d", {}, {}, [Variant("a")], measures=("recall",), recall=fields)
    assert "\n" not in str(info.value)


def micro_hybrid() -> StudySpec:
    """Attention, Gated DeltaNet and a 1:1 hybrid of test_lab's micro model made two layers deep,
    4 steps, 2 seeds."""
    mixes = {"attention": ["attention"] * 2, "Gated DeltaNet": ["gdn"] * 2}
    mixes["hybrid"] = ["gdn", "attention"]
    base = micro_spec()
    return dataclasses.replace(
        base,
        name="micro-hybrid",
        description="attention vs recurrent vs hybrid, two layers",
        model={**base.model, "n_layers": 2},
        variants=[
            Variant(name, model={"layer_types": mix}, match_params=name != "attention")
            for name, mix in mixes.items()
        ],
        budget_tokens=4 * 16 * 4,
        reference="attention",
        measures=("recall",),
        recall=dict(n_pairs=3, n_keys=6, n_values=6, steps=2, batch_size=4, test_examples=16),
    )


@pytest.fixture(scope="module")
def hybrid_study(tmp_path_factory) -> tuple[Path, dict]:
    rng = random.Random(0)
    corpus = tmp_path_factory.mktemp("corpus") / "words.txt"
    corpus.write_text(" ".join(rng.choice(["to", "be", "or", "not"]) for _ in range(2000)))
    out = tmp_path_factory.mktemp("hybrid")
    results = runner.run_study(micro_hybrid(), out, inputs=[corpus], progress=False)
    report.write_report(results, out)
    return out, results


def test_hybrid_study_records_state_memory_and_recall_per_run(hybrid_study):
    _, results = hybrid_study
    table = results["summary"]
    for run in results["runs"]:
        config = ModelConfig.from_dict(run["model"])
        assert run["state_bytes"] == recurrent_state_bytes(config)
        assert run["kv_bytes_per_token"] == kv_cache_bytes_per_token(config)
        assert 0.0 <= run["recall_accuracy"] <= 1.0
    # per layer: the fp32 matrix state H·d_k·d_v and the conv state (q, k, v channels × (K − 1))
    h, d = 4, 4
    per_layer = 4 * h * d * d + 4 * 3 * h * d * 3
    assert [table[n]["state_bytes"] for n in table] == [0, 2 * per_layer, per_layer]
    assert [table[n]["kv_bytes_per_token"] for n in table] == [2 * 2 * 16 * 4, 0, 2 * 16 * 4]
    # one GiB of KV: the pure recurrent model's context is unbounded, the hybrid's twice MHA's
    budget = 1 << 30
    assert table["Gated DeltaNet"]["kv_max_context"] is None
    assert table["hybrid"]["kv_max_context"] == (budget - per_layer) // (2 * 16 * 4)
    ref = table["attention"]["params"]  # d_ff matched at the data's vocabulary
    assert all(abs(table[n]["params"] - ref) <= 0.02 * ref for n in table)


def test_hybrid_report_memory_table_and_recall_are_the_results(hybrid_study):
    out, results = hybrid_study
    text = (out / report.REPORT_FILE).read_text()
    rows = {r[0]: r for r in _rows(text, "Inference memory per sequence")}
    table = results["summary"]
    assert (
        rows["Gated DeltaNet"][3:6] == [report._bytes(table["Gated DeltaNet"]["state_bytes"])] * 3
    )
    assert rows["attention"][5] == "32.0 MiB"  # 2 layers · K and V · 16 · 4 bytes · 128k tokens
    assert float(rows["attention"][6]) == 1.0
    variants = {r[0]: r for r in _rows(text, "Variants")}
    assert variants["Gated DeltaNet"][4] == "∞"
    for name in table:
        accuracy = table[name]["recall_accuracy"]
        assert f"{name}: {accuracy['mean']:.3f} ± {accuracy['spread']:.3f}" in text
    names = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text))
    assert {"memory.png", "recall.png", "loss_vs_memory.png"} <= names
    assert "Recall accuracy against attention" not in text  # a study of one's own: the ranking


def test_a_finished_hybrid_study_resumes_without_retraining(hybrid_study, monkeypatch, tmp_path):
    out, results = hybrid_study
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    again = runner.run_study(micro_hybrid(), out, data_dir=out / "data", progress=False)
    assert [r["recall_accuracy"] for r in again["runs"]] == [
        r["recall_accuracy"] for r in results["runs"]
    ]


def test_a_run_with_another_recall_task_is_refused_not_reused(hybrid_study, tmp_path):
    out, _ = hybrid_study
    shutil.copytree(out / "runs", tmp_path / "runs")
    changed = micro_hybrid()
    changed.recall["steps"] = 3
    with pytest.raises(DecoderLMError, match="other settings than variant 'attention'"):
        runner.run_study(changed, tmp_path, data_dir=out / "data", progress=False)


def test_the_builtin_hybrid_study_concludes_from_its_numbers(hybrid_study):
    _, results = hybrid_study
    names = [name for name, _ in studies.LAYER_MIXES]
    fake = {**results, "spec": {**results["spec"], "builtin": True}, "study": "hybrid"}
    row = results["summary"]["attention"]
    fake["summary"] = {n: dict(row) for n in names}
    for n in names[1:4]:  # the pure recurrent variants: no KV, recall well below attention
        fake["summary"][n].update(kv_bytes_per_token=0, state_bytes=1000)
        fake["summary"][n]["recall_accuracy"] = dict(mean=0.2, spread=0.01, n=2, n_total=2)
    fake["summary"]["attention"]["recall_accuracy"] = dict(mean=0.9, spread=0.01, n=2, n_total=2)
    for n in names[4:]:  # the hybrids: within the spread of attention
        fake["summary"][n]["recall_accuracy"] = dict(mean=0.88, spread=0.03, n=2, n_total=2)
    text = conclusions_hybrid(fake)
    assert "Pure recurrent variants below attention in recall: linear attention, " in text
    assert "hybrids not below it: hybrid 3:1, hybrid 1:1" in text
    assert "The data are consistent with this" in text
    fake["summary"]["hybrid 3:1"]["recall_accuracy"] = dict(mean=0.2, spread=0.01, n=2, n_total=2)
    assert "The data do not support this" in conclusions_hybrid(fake)
    # attention at the copying level (1 / n_pairs = 1/3): the recall numbers test nothing
    fake["summary"]["attention"]["recall_accuracy"] = dict(mean=0.3, spread=0.01, n=2, n_total=2)
    assert "Attention did not learn the lookup" in conclusions_hybrid(fake)


def conclusions_hybrid(results: dict) -> str:
    from decoderlm.lab import conclusions

    return conclusions.conclude(results)


def _rows(text: str, section: str) -> list[list[str]]:
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    lines = [line for line in part.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
