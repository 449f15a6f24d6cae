"""Study specs (TOML and built-in), size matching, the seed statistics and the init measurements."""

import dataclasses
import json
import math

import pytest
import torch

from decoderlm.cli import main
from decoderlm.errors import DecoderLMError
from decoderlm.lab import measure, stats, studies
from decoderlm.lab.spec import count_params, load_spec, match_d_ff
from decoderlm.model.config import ModelConfig

STUDY_TOML = """
name = "mine"
seeds = 3
budget_tokens = 4096
reference = "base"

[model]
context_length = 32
d_model = 32
n_layers = 2
n_heads = 4

[train]
batch_size = 4

[[variants]]
name = "base"

[[variants]]
name = "gqa"
model = { n_kv_heads = 2 }
match_params = true

[[variants]]
name = "post-nope-wide"
model = { norm_placement = "post", position = "none", d_model = 64 }
train = { lr = 1e-3 }
"""


def write(tmp_path, text):
    path = tmp_path / "study.toml"
    path.write_text(text)
    return path


def test_toml_spec_gives_each_variant_its_configs(tmp_path):
    spec = load_spec(write(tmp_path, STUDY_TOML))
    assert [v.name for v in spec.variants] == ["base", "gqa", "post-nope-wide"]
    wide = spec.variant("post-nope-wide")
    cfg = spec.model_config(wide)
    assert (cfg.norm_placement, cfg.position, cfg.d_model, cfg.n_layers) == ("post", "none", 64, 2)
    train = spec.train_config(wide, seed=2)
    assert train.lr == 1e-3
    assert train.max_steps == 4096 // (4 * 32) == 32  # the budget in steps of batch × context
    assert train.seed == 1337 + 2
    assert spec.train_config(spec.variant("base"), 2).seed == train.seed  # same seed, same batches
    gqa = spec.model_config(spec.variant("gqa"))
    ref = count_params(spec.model_config(spec.variant("base")))
    assert gqa.n_kv_heads == 2 and abs(count_params(gqa) - ref) <= 0.02 * ref


@pytest.mark.parametrize(
    "text, message",
    [
        ('name = "x"\nbogus = 1\n[[variants]]\nname = "a"\n', "unknown key 'bogus'"),
        ('[[variants]]\nname = "a"\nmodel = { n_kv_heads = 5 }\n', "variant 'a': n_heads=12"),
        ('[[variants]]\nname = "a"\n[[variants]]\nname = "a"\n', "'a' is repeated"),
        ('[[variants]]\nname = "a"\ninit_from = "b"\n', "must name an earlier variant"),
    ],
)
def test_bad_spec_is_a_one_line_error(tmp_path, text, message):
    with pytest.raises(DecoderLMError, match=message) as info:
        load_spec(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_match_d_ff_lands_within_two_percent_and_refuses_the_impossible():
    mha = ModelConfig(vocab_size=65, context_length=64, d_model=64, n_layers=4, n_heads=8)
    target = count_params(mha)
    for n_kv in (4, 2, 1):
        matched = match_d_ff(dataclasses.replace(mha, n_kv_heads=n_kv), target)
        assert matched.d_ff > mha.d_ff  # fewer K/V weights, a wider MLP
        assert abs(count_params(matched) - target) <= 0.02 * target
    with pytest.raises(DecoderLMError, match="cannot match"):
        match_d_ff(mha, target // 100)  # the embeddings alone are larger


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("name", [n for n in studies.STUDIES if n not in studies.TEST_TIME_STUDIES])
def test_builtin_studies_are_valid_and_matched(name, quick):
    spec = studies.builtin(name, quick)
    assert spec.builtin and spec.seeds == (2 if quick else 3)  # a verdict needs 3
    assert spec.budget_tokens is not None  # steps, not seconds: independent of the load
    for variant in spec.variants:
        spec.train_config(variant, 0)
        if variant.match_params:
            ref = count_params(spec.model_config(spec.variant(spec.reference)))
            assert abs(count_params(spec.model_config(variant)) - ref) <= 0.02 * ref


def test_the_summary_counts_only_finite_values():
    a = stats.summarise([1.0, 1.2])
    assert (a.mean, a.n) == (pytest.approx(1.1), 2)
    assert a.spread == pytest.approx(math.sqrt(0.02))  # ddof = 1
    failed = stats.summarise([None, float("nan"), 3.0])
    assert (failed.n, failed.n_total, failed.mean) == (1, 3, 3.0)


def test_the_registry_is_the_clis_list_of_studies_test_time_included(capsys):
    from decoderlm.lab.test_time import TestTimeSpec
    from decoderlm.lab.test_time_real import TestTimeRealSpec

    assert isinstance(studies.builtin(studies.TEST_TIME, quick=True), TestTimeSpec)
    assert isinstance(studies.builtin(studies.TEST_TIME_REAL, quick=True), TestTimeRealSpec)
    assert main(["lab", "nope", "--out", "x"]) == 2
    assert f"allowed: {', '.join(studies.STUDIES)}" in capsys.readouterr().err
    assert tuple(studies.STUDIES)[-2:] == studies.TEST_TIME_STUDIES


def test_var_qk_at_init_is_d_k_and_the_scale_brings_it_to_one():
    rows = measure.attention_init_stats((16, 64, 256), seed=0)
    at64 = rows[1]
    assert at64["var_qk"] == pytest.approx(64, rel=0.10)
    assert at64["var_qk_scaled"] == pytest.approx(1, rel=0.10)
    big = rows[2]  # unscaled logits saturate the softmax: lower entropy, vanishing gradient
    assert big["entropy_raw"] < big["entropy_scaled"] <= math.log(64)
    assert big["grad_norm_raw"] < big["grad_norm_scaled"]


def test_softmax_jacobian_norm_matches_autograd():
    s = torch.randn(5, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), s)
    assert measure.softmax_jacobian_norm(s).item() == pytest.approx(
        torch.linalg.matrix_norm(jac).item(), rel=1e-12
    )


def test_trained_scale_variants_exist_once_the_config_has_the_field():
    if "attn_scale" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        pytest.skip("ModelConfig has no 'attn_scale' field yet (the lead adds it)")
    spec = studies.builtin("scaling", quick=True)
    scales = {spec.model_config(v).attn_scale for v in spec.variants}
    assert scales == {"1/sqrt(head_dim)", "none"}
    assert {spec.model_config(v).head_dim for v in spec.variants} == {64, 256}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["lab", "--out", "x"], "give a STUDY"),
        (["lab", "nope", "--out", "x"], "unknown study 'nope'"),
        (["lab", "positions", "--seeds", "0", "--out", "x"], "--seeds=0 must be ≥ 1"),
        (
            ["lab", "positions", "--data", "no/such/dir", "--out", "x"],
            "--data no/such/dir: no such",
        ),
        (["lab", "positions", "--input", "no.txt", "--out", "x"], "--input no.txt: no such file"),
    ],
)
def test_cli_user_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


