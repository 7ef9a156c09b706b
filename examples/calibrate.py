"""Measure how far Open-VC's attention output is from BF16 attention in each self-attention layer, and write
a config that keeps the layers above --threshold in BF16.

    python examples/calibrate.py                                   # tiny random Wan, no download
    python examples/calibrate.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --config configs/default.yaml

Runs one denoising step: the first of any schedule, at the highest noise level. Each self-attention call runs
twice on the same q, k, v: through the backend the config's policy picks for the layer (ignoring its bf16_layers
and bf16_steps, so that every layer is measured) and through diffusers' stock attention. The model goes on with
the stock output, so every layer sees the inputs it would see in BF16 and its error is its own. A layer's error is
rel-L2 = ||O_openvc - O_bf16|| / ||O_bf16|| over all its calls (both classifier-free guidance passes), per head
and over all heads.

Prints a table and writes to --output:
  calibrated.yaml    --config (default: the defaults; {min_tokens: 0} with --tiny) with bf16_layers set to the
                     layers above --threshold; load it with openvc_diffusers.load_config or pass it to generate.py
  calibration.png    rel-L2 per layer with its heads as dots (needs matplotlib:
                     pip install "openvc-diffusers[examples]")
The layers of a second transformer (Wan 2.2 A14B's low-noise expert) do not run in the first step and are not
measured.
"""

import argparse
import dataclasses
import os
import sys

import torch
import yaml
from tqdm.auto import tqdm

from openvc_diffusers import cli, load_config
from openvc_diffusers.pipelines import (
    TINY_CONFIG,
    ModelNotAvailableError,
    add_pipeline_arguments,
    call_kwargs,
    check_pipeline_arguments,
    install,
    load_pipeline,
)

# diffusers' own attention for every call, which is what Open-VC is measured against.
STOCK_CONFIG = {"backends": ["sdpa"]}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_arguments(parser)
    parser.add_argument(
        "--config", type=cli.single_process_config, help="YAML config to start from; its bf16_layers are replaced by the measured ones"
    )
    # Open-VC's error on real video-model activations is about 3% rel-L2: twice that marks an outlier layer.
    parser.add_argument(
        "--threshold",
        type=cli.nonnegative_float,
        default=0.06,
        help="a rel-L2 >= 0: layers whose Open-VC rel-L2 is above this are kept in BF16 (default: %(default)s)",
    )
    parser.add_argument(
        "--output",
        type=cli.writable_dir,
        default="outputs",
        help="directory for calibrated.yaml and calibration.png (default: outputs)",
    )
    args = parser.parse_args(argv)
    check_pipeline_arguments(parser, args)
    return args


