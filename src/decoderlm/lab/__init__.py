"""Controlled ablation studies: specs → runs → results.json → report.md + plots.

`decoderlm.lab.spec` (what a study is), `studies` (the built-ins), `runner` (training and measuring
every run, resumable), `measure`, `stats` (mean ± spread, the seed rule), `report` and
`conclusions` (report.md and its plots). From Python:

    from decoderlm.lab import report, runner, studies
    results = runner.run_study(studies.builtin("positions", quick=True), "lab/positions",
                               inputs=["tinyshakespeare.txt"])
    report.write_report(results, "lab/positions")
"""
