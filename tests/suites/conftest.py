"""The suites' smoke runs: the ``smoke_runs`` fixture of ``tests/smoke_runs.py``."""

from tests.smoke_runs import smoke_runs  # noqa: F401  (a fixture: pytest finds it here)
