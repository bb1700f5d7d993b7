"""The full correctness suites: the Trainer battery, preemption trials, the exchange soak.

Each is a module run from the repository root, ``python -m tests.suites.<name> [--json] ...``,
that takes minutes; ``pytest -m suite`` runs each as recorded in
``benchmarks/results/rebalancing.md`` and fails on any failure or hang. The default test run
deselects them and runs a quick case of each instead (``test_*.py`` here).
"""
