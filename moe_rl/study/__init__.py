"""The study flow: experiments about the training run rather than the run itself.

- ``ablate``: ablation grids (expand a YAML ``grid:`` into per-cell configs, train each cell and seed);
- ``report``: the report of one run or a grid (summary table, curves, ``report.md``);
- ``diagnose``: the zero-staleness rollout-vs-learner mismatch measurement (``moe-rl diagnose``);
- ``diagnose_report``: its decision-tree verdict, plots and report files;
- ``attribute``: the same measurement per item of the true-on-policy kernel contract (``diagnose --attribute``);
- ``certify``: the pass/fail gate on it (``moe-rl certify``: exit 1 on any difference).

``moe-rl ablate``, ``moe-rl diagnose`` and ``moe-rl certify`` call into this package.
"""
