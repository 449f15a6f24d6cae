"""Multi-query associative recall: its examples, its accuracy, the recall grid of a micro hybrid
study, and the rule that no recall conclusion is drawn unless attention solved the task."""

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from test_lab import micro_spec
from torch import nn

from decoderlm.errors import DecoderLMError
from decoderlm.lab import conclusions, recall, report, runner, studies
from decoderlm.lab.spec import StudySpec, Variant
from decoderlm.model.cache import kv_cache_bytes_per_token, recurrent_state_bytes
from decoderlm.model.config import ModelConfig

TASK = recall.RecallTask(vocab_size=20, length=24, pairs=(2, 6), steps=3, batch_size=4)


@pytest.mark.parametrize("n_pairs", [2, 6])
def test_answer_positions_are_exactly_the_queries_and_target_their_values(n_pairs):
    x, y = recall.make_examples(TASK, n_pairs, 50, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (50, TASK.length)
    half = TASK.n_keys
    for row, target in zip(x.tolist(), y.tolist(), strict=True):
        keys, values = row[0 : 2 * n_pairs : 2], row[1 : 2 * n_pairs : 2]
        assert len(set(keys)) == len(set(values)) == n_pairs  # distinct keys, distinct values
        assert all(k < half for k in keys) and all(half <= v < TASK.vocab_size for v in values)
        rest = row[2 * n_pairs :]
        queries = [2 * n_pairs + i for i, token in enumerate(rest) if token < half]
        assert sorted(row[q] for q in queries) == sorted(keys)  # every key asked once, no other
        assert all((q - 2 * n_pairs) % 2 == 0 for q in queries)  # at even offsets
        scored = [t for t, value in enumerate(target) if value != recall.IGNORE]
        assert scored == queries  # the loss sees the queries' answers, nothing else
        assert [target[q] for q in queries] == [values[keys.index(row[q])] for q in queries]


def test_examples_are_a_function_of_the_seed():
    a = recall.make_examples(TASK, 6, 8, torch.Generator().manual_seed(3))
    b = recall.make_examples(TASK, 6, 8, torch.Generator().manual_seed(3))
    c = recall.make_examples(TASK, 6, 8, torch.Generator().manual_seed(4))
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


class Lookup(nn.Module):
    """An oracle: at a key seen before, all its logit on the token that followed the key's first
    appearance (a perfect induction head); elsewhere on token 0."""

    def __init__(self, vocab: int, keys: int) -> None:
        super().__init__()
        self.vocab, self.keys = vocab, keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, self.vocab)
        for b, row in enumerate(x.tolist()):
            for t, token in enumerate(row):
                first = row.index(token)
                hit = token < self.keys and first < t
                logits[b, t, row[first + 1] if hit else 0] = 1.0
        return logits


class Constant(nn.Module):
    def __init__(self, vocab: int, token: int) -> None:
        super().__init__()
        self.vocab, self.token = vocab, token

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, self.vocab)
        logits[..., self.token] = 1.0
        return logits


def test_accuracy_is_one_for_a_lookup_oracle_and_chance_for_a_constant_guess():
    oracle = Lookup(TASK.vocab_size, TASK.n_keys)
    assert all(recall.accuracy(oracle, TASK, n) == 1.0 for n in TASK.pairs)
    many = dataclasses.replace(TASK, test_examples=2000)
    guess = recall.accuracy(Constant(many.vocab_size, many.n_keys), many, 2)  # always value 0
    # 4,000 answers, each the guessed value with p = 1/10: within 4 standard deviations
    assert guess == pytest.approx(1 / 10, abs=4 * (0.1 * 0.9 / 4000) ** 0.5)


