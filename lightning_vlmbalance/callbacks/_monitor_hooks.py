"""What ``StragglerMonitor`` puts into a fit to time it, and takes out again: forward hooks on the
vision and language submodules, optimizer step hooks, Lightning's loop (data fetch and the
per-micro-batch sync point), DDP's communication hook and FSDP2's collectives."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_vlmbalance import _lightning as seam
from lightning_vlmbalance.timing import LIGHTNING_SYNC, StepTimer, timed_comm_hook
from lightning_vlmbalance.timing.collectives import TimedCollectives, time_collectives
from lightning_vlmbalance.timing.timer import HOST

# the monitor's logger: its warnings keep the name they had when this lived in the monitor
log = logging.getLogger("lightning_vlmbalance.callbacks.straggler_monitor")

_VISION_NAMES = (
    "vision",
    "vision_tower",
    "vision_model",
    "visual",
    "vision_encoder",
    "image_encoder",
    "vit",
)
_LLM_NAMES = ("llm", "language_model", "text_model", "lm", "decoder")


class _TimingHooks:
    """The timing hooks of one fit: installed by :meth:`wrap_strategy_comm_hook` (at ``setup``)
    and :meth:`install` (at ``on_fit_start``), all undone by :meth:`remove`, which is safe to
    call whatever was installed (Lightning skips ``teardown`` after an exception)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []  # forward and optimizer hooks
        self._seam_trainer: L.Trainer | None = None  # whose loop seam we listen to
        self._restore_hook: tuple[DDPStrategy, Any] | None = None  # the comm hook we wrapped
        self._timing_collectives: TimedCollectives | None = None  # FSDP2's, timed

    def wrap_strategy_comm_hook(self, strategy: Any, timer: StepTimer) -> None:
        """Times the wait at DDP's gradient all-reduce on CUDA by wrapping the strategy's comm
        hook (a no-op on the CPU and for other strategies: see :meth:`install`)."""
        if isinstance(strategy, DDPStrategy) and strategy.root_device.type == "cuda":
            # Lightning registers the strategy's comm hook on CUDA in strategy.setup(), which
            # runs after the monitor's setup: wrap the user's hook (or the default) in place
            user_hook = seam.ddp_comm_hook(strategy)
            self._restore_hook = (strategy, user_hook)
            seam.set_ddp_comm_hook(strategy, timed_comm_hook(timer.mark_sync_entry, user_hook))

    def install(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        timer: StepTimer,
        vision_module: nn.Module | str | bool | None,
        llm_module: nn.Module | str | bool | None,
    ) -> None:
        """Hooks the submodules ``vision_module`` and ``llm_module`` name (as
        ``StragglerMonitor`` takes them), the optimizers, Lightning's loop, DDP's CPU comm hook
        and FSDP2's collectives to ``timer``.

        Raises:
            ValueError: for a module name that ``pl_module`` does not have.
        """
        vision = _resolve_module(pl_module, vision_module, _VISION_NAMES, "vision_module")
        llm = _resolve_module(pl_module, llm_module, _LLM_NAMES, "llm_module")
        for module, phase in ((vision, "vision_fwd"), (llm, "llm_fwd")):
            if module is not None:
                self._hook_forward(trainer, module, phase, timer)
        for optimizer in trainer.optimizers:
            self._handles.append(
                optimizer.register_step_post_hook(lambda *_: timer.stop("optimizer"))
            )
        self._patch_loop(trainer, timer)
        _register_cpu_comm_hook(trainer, timer)
        # FSDP2's all-gathers and reduce-scatters (a no-op for DDP): ``collective_wait``. (The
        # returns of encoder balancing are timed by the strategy's channel, with this timer.)
        self._timing_collectives = time_collectives(timer, pl_module)

    def _hook_forward(
        self, trainer: L.Trainer, module: nn.Module, phase: str, timer: StepTimer
    ) -> None:
        def pre(mod: nn.Module, args: Any) -> None:
            # not during validation, nor a recomputation inside backward (checkpointing)
            if trainer.training and not seam.in_backward():
                timer.start(phase)

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            timer.stop(phase)

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def _patch_loop(self, trainer: L.Trainer, timer: StepTimer) -> None:
        """Times Lightning's data fetch and its per-micro-batch sync point (the SIGTERM-flag
        broadcast, or the strategy's replacement of it)."""

        def timed_sync_point(sync: Any) -> None:
            if timer.sync_point_is_between():
                # the step's first sync point, or the first after a pause inside the step: it
                # waits for whatever the ranks did outside training (validation, a save)
                t0 = HOST.mark()
                try:
                    sync()
                finally:
                    timer.between_steps(HOST.elapsed_ms(t0, HOST.mark()))
                return
            timer.start(LIGHTNING_SYNC, host=True)
            try:
                sync()
            finally:
                timer.stop(LIGHTNING_SYNC)

        loop = seam.loop_seam(trainer)

        def before_fetch() -> None:
            timer.resume()  # training goes on (one rank: there is no sync point)
            timer.start("data", host=True)

        loop.on_fetch(self, before_fetch, lambda: timer.stop("data"))
        loop.wrap_sync_point(self, timed_sync_point)
        self._seam_trainer = trainer

    def remove(self) -> None:
        """Undoes every hook, the loop's listeners and the comm-hook wrap."""
        if self._timing_collectives is not None:
            self._timing_collectives.remove()
            self._timing_collectives = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._seam_trainer is not None:
            seam.leave_loop_seam(self._seam_trainer, self)
            self._seam_trainer = None
        if self._restore_hook is not None:
            seam.set_ddp_comm_hook(*self._restore_hook)
            self._restore_hook = None


