"""`import decoderlm` loads the model only; the heavier names load on first use and are the real ones."""

import subprocess
import sys

import pytest

import decoderlm


def test_import_decoderlm_loads_neither_serving_nor_cpu_paths_nor_the_compiler():
    code = (
        "import sys, decoderlm; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'uvicorn', 'transformers', 'matplotlib') or m.startswith("
        "('decoderlm.engine', 'decoderlm.server', 'decoderlm.cpu', 'decoderlm.inference', 'decoderlm.training', "
        "'torch._dynamo', 'torch._inductor'))))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_lazy_names_are_the_defining_modules_objects():
    from decoderlm.engine.engine import Engine
    from decoderlm.engine.types import RequestParams
    from decoderlm.inference.generate import generate
    from decoderlm.inference.sampling import SamplingParams
    from decoderlm.loading import load

    assert decoderlm.generate is generate
    assert decoderlm.SamplingParams is SamplingParams
    assert decoderlm.load is load
    assert decoderlm.Engine is Engine
    assert decoderlm.RequestParams is RequestParams
    assert set(decoderlm.__all__) <= set(dir(decoderlm))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        decoderlm.nope  # noqa: B018
