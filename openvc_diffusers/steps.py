"""Denoising-step tracking from the transformer's ``timestep`` argument, for ``bf16_steps``."""

import inspect
from collections.abc import Collection

import torch


class StepTracker:
    """Forward pre-hook that numbers denoising steps by the timesteps the transformer is called with.

    Calls with the same timestep (classifier-free guidance run as two calls) share a step; a smaller timestep
    starts the next step; a larger one starts a new generation at step 0.

    ``watched_step`` is ``step`` when it is one of ``watched`` (the config's ``bf16_steps``), else None: the policy
    reads it rather than ``step`` because torch.compile guards on every value the traced code reads, and a guard
    on ``step`` would recompile the model at every step; this one changes only where the routing does.

    While a CUDA graph is being captured the step is left as it is: reading the timestep would synchronise with
    the device, which capture forbids, and a captured graph replays the backends chosen at capture anyway.
    """

    def __init__(self, watched: Collection[int] = ()):
        self.watched = frozenset(watched)
        self.step: int | None = None
        self.watched_step: int | None = None
        self._last: float | None = None

    # Reading the timestep's value needs the host: run eagerly under torch.compile rather than break the graph.
    @torch.compiler.disable
    def __call__(self, module, args, kwargs) -> None:
        timestep = kwargs.get("timestep")
        if timestep is None:
            # Passed by position: its place differs (Wan: 2nd; LTX, CogVideoX, Mochi: 3rd).
            names = list(inspect.signature(module.forward).parameters)
            if "timestep" in names and names.index("timestep") < len(args):
                timestep = args[names.index("timestep")]
        if timestep is None or _capturing_cuda_graph():
            return
        value = float(torch.as_tensor(timestep).flatten()[0])
        if self._last is None or value > self._last:
            self.step = 0
        elif value < self._last:
            self.step += 1
        self._last = value
        self.watched_step = self.step if self.step in self.watched else None


def _capturing_cuda_graph() -> bool:
    # is_initialized first: without CUDA (or before its first use) nothing can be capturing.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