TINY_TOML = """
seeds = 1
budget_tokens = 256

[model]
context_length = 16
d_model = 16
n_layers = 1
n_heads = 2

[train]
batch_size = 4
eval_iters = 1
sample_tokens = 2
checkpoint_interval = 0
peak_flops = 1e12
threads = 1

[[variants]]
name = "only"
"""


def test_without_data_flags_a_study_trains_on_the_standard_library(tmp_path, monkeypatch):
    """No --data/--input and no ../shared: the standard library (here a stand-in of three modules)
    prepared into decoderlm's cache, as `decoderlm train` does."""
    from decoderlm.data import preparation

    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    for i in range(3):
        (stdlib / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 200)
    monkeypatch.setattr(preparation, "stdlib_dir", lambda: stdlib)
    monkeypatch.setenv("DECODERLM_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "clone"
    work.mkdir()
    monkeypatch.chdir(work)  # nothing beside it: no ../shared/data
    (work / "tiny.toml").write_text(TINY_TOML)
    assert main(["lab", "--spec", "tiny.toml", "--out", "out", "--quiet"]) == 0
    results = json.loads((work / "out" / "results.json").read_text())
    assert results["data"]["source"].endswith("standard library (*.py)")
    assert results["data"]["train_tokens"] > 0
    assert (tmp_path / "cache" / "data").is_dir() and not (work / "out" / "data").exists()
    assert str(tmp_path) not in (work / "out" / "report.md").read_text()


def test_uptrain_variants_are_named_by_their_kv_heads_and_follow_the_papers_recipe():
    spec = studies.builtin("uptrain-gqa")
    names = [v.name for v in spec.variants]
    assert names == ["MHA-8", "MHA-8 continued", "GQA-4 up-trained", "GQA-4 scratch",
                     "GQA-2 up-trained", "GQA-2 scratch", "MQA up-trained", "MQA scratch"]  # fmt: skip
    pre = spec.train_config(spec.variant("MHA-8"), 0)
    for name in ("GQA-2 up-trained", "MHA-8 continued"):
        up = spec.train_config(spec.variant(name), 0)
        # α = 5% of the pre-training steps, with the pre-training's peak lr, floor and warmup share
        assert up.max_steps == round(studies.UPTRAIN_FRACTION * pre.max_steps)
        assert (up.lr, up.min_lr) == (pre.lr, pre.min_lr)
        assert up.warmup_steps == max(1, round(0.1 * up.max_steps))
        assert up.seed != pre.seed  # batches the original did not see
    pooled = spec.variant("GQA-2 up-trained")
    assert pooled.pool_kv_heads == 2 and pooled.init_from == "MHA-8"
    scratch = spec.train_config(spec.variant("MQA scratch"), 0)
    assert scratch.max_steps == round((1 + studies.UPTRAIN_FRACTION) * pre.max_steps)
    with pytest.raises(DecoderLMError, match="fraction=0 must be in"):
        studies.uptrain_gqa(quick=True, fraction=0.0)


def test_a_pooled_variant_is_reported_with_the_kv_heads_it_has():
    from decoderlm.lab import report

    spec = studies.builtin("uptrain-gqa")
    variant = dataclasses.asdict(spec.variant("GQA-2 up-trained"))
    text = report._settings(variant, {"runs": []})
    assert text.startswith("n_kv_heads=2, seed=")
    assert "from MHA-8, its 8 K/V heads mean-pooled to 2, budget ×0.05" in text


def test_every_panel_has_distinct_colours_and_norm_placement_is_drawn_in_small_multiples():
    from decoderlm.lab import plots

    for n in (1, 4, 10, 16, 24):
        assert len(set(plots.palette(n))) == n
    spec = dataclasses.asdict(studies.builtin("norm-placement"))
    panels = plots._panels({"spec": spec})
    assert len(panels) == 4 and all(len(names) == 4 for names in panels.values())


def test_an_up_training_run_is_drawn_after_the_run_it_continues():
    from decoderlm.lab import plots

    variants = [{"name": "MHA-8", "init_from": None}, {"name": "MQA up", "init_from": "MHA-8"}]
    runs = [{"variant": "MHA-8", "seed": s, "steps": 880} for s in (0, 1)]
    runs += [{"variant": "MQA up", "seed": s, "steps": 44} for s in (0, 1)]
    offsets = plots._offsets({"spec": {"variants": variants}, "runs": runs})
    assert offsets == {("MHA-8", 0): 0, ("MHA-8", 1): 0, ("MQA up", 0): 880, ("MQA up", 1): 880}
