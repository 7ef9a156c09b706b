"""Denoising-step tracking from the transformer's ``timestep`` argument, for ``bf16_steps``."""

import torch


class StepTracker:
    """Forward pre-hook that numbers denoising steps by the timesteps the transformer is called with.

    Calls with the same timestep (classifier-free guidance run as two calls) share a step; a smaller timestep
    starts the next step; a larger one starts a new generation at step 0.
    """

    def __init__(self):
        self.step: int | None = None
        self._last: float | None = None

    def __call__(self, module, args, kwargs) -> None:
        timestep = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if timestep is None:
            return
        value = float(torch.as_tensor(timestep).flatten()[0])
        if self._last is None or value > self._last:
            self.step = 0
        elif value < self._last:
            self.step += 1
        self._last = value

