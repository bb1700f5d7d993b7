"""The settings of a packed loader's inner ``DataLoader`` that Lightning reads and sets."""

from __future__ import annotations

from typing import Any

__all__ = ["DataLoaderSettings", "OfSource", "check_dataloader_kwargs"]


class DataLoaderSettings:
    """``num_workers``, ``worker_init_fn`` (which ``seed_everything(workers=True)`` sets) and
    ``multiprocessing_context`` (which the strategies set for SIGTERM-safe workers), kept in
    ``dataloader_kwargs`` for the inner ``DataLoader`` a pass makes, and passed on to those made
    already (:meth:`_made_loaders`); a new worker count makes them again (:meth:`_remake`)."""

    dataloader_kwargs: dict[str, Any]

    def _made_loaders(self) -> list[Any]:
        """The inner ``DataLoader`` objects made already and kept across passes."""
        return []

    def _remake(self) -> None:
        """The next pass makes its inner ``DataLoader`` again (none is kept: nothing to do)."""

    def _set(self, name: str, value: Any) -> None:
        self.dataloader_kwargs[name] = value
        for made in self._made_loaders():
            setattr(made, name, value)

    @property
    def num_workers(self) -> int:
        """The inner ``DataLoader``'s worker processes (``0``: the main process loads); set, it
        reaches the next pass (a ``DataLoader`` made already, and its persistent workers, are
        made again)."""
        return int(self.dataloader_kwargs.get("num_workers", 0))

    @num_workers.setter
    def num_workers(self, count: int) -> None:
        if int(count) < 0:
            raise ValueError(f"`num_workers={count!r}` must be >= 0")
        if int(count) == 0 and self.dataloader_kwargs.get("persistent_workers"):
            raise ValueError(
                "`num_workers=0` with `persistent_workers=True`: persistent workers need at"
                " least one worker"
            )
        self.dataloader_kwargs["num_workers"] = int(count)
        self._remake()

    @property
    def worker_init_fn(self) -> Any:
        """The inner ``DataLoader``'s; Lightning sets it for ``seed_everything(workers=True)``."""
        return self.dataloader_kwargs.get("worker_init_fn")

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Any) -> None:
        self._set("worker_init_fn", fn)

    @property
    def multiprocessing_context(self) -> Any:
        """The inner ``DataLoader``'s (how its workers start; ``None``: the default)."""
        return self.dataloader_kwargs.get("multiprocessing_context")

    @multiprocessing_context.setter
    def multiprocessing_context(self, context: Any) -> None:
        self._set("multiprocessing_context", context)


class OfSource:
    """A packed loader's attribute that is its pack source's (``loader.pack_source``): read
    there, and set there (a setting changed after construction reaches the next pass, as it did
    when the loader held it; an attribute of the loader's own would shadow it silently)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loader: Any, owner: type | None = None) -> Any:
        return self if loader is None else getattr(loader.pack_source, self.name)

    def __set__(self, loader: Any, value: Any) -> None:
        setattr(loader.pack_source, self.name, value)


def check_dataloader_kwargs(owner: str, kwargs: dict[str, Any], decider: str) -> None:
    """Refuses the inner ``DataLoader`` settings a loader of packs decides itself (one pack per
    batch, formed by ``decider``), naming the setting."""
    for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
        if key in kwargs:
            raise ValueError(f"`{owner}({key}=...)` is decided by {decider}")
