"""The study flow: experiments about the training run rather than the run itself.

- ``ablate``: ablation grids (expand a YAML ``grid:`` into per-cell configs, train each cell and seed);
- ``report``: the report of one run or a grid (summary table, curves, ``report.md``);
- ``diagnose``: the zero-staleness rollout-vs-learner mismatch measurement (``moe-rl diagnose``);
- ``diagnose_report``: its decision-tree verdict, plots and report files.

The command line is unchanged: ``moe-rl ablate`` and ``moe-rl diagnose`` call into this package.
"""
