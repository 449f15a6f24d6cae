"""Up-training mean-pooled GQA/MQA checkpoints (Ainslie et al., 2023), at an up-training fraction α
of one's choosing: the `uptrain-gqa` lab study (`decoderlm.lab.studies.uptrain_gqa`).

The paper's recipe (§2.1): take a multi-head (MHA) checkpoint, mean-pool the K/V projection heads
of each group (`decoderlm.gqa`), then up-train for α of the original pre-training steps with the
pre-training recipe (α = 5% in the paper; its Fig. 6 varies it). The study pre-trains MHA-8, pools
it to GQA-4, GQA-2 and MQA and up-trains each, beside MHA-8 continued for as long (the control)
and each shape trained from scratch for 1 + α of the steps; its report (OUT/report.md) draws the
up-training as a continuation of the pre-training and judges the paper's claims over the seeds.

    python benchmarks/uptrain_gqa.py --out uptrain                   # α = 5%: `decoderlm lab uptrain-gqa`
    python benchmarks/uptrain_gqa.py --fraction 0.2 --out uptrain-20
    python benchmarks/uptrain_gqa.py --quick --out uptrain-quick     # smoke run, minutes

Without --input it trains on the Python standard library, char-level, as `decoderlm lab` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from decoderlm.lab import report, runner, studies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the study's directory (resumed if there)")
    parser.add_argument(
        "--fraction", type=float, default=studies.UPTRAIN_FRACTION, help="α (default 0.05)"
    )
    parser.add_argument("--input", nargs="+", help="text files (default: the standard library)")
    parser.add_argument("--seeds", type=int, help=f"seeds (default {studies.FULL_SEEDS})")
    parser.add_argument("--quick", action="store_true", help="small models and budget")
    args = parser.parse_args()
    spec = dataclasses.replace(studies.uptrain_gqa(args.quick, args.fraction), builtin=True)
    spec = spec.with_budget(seeds=args.seeds)
    command = shlex.join(["python", "benchmarks/uptrain_gqa.py", *sys.argv[1:]])
    results = runner.run_study(spec, args.out, inputs=args.input, command=command)
    print(f"wrote {report.write_report(results, args.out)}")


if __name__ == "__main__":
    main()
