"""Denoising-step tracking from the transformer's ``timestep`` argument, for ``bf16_steps``."""

import inspect

import torch


class StepTracker:
    """Forward pre-hook that numbers denoising steps by the timesteps the transformer is called with.

    Calls with the same timestep (classifier-free guidance run as two calls) share a step; a smaller timestep
    starts the next step; a larger one starts a new generation at step 0.
    """

    def __init__(self):
        self.step: int | None = None
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
        if timestep is None:
            return
        value = float(torch.as_tensor(timestep).flatten()[0])
        if self._last is None or value > self._last:
            self.step = 0
        elif value < self._last:
            self.step += 1
        self._last = value

