"""Save the Q, K and V of chosen self-attention layers and denoising steps, exactly as the attention call sees
them, to benchmark and test attention kernels on real activations.

    python examples/capture.py                                          # tiny random Wan: layer 0, step 0
    python examples/capture.py --model Wan-AI/Wan2.1-T2V-1.3B-Diffusers --layers 0,15,29 --steps 0,25-26

`examples/bench_attention.py --inputs FILE` times the kernel against FA4 and cuDNN on such a file (the format below).
The pipeline runs with diffusers' stock attention (--config to run it through Open-VC instead) and stops as soon
as everything asked for is captured. The captured tensors are held in CPU memory until the file is written: one
Wan 480p layer-step (32,760 tokens, 12 heads, bfloat16) is 3 x 100 MB.

File format (safetensors): read the tensors with `safetensors.torch.load_file(path, device=...)` and the
metadata with `safetensors.safe_open(path, "pt").metadata()`.

  tensors   "step{t}.layer{l}.q", "step{t}.layer{l}.k" and "step{t}.layer{l}.v" for each captured step t and
            layer l, both 0-based. Layers are numbered as Open-VC's bf16_layers numbers them: self-attention
            layers (joint video+text attention included) in the order they first run. Each tensor is contiguous
            (B, S, H, D): batch, tokens, heads, head dim; in the dtype the attention call got (bfloat16 with
            --model; float32 for the tiny model on the CPU). q and k are taken after the QK norms and the rotary
            embedding, before any scaling: the call computes softmax(q k^T / sqrt(D)) v over all keys, no mask,
            not causal. k and v have the same shape; their S equals q's except in joint attention with padded
            text (HunyuanVideo), where only the valid keys are kept, as Open-VC gets them. Of the calls a layer
            gets in one step, the first is kept: in Wan, the text-conditioned pass of classifier-free guidance.
  metadata  string values only:
            "format"               "openvc-qkv/1"
            "model"                the --model hub id or folder, or "tiny" for the tiny random Wan
            "prompt", "seed"       the pipeline call that produced them
            "num_inference_steps"  length of the denoising schedule ("default": the pipeline's own)
            "steps", "layers"      the captured indices, comma-separated ints ("0,25,26")
            "layout"               "BSHD"
            "dtype"                torch dtype name without "torch.", e.g. "bfloat16"
            "shapes"               JSON object: tensor name -> [B, S, H, D]
"""

import argparse
import json
import sys

import torch
from openvc_kernels.rotary import rotate_qk
from safetensors.torch import save_file

from openvc_diffusers import cli
from openvc_diffusers.pipelines import (
    TINY_STEPS,
    ModelNotAvailableError,
    add_pipeline_arguments,
    call_kwargs,
    check_pipeline_arguments,
    install,
    load_pipeline,
    steps_kwargs,
)

FORMAT = "openvc-qkv/1"
# diffusers' stock attention, so the captured activations are those of an unmodified run.
STOCK_CONFIG = {"backends": ["sdpa"]}


# No video pipeline has this many layers or denoising steps; the bound keeps a range such as 0-1000000000 from
# filling memory with the indices it names.
MAX_INDEX = 999