def test_train_and_score_is_deterministic_and_keeps_the_variants_shape():
    spec = studies.hybrid(quick=True)
    config = spec.model_config(spec.variants[4])
    a = recall.train_and_score(config, TASK, seed=7, threads=1)
    b = recall.train_and_score(config, TASK, seed=7, threads=1)
    assert a == b and set(a["accuracy"]) == {"2", "6"}
    assert all(0.0 <= v <= 1.0 for v in a["accuracy"].values())
    small = recall.recall_config(config, TASK)
    assert (small.vocab_size, small.context_length) == (TASK.vocab_size, TASK.length)
    assert (small.layer_types, small.d_ff, small.d_model) == (
        config.layer_types,
        config.d_ff,
        config.d_model,
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"n_pairs": 3}, "recall: unknown field 'n_pairs'"),
        ({"pairs": (4, 8), "length": 31}, "length=31 must be ≥ 4 × the most pairs"),
        ({"pairs": (8,), "vocab_size": 14}, "vocab_size=14 must hold 2 × the most pairs"),
        ({"steps": 0}, "recall steps=0 must be ≥ 1"),
        ({"heads": (3,)}, "recall heads=\\[3\\] must divide d_model=64"),
        ({"mixes": {"gdn": ["gdn"]}}, "recall mixes must start with the all-attention reference"),
    ],
)
def test_a_bad_recall_task_is_a_one_line_error(fields, message):
    with pytest.raises(DecoderLMError, match=message) as info:
        StudySpec("s", "d", {}, {}, [Variant("a")], measures=("recall",), recall=fields)
    assert "\n" not in str(info.value)


RECALL_MIXES = {"attention": ["attention"] * 2, "Gated DeltaNet": ["gdn"] * 2}
RECALL_MIXES["hybrid 1:1"] = ["gdn", "attention"]


def micro_hybrid() -> StudySpec:
    """Attention, Gated DeltaNet and a 1:1 hybrid of test_lab's micro model made two layers deep,
    2 seeds; recall of two-layer models at two head counts and two pair counts."""
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
        reference="attention",
        measures=("recall",),
        recall=dict(
            vocab_size=12,
            length=16,
            pairs=(2, 4),
            mixes=RECALL_MIXES,
            d_model=16,
            heads=(4, 2),
            steps=2,
            batch_size=4,
            test_examples=8,
        ),
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


def test_the_recall_grid_has_every_head_count_mix_and_seed_at_matched_size(hybrid_study):
    _, results = hybrid_study
    grid = results["recall"]["runs"]
    assert sorted((r["heads"], r["variant"], r["seed"]) for r in grid) == sorted(
        (h, v, s) for h in (4, 2) for v in RECALL_MIXES for s in (0, 1)
    )
    for heads in (4, 2):
        mine = {r["variant"]: r for r in grid if r["heads"] == heads and r["seed"] == 0}
        ref = mine["attention"]["params"]
        assert all(abs(r["params"] - ref) <= 0.02 * ref for r in mine.values())
        assert mine["attention"]["state_bytes"] == 0 < mine["hybrid 1:1"]["state_bytes"]
        assert mine["hybrid 1:1"]["state_bytes"] < mine["Gated DeltaNet"]["state_bytes"]
    gdn = {r["heads"]: r["state_bytes"] for r in grid if r["variant"] == "Gated DeltaNet"}
    # the matrix state H · (d/H)² = d²/H a layer doubles from 4 heads to 2 (the conv state stays)
    conv = 4 * 2 * 3 * 16 * 3  # fp32 · layers · q, k, v channels (H · d/H each) · (K − 1)
    assert gdn[2] - conv == 2 * (gdn[4] - conv) == 2 * 4 * 2 * 16**2 // 4
    assert all(set(r["accuracy"]) == {"2", "4"} for r in grid)


def test_hybrid_study_records_state_memory_per_run(hybrid_study):
    _, results = hybrid_study
    table = results["summary"]
    for run in results["runs"]:
        config = ModelConfig.from_dict(run["model"])
        assert run["state_bytes"] == recurrent_state_bytes(config)
        assert run["kv_bytes_per_token"] == kv_cache_bytes_per_token(config)
    # per layer: the fp32 matrix state H·d_k·d_v and the conv state (q, k, v channels × (K − 1))
    h, d = 4, 4
    per_layer = 4 * h * d * d + 4 * 3 * h * d * 3
    assert [table[n]["state_bytes"] for n in table] == [0, 2 * per_layer, per_layer]
    assert [table[n]["kv_bytes_per_token"] for n in table] == [2 * 2 * 16 * 4, 0, 2 * 16 * 4]
    budget = 1 << 30
    assert table["Gated DeltaNet"]["kv_max_context"] is None
    assert table["hybrid"]["kv_max_context"] == (budget - per_layer) // (2 * 16 * 4)