class LayerError:
    """Squared error and squared reference norm of one layer's attention output, per head, over its calls."""

    def __init__(self, backend: str, tokens: int, heads: int):
        self.backend, self.tokens = backend, tokens
        self.error = torch.zeros(heads, dtype=torch.float64)
        self.norm = torch.zeros(heads, dtype=torch.float64)

    def add(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        # (B, S, H, D): reduce all but the heads, accumulating in float64.
        self.error += (out.float() - ref.float()).square().sum(dim=(0, 1, 3), dtype=torch.float64).cpu()
        self.norm += ref.float().square().sum(dim=(0, 1, 3), dtype=torch.float64).cpu()

    @property
    def rel_l2(self) -> float:
        return (self.error.sum() / self.norm.sum()).sqrt().item()

    @property
    def rel_l2_per_head(self) -> list[float]:
        return (self.error / self.norm).sqrt().tolist()


class Calibration:
    """Mixin for a family's Open-VC processor (see ``pipelines.install``): the model runs on stock attention, and
    every self-attention call also runs through Open-VC on the same inputs, its difference recorded per head."""

    def __init__(self, config=None, *, progress: tqdm):
        super().__init__(STOCK_CONFIG)
        # Every layer is measured, including those the starting config keeps in BF16.
        self.measured = dataclasses.replace(load_config(config), bf16_layers=frozenset(), bf16_steps=frozenset())
        self.layers: dict[int, LayerError] = {}
        self.progress = progress

    def _attend(self, attn, q, k, v, *, is_cross: bool, **kwargs) -> torch.Tensor:
        ref = super()._attend(attn, q, k, v, is_cross=is_cross, **kwargs)
        if is_cross:
            return ref
        # The base class routes by self.config: the same call again, routed as Open-VC would route it.
        stock, before = self.config, self.calls.copy()
        self.config = self.measured
        try:
            out = super()._attend(attn, q, k, v, is_cross=False, **kwargs)
        finally:
            self.config = stock
        ((_, backend),) = self.calls - before
        layer = self._layer(attn)
        if layer not in self.layers:
            self.layers[layer] = LayerError(backend, q.shape[1], q.shape[2])
        self.layers[layer].add(out.unflatten(-1, (q.shape[2], -1)), ref.unflatten(-1, (q.shape[2], -1)))
        self.progress.update()
        return ref


def measure(pipe, config, args) -> dict[int, LayerError]:
    """Per-layer errors of Open-VC against stock attention over one denoising step."""
    pipe.set_progress_bar_config(disable=True)  # one step: the per-call bar says more
    with tqdm(desc="self-attention calls", unit="call") as progress, torch.no_grad():
        processor = install(pipe, Calibration, config, progress=progress)
        pipe(**call_kwargs(args), num_inference_steps=1, output_type="latent")
    return dict(sorted(processor.layers.items()))


def print_table(errors: dict[int, LayerError], threshold: float) -> None:
    backend_width = max(len("backend"), *(len(e.backend) for e in errors.values()))
    print(f"layer  {'backend':<{backend_width}}  tokens   rel-L2  worst head  BF16 (> {threshold:g})")
    for layer, e in errors.items():
        heads = e.rel_l2_per_head
        worst = max(range(len(heads)), key=heads.__getitem__)
        keep = "yes" if e.rel_l2 > threshold else ""
        row = f"{layer:5d}  {e.backend:<{backend_width}}  {e.tokens:6d}  {e.rel_l2:7.4f}"
        print(f"{row}  {worst:3d}: {heads[worst]:.4f}  {keep}")


def plot_errors(errors: dict[int, LayerError], threshold: float, path: str) -> bool:
    """Bar chart of rel-L2 per layer, heads as dots; False (with a note) when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print('note: no plot written: matplotlib is not installed (pip install "openvc-diffusers[examples]")')
        return False
    layers = list(errors)
    fig = Figure(figsize=(max(6, 0.25 * len(layers) + 2), 4), layout="constrained")
    ax = fig.subplots()
    colors = ["tab:red" if errors[layer].rel_l2 > threshold else "tab:blue" for layer in layers]
    ax.bar(layers, [errors[layer].rel_l2 for layer in layers], color=colors)
    for layer in layers:
        heads = errors[layer].rel_l2_per_head
        ax.scatter([layer] * len(heads), heads, s=6, color="black", zorder=3)
    ax.axhline(
        threshold, color="tab:red", linestyle="--", linewidth=1, label=f"threshold {threshold:g}: red layers stay BF16"
    )
    ax.set(
        xlabel="self-attention layer", ylabel="rel-L2 vs BF16", title="Open-VC attention error per layer (dots: heads)"
    )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend()
    fig.savefig(path, dpi=120)
    return True


def write_config(config, errors: dict[int, LayerError], args, path: str):
    """``config`` with bf16_layers = the layers above the threshold, as YAML with a comment on how it was made."""
    kept = frozenset(layer for layer, e in errors.items() if e.rel_l2 > args.threshold)
    calibrated = dataclasses.replace(config, bf16_layers=kept)
    header = (
        f"# Written by examples/calibrate.py from one denoising step of {args.model or 'the tiny random Wan'}:\n"
        f"# self-attention layers whose Open-VC output is more than rel-L2 {args.threshold:g} from BF16's\n"
        "# stay in BF16.\n"
    )
    with open(path, "w") as f:
        f.write(header + yaml.safe_dump(calibrated.to_dict(), sort_keys=False))
    return calibrated


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = load_config(args.config or (TINY_CONFIG if args.model is None else None))
    try:
        pipe = load_pipeline(args.model, args.device)
    except ModelNotAvailableError as e:
        sys.exit(str(e))

    errors = measure(pipe, config, args)
    print_table(errors, args.threshold)
    os.makedirs(args.output, exist_ok=True)
    written = [os.path.join(args.output, "calibrated.yaml")]
    calibrated = write_config(config, errors, args, written[0])
    if plot_errors(errors, args.threshold, os.path.join(args.output, "calibration.png")):
        written.append(os.path.join(args.output, "calibration.png"))
    print(f"bf16_layers: {sorted(calibrated.bf16_layers)}")
    print(f"wrote {', '.join(written)}")
    return {"rel_l2": {layer: e.rel_l2 for layer, e in errors.items()}, "config": calibrated}


if __name__ == "__main__":
    main()
