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

    A timestep on the GPU takes a synchronization to read, and the GPU then idles while the host catches up. So
    the hook reads it at once only where steps are watched; otherwise it keeps a copy, and ``step`` reads the
    copies when asked (or every ``PENDING_LIMIT`` forwards, which bounds what it keeps).

    While a CUDA graph is being captured the step is left as it is: reading the timestep would synchronise with
    the device, which capture forbids, and a captured graph replays the backends chosen at capture anyway.
    """

    PENDING_LIMIT = 256
    """Timesteps kept unread at most: one synchronization per this many forwards bounds what a tracker holds."""

    def __init__(self, watched: Collection[int] = ()):
        self.watched = frozenset(watched)
        self.watched_step: int | None = None
        self._step: int | None = None
        self._last: float | None = None
        self._pending: list[torch.Tensor] = []

    @property
    def step(self) -> int | None:
        """The current denoising step (None before the first forward with a timestep)."""
        self._read_pending()
        return self._step

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
        # A copy, not a view: the pipeline's tensor may change before it is read.
        self._pending.append(torch.as_tensor(timestep).flatten()[0].clone())
        if self.watched:
            self._read_pending()
            self.watched_step = self._step if self._step in self.watched else None
        elif len(self._pending) >= self.PENDING_LIMIT:
            self._read_pending()

    def _read_pending(self) -> None:
        """Number the steps of the timesteps kept since the last read: one synchronization for all of them."""
        if not self._pending:
            return
        device = self._pending[0].device
        values = torch.stack([t.to(device, torch.float64) for t in self._pending]).tolist()
        self._pending.clear()
        for value in values:
            if self._last is None or value > self._last:
                self._step = 0
            elif value < self._last:
                self._step += 1
            self._last = value


def _capturing_cuda_graph() -> bool:
    # is_initialized first: without CUDA (or before its first use) nothing can be capturing.
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