def test_hybrid_report_memory_and_recall_tables_are_the_results(hybrid_study):
    out, results = hybrid_study
    text = (out / report.REPORT_FILE).read_text()
    rows = {r[0]: r for r in _rows(text, "Inference memory per sequence")}
    table = results["summary"]
    assert (
        rows["Gated DeltaNet"][3:6] == [report._bytes(table["Gated DeltaNet"]["state_bytes"])] * 3
    )
    assert rows["attention"][5] == "32.0 MiB"  # 2 layers · K and V · 16 · 4 bytes · 128k tokens
    recall_rows = _rows(text, "Multi-query associative recall")
    assert len(recall_rows) == 6  # 3 mixes × 2 head counts
    for cells in recall_rows:
        name, heads = cells[0], int(cells[1])
        values = [
            r["accuracy"]["4"]
            for r in results["recall"]["runs"]
            if (r["variant"], r["heads"]) == (name, heads)
        ]
        assert float(cells[-1].split("±")[0]) == pytest.approx(sum(values) / 2, abs=5e-4)
    names = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text))
    assert {"memory.png", "recall.png", "loss_vs_memory.png"} <= names


def test_a_finished_hybrid_study_resumes_without_retraining(hybrid_study, monkeypatch):
    out, results = hybrid_study
    monkeypatch.setattr(runner, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    monkeypatch.setattr(recall, "train_and_score", lambda *a: pytest.fail("retrained recall"))
    again = runner.run_study(micro_hybrid(), out, data_dir=out / "data", progress=False)
    assert again["recall"]["runs"] == results["recall"]["runs"]


def synthetic_recall(accuracy: dict[str, float], heads=(4, 1), seeds=3) -> dict:
    """Results of the built-in hybrid study whose recall runs all score accuracy[mix] (seed k adds
    0.01·k, so the seeds differ)."""
    names = [name for name, _ in studies.LAYER_MIXES]
    pairs = (2, 4, 8)
    runs = [
        {"variant": n, "heads": h, "seed": k,
         "accuracy": {str(p): min(1.0, accuracy[n] + 0.01 * k - 0.001 * p) for p in pairs}}
        for h in heads for n in recall.MIXES for k in range(seeds)
    ]  # fmt: skip
    task = dataclasses.asdict(recall.RecallTask(pairs=pairs, heads=heads))
    row = {"kv_bytes_per_token": 1, "state_bytes": 0, "health": {}}
    return {
        "study": "hybrid",
        "spec": {"builtin": True, "seeds": seeds},
        "runs": [],
        "summary": {n: row for n in names},
        "recall": {"task": task, "runs": runs},
    }


def test_recall_conclusions_follow_from_the_grid_when_attention_solved_it():
    accuracy = {"attention": 0.95, "linear attention": 0.3, "Gated DeltaNet": 0.5}
    accuracy |= {"Mamba-2": 0.4, "hybrid 3:1": 0.95, "hybrid 1:1": 0.95}
    text = "\n".join(conclusions.conclude(synthetic_recall(accuracy)))
    assert "Attention solved the recall task at 4, 1 head(s)." in text
    line = next(x for x in text.splitlines() if "4 head(s): Gated DeltaNet recalls less than" in x)
    assert line.endswith("| as expected |")
    hybrid_line = next(x for x in text.splitlines() if "1 head(s): hybrid 1:1 recalls" in x)
    assert hybrid_line.endswith("| as expected (not distinguishable) |")
    larger = "Mamba-2 recalls more at 8 pairs with the larger state (1 head(s) against 4)"
    state_line = next(x for x in text.splitlines() if larger in x)
    assert state_line.endswith("| not distinguishable |")  # the same accuracy at both


def test_no_recall_conclusion_unless_attention_solved_the_task():
    accuracy = {name: 0.2 for name, _ in studies.LAYER_MIXES}  # nobody learned the lookup
    text = "\n".join(conclusions.conclude(synthetic_recall(accuracy)))
    assert "Attention did not solve the recall task" in text
    assert "recalls less" not in text and "recalls as well" not in text
    accuracy["attention"] = 0.95  # solved with 1 head only
    solved_at_1 = synthetic_recall(accuracy)
    for r in solved_at_1["recall"]["runs"]:
        if r["variant"] == "attention" and r["heads"] == 4:
            r["accuracy"] = {p: 0.5 for p in r["accuracy"]}
    text = "\n".join(conclusions.conclude(solved_at_1))
    assert "Attention solved the recall task at 1 head(s) but not at 4" in text
    assert "4 head(s):" not in text and "1 head(s): Mamba-2 recalls less" in text


def _rows(text: str, section: str) -> list[list[str]]:
    part = text.split(f"## {section}")[1].split("\n## ")[0]
    lines = [line for line in part.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