def _register_cpu_comm_hook(trainer: L.Trainer, timer: StepTimer) -> None:
    """Times the wait at DDP's gradient all-reduce on the CPU (on CUDA the strategy's comm hook
    is wrapped instead: :meth:`_TimingHooks.wrap_strategy_comm_hook`). DDP keeps the hook for
    the life of the wrapped model: there is nothing to remove."""
    strategy, model = trainer.strategy, trainer.strategy.model
    if not isinstance(model, DistributedDataParallel) or strategy.root_device.type == "cuda":
        return
    # Lightning registers a strategy's comm hook only on CUDA; on the CPU DDP runs its plain
    # all-reduce, so that is what we wrap (enabling the user's hook would change the math)
    hook = timed_comm_hook(timer.mark_sync_entry)
    try:
        model.register_comm_hook(state=getattr(model, "process_group", None), hook=hook)
    except RuntimeError as err:  # a hook is registered already: we cannot wrap it here
        log.warning(
            "StragglerMonitor could not add its timing comm hook (%s); the all-reduce wait"
            " is counted in `backward` instead of `sync_wait`.",
            err,
        )


def _resolve_module(
    root: nn.Module, spec: nn.Module | str | bool | None, names: tuple[str, ...], arg: str
) -> nn.Module | None:
    """The submodule of ``root`` that ``spec`` names (``StragglerMonitor``'s argument ``arg``):
    ``None`` for ``False``, the module itself, a dotted name, or by default the shallowest
    submodule whose own name is one of ``names`` (the earlier name first at one depth)."""
    if spec is False:
        return None
    if isinstance(spec, nn.Module):
        return spec
    if isinstance(spec, str):
        try:
            return root.get_submodule(spec)
        except AttributeError as err:
            raise ValueError(
                f"`StragglerMonitor({arg}={spec!r})`: {type(root).__name__} has no such submodule"
            ) from err
    # default: the shallowest submodule whose own name is one of the usual ones
    found = [
        (name.count("."), name, mod)
        for name, mod in root.named_modules()
        if name and name.rsplit(".", 1)[-1] in names
    ]
    if not found:
        log.warning(
            "StragglerMonitor: no %s found by name (%s); that phase is not timed: pass `%s=`.",
            arg,
            ", ".join(names),
            arg,
        )
        return None
    return min(found, key=lambda x: (x[0], names.index(x[1].rsplit(".", 1)[-1])))[2]