def indices(text: str) -> list[int]:
    """'0,2,5-7' -> [0, 2, 5, 6, 7]."""
    out = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            start, stop = int(first), int(last or first)
        except ValueError:
            start = stop = -1
        if not 0 <= start <= stop <= MAX_INDEX:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected indices 0-{MAX_INDEX} and ranges a-b with a <= b, such as 0,2,5-7"
            )
        out.update(range(start, stop + 1))
    return sorted(out)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pipeline_arguments(parser)
    parser.add_argument(
        "--layers", type=indices, default=[0], help="self-attention layers 0-999, e.g. 0,15,28-29 (default: 0)"
    )
    parser.add_argument(
        "--steps", type=indices, default=[0], help="denoising steps within the schedule, e.g. 0,25-26 (default: 0)"
    )
    parser.add_argument(
        "--num-inference-steps",
        type=cli.positive_int,
        help=f"length of the denoising schedule (default: {TINY_STEPS} with --tiny, the pipeline's own with --model)",
    )
    parser.add_argument(
        "--config", type=cli.single_process_config, help="YAML config to run the pipeline through Open-VC (default: stock attention)"
    )
    parser.add_argument(
        "--output",
        type=cli.writable_file,
        default="outputs/qkv.safetensors",
        help="file to write (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    check_pipeline_arguments(parser, args)
    check_steps_in_schedule(parser, args)
    return args


def check_steps_in_schedule(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--steps within the schedule, where its length is known before the pipeline is loaded."""
    schedule = steps_kwargs(args, args.num_inference_steps).get("num_inference_steps")
    if schedule is None:  # the pipeline's own default, known once it is loaded
        return
    beyond = [step for step in args.steps if step >= schedule]
    if beyond:
        parser.error(
            f"argument --steps: {', '.join(map(str, beyond))} past the end of the {schedule}-step denoising schedule "
            f"(steps 0-{schedule - 1}); --num-inference-steps sets its length"
        )


class CaptureComplete(Exception):
    """Everything asked for is captured: the rest of the run is not needed."""


class Capture:
    """Mixin for a family's Open-VC processor (see ``pipelines.install``): copies q, k, v of the wanted
    (step, layer) self-attention calls to the CPU, then attends as configured."""

    def __init__(self, config=None, *, layers: list[int], steps: list[int]):
        super().__init__(config)
        self.wanted = {(step, layer) for step in steps for layer in layers}
        self.tensors: dict[str, torch.Tensor] = {}

    def _attend(self, attn, q, k, v, *, is_cross: bool, **kwargs) -> torch.Tensor:
        if not is_cross:
            layer = self._layer(attn)
            if (self.step, layer) in self.wanted:
                masking = {name: kwargs[name] for name in ("attn_mask", "valid_len", "pad_queries") if name in kwargs}
                # The rotary embedding the backend would apply later (inside Open-VC's preparation), applied here.
                rotary = kwargs.get("rotary")
                kept_q, kept_k = (q, k) if rotary is None else rotate_qk(q, k, *rotary)
                self._keep(f"step{self.step}.layer{layer}", kept_q, kept_k, v, **masking)
                self.wanted.remove((self.step, layer))
                if not self.wanted:
                    raise CaptureComplete
        return super()._attend(attn, q, k, v, is_cross=is_cross, **kwargs)

    def _keep(self, prefix, q, k, v, attn_mask=None, valid_len=None, pad_queries=False) -> None:
        if valid_len is not None:
            # Joint attention with padded text (HunyuanVideo): the valid keys, and queries, that Open-VC gets.
            q, k, v = q[:, :valid_len] if pad_queries else q, k[:, :valid_len], v[:, :valid_len]
        elif attn_mask is not None:
            raise ValueError(f"{prefix}: this call has an attention mask; capture.py saves unmasked attention only")
        for name, x in zip("qkv", (q, k, v)):
            self.tensors[f"{prefix}.{name}"] = x.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def capture(pipe, args) -> dict[str, torch.Tensor]:
    processor = install(pipe, Capture, args.config or STOCK_CONFIG, layers=args.layers, steps=args.steps)
    try:
        with torch.no_grad():
            pipe(**call_kwargs(args), **steps_kwargs(args, args.num_inference_steps), output_type="latent")
    except CaptureComplete:
        return processor.tensors
    missing = ", ".join(f"step {step} layer {layer}" for step, layer in sorted(processor.wanted))
    sys.exit(
        f"not captured: {missing}. The run had {processor.step + 1} denoising steps and "
        f"{processor.layer_count} self-attention layers."
    )


def metadata(args, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        "format": FORMAT,
        "model": args.model or "tiny",
        "prompt": args.prompt,
        "seed": str(args.seed),
        "num_inference_steps": str(steps_kwargs(args, args.num_inference_steps).get("num_inference_steps", "default")),
        "steps": ",".join(map(str, args.steps)),
        "layers": ",".join(map(str, args.layers)),
        "layout": "BSHD",
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch."),
        "shapes": json.dumps({name: list(x.shape) for name, x in tensors.items()}),
    }


def main(argv=None) -> dict[str, torch.Tensor]:
    args = parse_args(argv)
    try:
        pipe = load_pipeline(args.model, args.device)
    except ModelNotAvailableError as e:
        sys.exit(str(e))

    tensors = capture(pipe, args)
    cli.create_parent(args.output)
    save_file(tensors, args.output, metadata=metadata(args, tensors))
    for name, x in tensors.items():
        print(f"{name}: {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}")
    print(f"wrote {args.output}")
    return tensors


if __name__ == "__main__":
    main()
