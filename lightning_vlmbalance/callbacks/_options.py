"""Options every callback of the package shares, with one default each."""

from __future__ import annotations

__all__ = ["LOG_EVERY_N_STEPS", "checked_log_every_n_steps"]

LOG_EVERY_N_STEPS = 50  # Lightning's own `Trainer(log_every_n_steps=...)` default


def checked_log_every_n_steps(owner: str, value: int) -> int:
    """``value`` if it is a valid ``log_every_n_steps`` of callback ``owner``.

    Raises:
        ValueError: quoting the call, for a value below 1.
    """
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"`{owner}(log_every_n_steps={value!r})` must be an integer >= 1")
    return value
