"""Controlled ablation studies: specs → runs → results.json → report.md + plots.

`decoderlm.lab.spec` (what a study is), `studies` (the built-ins, the one registry), `runner`
(training and measuring every run, resumable), `measure` (and each run's health), `recall` (the
MQAR task), `stats` (means, 95% intervals and the verdict rule), `conclusions` (the verdicts),
`report` and `plots` (report.md and its figures). From Python:

    from decoderlm.lab import report, runner, studies
    results = runner.run_study(studies.builtin("positions", quick=True), "lab/positions")
    report.write_report(results, "lab/positions")

(without `data_dir` or `inputs` a study trains on the Python standard library, char-level).
"""
