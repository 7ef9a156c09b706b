"""Time Open-VC FP8 ExpCast attention against FP8 and BF16 peers (FlashAttention-3 and -4, cuDNN) on one GPU.

    python examples/bench_attention.py                       # the four video shapes, JSON to bench_attention.json
    python examples/bench_attention.py --shapes 32760x12 --json out.json
    python examples/bench_attention.py --repair                # V residual repair and K smoothing sweep
    python examples/bench_attention.py --inputs outputs/qkv.safetensors   # real activations (examples/capture.py)

Per shape (batch 1, head dim 128, N(0, 1) bf16 inputs, two input sets rotated), in a random order, these methods:

    openvc_kernel           the Open-VC kernel on inputs prepared before timing (openvc_kernels.attention_prepared)
    openvc_prepare          the preparation alone (openvc_kernels.prepare: quantization and packing; no TFLOP/s)
    openvc_api              the complete call with the API's defaults (openvc_kernels.attention: no repair or smoothing)
    openvc_default          the complete call with the processor's defaults (OpenVCConfig().kernel_options)
    fa3_fp8_prequantized    FlashAttention-3 FP8 (fa3-fwd) on E4M3 inputs with per-head descales made before timing
    fa3_fp8_call            the same with its per-head absmax quantization in PyTorch inside the timed call
    cudnn_fp8_prequantized  cuDNN's FP8 SDPA graph (nvidia-cudnn-frontend) on E4M3 inputs with per-tensor descales made
                            before timing; FP8 output (on Hopper cuDNN writes no other), its scale set once per shape
                            from one call on the first inputs; the graph is built once per shape, outside the timing
    fa4_bf16                FlashAttention-4 BF16 (flash-attn-4)
    fa3_bf16                FlashAttention-3 BF16 (fa3-fwd)
    cudnn_bf16              torch SDPA on its cuDNN backend, BF16

Quantization: FA3 FP8 takes E4M3 Q, K, V scaled by 448 over their absmax per batch item and head, with (B, H) FP32
descales; cuDNN FP8 the same per tensor, with P scaled by P_SCALE and the output by a power of two set per shape.

Each method is timed twice, back to back, then synchronized, each over about TIMED_MS of calls (at least MIN_CALLS)
after a warm-up call: "back_to_back" is the median of CUDA-event-timed calls enqueued back to back and synchronized
once (as in a pipeline, the host launches ahead, so per-call launch overhead is not timed unless it starves the
GPU); "synced" the median of calls each made alone (synchronize, event, call, event, synchronize), so the host's
launch time counts. TFLOP/s = 4 S^2 H 128 / time. "host" is the host's time per call alone: HOST_CALLS calls
enqueued after a synchronize, timed on the host's clock, too few to fill the GPU's launch queue, so the host never
waits for the GPU (where the GPU is the faster, the synchronized time is about this). SM and memory clocks are read before the run and right after
each timing of each method (the clocks it ran at: the H200 holds its power cap by lowering the SM clock).
Accuracy: every attention method's output on the first input set against float64 attention on sampled query rows
(FP8 output dequantized first), and the processor-default call against FA4 on all rows. A method whose package is
missing is reported once as unavailable (the package and how to get it) and left out; one that fails on some
inputs keeps its error in the JSON and the others go on.

JSON (--json): "meta" (GPU, torch and its cuDNN, clocks before and after, the processor's kernel options, the
peers' versions, the unavailable methods) and one row per shape: "order", then "ms", "tflops" and "clocks_after"
per timing and method, "host_ms" and "rel_l2_vs_float64" per method, "rel_l2_vs_fa4" (openvc_default),
"interleaved" and "errors". The table printed last has one line per shape and method. Before it: what the defaults
cost over the API call per shape, from the two methods' own timings ("apart") and from "interleaved", openvc_api and
openvc_default timed once more call by call in turn, both ways, so that each round's pair runs at one clock (under
the power cap the SM clock moves between two methods' timings, and the comparison is about 2%).

--inputs FILE times the same methods on the Q, K, V that examples/capture.py saved (one row per captured layer
and step, its own tensors every call; float32 captures are cast to bf16; TFLOP/s = 4 B Sq Sk H D / time).

--repair instead sweeps V residual repair (rho in REPAIR_RATIOS ranked by residual energy, and rho = 0.005 with the
"attention" ranking) with and without K smoothing at (73397, 7) and (75600, 40) on three kinds of inputs:
N(0, 1), V with heavy-tailed (log-normal) token norms, and K with a few channels carrying large offsets; per
setting the complete call's time (back to back, the median of three rounds that visit the settings in shuffled
order) and its rel-L2 against float64 attention on sampled query rows. The peers take no part in the sweep.
"""

import argparse
import functools
import importlib
import importlib.metadata
import json
import math
import os
import random
import re
import statistics
import sys
import time
import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from openvc_diffusers import cli
from openvc_diffusers.config import OpenVCConfig
from openvc_diffusers.gpu_state import clocks
from openvc_diffusers.metrics import rel_l2
from openvc_kernels import attention, attention_prepared, prepare
from openvc_kernels.quant import ABSMAX_FLOOR, FP8_MAX
from openvc_kernels.support import HEAD_DIM

SHAPES = "73397x7,32760x12,75600x40,118800x24"
"""MiniMax-H3 8-way Ulysses shard, Wan2.1-1.3B 480p, Wan 14B 720p, HunyuanVideo 720p (tokens x heads)."""
INPUT_SETS = 2
TIMED_MS = 1500
MIN_CALLS = 5
MIN_ROUNDS = 15
"""Rounds ``time_interleaved`` runs at least: its figure is a median of per-round ratios, which the power cap's clock
moves by a few percent, and at 118,800 x 24 (about 150 ms a call) the time budget alone would give 5."""
HOST_CALLS = 16
"""Calls whose host time is taken: their launches (a few dozen each) stay well inside the GPU's queue of about a
thousand, so enqueueing them never waits for the GPU."""
SAMPLED_ROWS = 256

METHODS = (
    "openvc_kernel",
    "openvc_prepare",
    "openvc_api",
    "openvc_default",
    "fa3_fp8_prequantized",
    "fa3_fp8_call",
    "cudnn_fp8_prequantized",
    "fa4_bf16",
    "fa3_bf16",
    "cudnn_bf16",
)
"""Every method, in the table's order (they run in a random one)."""
TIMINGS = ("back_to_back", "synced")
PAIRED = ("openvc_api", "openvc_default")
"""The API call and the processor's defaults, timed once more interleaved, call by call (``time_interleaved``): what
the defaults cost over the API, with the SM clock's drift under the power cap weighing on both alike."""

PEER_MODULES = {
    "fa4_bf16": "flash_attn.cute",
    "fa3_bf16": "fa3_fwd_interface",
    "fa3_fp8_prequantized": "fa3_fwd_interface",
    "fa3_fp8_call": "fa3_fwd_interface",
    "cudnn_fp8_prequantized": "cudnn",
}
"""The methods that need a package beyond torch and this project: the module each imports."""
PEER_PACKAGES = {
    "flash_attn.cute": ("flash-attn-4", 'pip install -e ".[fa4]"'),
    "fa3_fwd_interface": ("fa3-fwd", "pip install fa3-fwd==0.0.3 (FlashAttention-3 forward, Hopper)"),
    "cudnn": ("nvidia-cudnn-frontend", "pip install nvidia-cudnn-frontend==1.32.0"),
}
"""Each optional module's package (its distribution name) and how to get it."""

P_SCALE = 256.0
"""cuDNN's FP8 softmax scale: P = exp(s - rowmax) <= 1 times 256 stays below E4M3's 448 even where a P rounds above 1,
and a power of two scales exactly."""
O_TARGET = FP8_MAX / 2
"""cuDNN FP8's output scale puts the first input set's output absmax within a factor 2 below this: headroom for the
other input set."""


def log(message: str) -> None:
    print(message, flush=True)


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def attention_flop(q: torch.Tensor, k: torch.Tensor) -> float:
    """4 B Sq Sk H D: the two matrix products of (B, S, H, D) attention."""
    batch, s_q, heads, dim = q.shape
    return 4.0 * batch * s_q * k.shape[1] * heads * dim


def calls_for(fn, args, budget_ms: float) -> int:
    """How many calls of ``fn(*args)`` fill about ``budget_ms``, from one CUDA-event-timed call after a warm-up."""
    fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    end.synchronize()
    return max(MIN_CALLS, round(budget_ms / start.elapsed_time(end)))


def time_ms(fn, sets, budget_ms: float = TIMED_MS) -> float:
    """Median of per-call CUDA-event times over about ``budget_ms`` of calls rotating through ``sets``, after a
    warm-up call. The calls are enqueued back to back and synchronized once: the host launches ahead of the GPU,
    as in a pipeline, so per-call launch overhead (many small PyTorch ops, FA4's Python) is not timed unless it
    starves the GPU."""
    calls = calls_for(fn, sets[0], budget_ms)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_ms_synced(fn, sets, budget_ms: float = TIMED_MS) -> float:
    """As ``time_ms``, but each call alone: synchronize, event, call, event, synchronize. The GPU starts idle, so
    the host's launch time (Python wrappers, small PyTorch ops) counts wherever the GPU waits for it."""
    calls = calls_for(fn, sets[0], budget_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(calls):
        torch.cuda.synchronize()
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(fn, sets) -> float:
    """The host's time per call, in ms, over HOST_CALLS calls enqueued after a synchronize (``HOST_CALLS``)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(HOST_CALLS):
        fn(*sets[i % len(sets)])
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e3


def time_interleaved(fns: list, sets, timing: str, budget_ms: float = TIMED_MS) -> list[list[float]]:
    """Per-call CUDA-event times of each of ``fns``, called in turn over about ``budget_ms`` of calls in all (at least
    ``MIN_ROUNDS`` rounds): round i calls each once, in the given order for even i and reversed for odd i (neither
    always first), on input set i % len(sets). Back to back the calls are synchronized once at the end
    (``time_ms``); synchronized each one alone (``time_ms_synced``). Round i's times are entry i of each list."""
    rounds = max(MIN_ROUNDS, calls_for(fns[0], sets[0], budget_ms / len(fns)))
    for fn in fns[1:]:
        fn(*sets[0])  # warm-up
    synced = timing == "synced"
    events = []
    for i in range(rounds):
        for j in range(len(fns)) if i % 2 == 0 else reversed(range(len(fns))):
            if synced:
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[j](*sets[i % len(sets)])
            end.record()
            events.append((j, start, end))
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for j, start, end in events:
        times[j].append(start.elapsed_time(end))
    return times


def median_over(times: list[float], base: list[float]) -> float:
    """How much longer ``times`` took than ``base``, timed interleaved (``time_interleaved``): the median over rounds
    of the ratio within a round, minus 1."""
    return statistics.median(t / b for t, b in zip(times, base)) - 1


def bench_interleaved(setups: dict, row: dict) -> None:
    """``PAIRED`` timed interleaved both ways into ``row["interleaved"][timing]``: each one's median ms and
    "defaults_over_api", the median over rounds of the defaults' time over the API's in the same round, minus 1."""
    made = [setups[name]() for name in PAIRED]
    interleaved = {}
    for timing in TIMINGS:
        api, default = time_interleaved([m.call for m in made], made[0].arg_sets, timing)
        over = median_over(default, api)
        ms = {name: statistics.median(t) for name, t in zip(PAIRED, (api, default))}
        interleaved[timing] = {"ms": ms, "defaults_over_api": over}
        log(f"  interleaved {timing:12s} api {ms['openvc_api']:9.3f} ms, defaults {ms['openvc_default']:9.3f} ms: "
            f"defaults over api {100 * over:+.2f}% (then: {clocks()})")
    row["interleaved"] = interleaved  # both timings or none


def timed(timing: str, fn, sets) -> float:
    return time_ms(fn, sets) if timing == "back_to_back" else time_ms_synced(fn, sets)


def sampled_exact(q, k, v, rows: torch.Tensor) -> torch.Tensor:
    """Float64 attention of batch item 0 for the query rows ``rows``, one head at a time: (1, len(rows), H, D)."""
    out = []
    for h in range(q.shape[2]):
        qh, kh, vh = q[0, rows, h].double(), k[0, :, h].double(), v[0, :, h].double()
        p = torch.softmax(qh @ kh.T * q.shape[-1] ** -0.5, dim=-1)
        out.append(p @ vh)
    return torch.stack(out, dim=1)[None]


class Unavailable(Exception):
    """A method's package does not import; the message names the package and how to get it."""


@functools.cache
def peer(module: str):
    """The optional module ``module`` (a key of PEER_PACKAGES), imported once."""
    if module == "cudnn":
        # The frontend dlopens libcudnn.so.9 (LD_LIBRARY_PATH, then nvidia/cudnn in this Python's site-packages,
        # then by soname): with torch's cuDNN loaded first the soname lookup finds the library torch runs on.
        torch.backends.cudnn.version()
    try:
        return importlib.import_module(module)
    except Exception as e:  # not installed, or its compiled library does not load (OSError, RuntimeError)
        package, how = PEER_PACKAGES[module]
        raise Unavailable(f"{package} does not import ({type(e).__name__}: {e}); {how}") from None


def peer_versions() -> dict[str, str | None]:
    """The installed version of each optional package (None: not installed)."""
    versions = {}
    for package, _ in PEER_PACKAGES.values():
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def available_methods() -> tuple[list[str], dict[str, str]]:
    """The methods whose packages import, and for each of the others why not."""
    unavailable = {}
    for name, module in PEER_MODULES.items():
        try:
            peer(module)
        except Unavailable as e:
            unavailable[name] = str(e)
    return [name for name in METHODS if name not in unavailable], unavailable


def report_unavailable(unavailable: dict[str, str]) -> None:
    """One line per missing package, naming the methods left out."""
    by_reason = {}
    for name, reason in unavailable.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        log(f"unavailable, left out: {', '.join(names)}: {reason}")


def quantize_e4m3(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` times 448 / its absmax over ``dims``, cast to E4M3, and the FP32 descale (absmax / 448) that undoes it,
    shaped as the absmax with ``dims`` kept."""
    # The floor keeps an all-zero slice's scale finite (448 / 0 is inf, and 0 * inf NaN).
    amax = x.abs().amax(dim=dims, keepdim=True).float().clamp_min(ABSMAX_FLOOR)
    # The product of the absmax itself lands within a float32 rounding of 448, which the cast rounds to 448.
    return (x * (FP8_MAX / amax)).to(torch.float8_e4m3fn), amax / FP8_MAX


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) to E4M3 with one scale per batch item and head; the descales as FA3 takes them, (B, H) FP32."""
    x8, descale = quantize_e4m3(x, dims=(1, 3))
    return x8, descale.reshape(x.shape[0], x.shape[2])


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S, H, D) to E4M3 with one scale; the descale as cuDNN takes it, (1, 1, 1, 1) FP32."""
    return quantize_e4m3(x, dims=(0, 1, 2, 3))


def run_fa4(q, k, v):
    out = peer("flash_attn.cute").flash_attn_func(q, k, v)
    return out[0] if isinstance(out, tuple) else out


def run_fa3(q, k, v):
    return peer("fa3_fwd_interface").flash_attn_func(q, k, v)


def run_fa3_fp8(q8, k8, v8, q_descale, k_descale, v_descale):
    """FA3 on E4M3 (B, S, H, D) inputs with (B, H) descales; BF16 out."""
    return peer("fa3_fwd_interface").flash_attn_func(
        q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
    )


def fa3_fp8_inputs(q, k, v) -> list[torch.Tensor]:
    """Q, K, V quantized per head, then their descales: ``run_fa3_fp8``'s arguments."""
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantize_per_head(x) for x in (q, k, v))
    return [q8, k8, v8, q_descale, k_descale, v_descale]


def run_fa3_fp8_call(q, k, v):
    return run_fa3_fp8(*fa3_fp8_inputs(q, k, v))


def run_cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def cudnn_fp8_inputs(q, k, v) -> list[torch.Tensor]:
    """Q, K, V quantized per tensor, then their descales: ``CudnnFp8Attention``'s arguments."""
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantize_per_tensor(x) for x in (q, k, v))
    return [q8, k8, v8, q_descale, k_descale, v_descale]


class CudnnFp8Attention:
    """cuDNN's FP8 SDPA graph (nvidia-cudnn-frontend) for the shapes of ``cudnn_fp8_inputs(q, k, v)``, built here,
    on the current stream. A call takes those inputs and returns the E4M3 output, (B, S_q, H, D) like q, scaled by
    ``o_scale``: that scale is set here from a call on these inputs, a power of two putting their output's absmax
    within a factor 2 below O_TARGET (delayed scaling, as FP8 recipes set it from earlier calls' amax)."""

    def __init__(self, q8, k8, v8, q_descale, k_descale, v_descale):
        cudnn = peer("cudnn")
        self.handle = cudnn.create_handle()
        weakref.finalize(self, cudnn.destroy_handle, self.handle)
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
        e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(
            io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=self.handle
        )

        def bhsd(name, x):  # cuDNN's (B, H, S, D) over our (B, S, H, D) memory
            b, s, h, d = x.shape
            return graph.tensor(name=name, dim=[b, h, s, d], stride=[s * h * d, d, h * d, 1], data_type=e4m3)

        def scalar(name):
            return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)

        self.inputs = [bhsd(name, x) for name, x in zip("qkv", (q8, k8, v8))]
        self.inputs += [scalar(f"descale_{name}") for name in "qkv"]
        s_descale, s_scale, o_scale = scalar("descale_s"), scalar("scale_s"), scalar("scale_o")
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            **dict(zip(("q", "k", "v", "descale_q", "descale_k", "descale_v"), self.inputs)),
            descale_s=s_descale,
            scale_s=s_scale,
            scale_o=o_scale,
            generate_stats=False,
            attn_scale=q8.shape[-1] ** -0.5,
        )
        b, s, h, d = q8.shape
        o.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1]).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph = graph
        self.workspace = torch.empty(graph.get_workspace_size(), device=q8.device, dtype=torch.uint8)
        self.out = torch.empty(q8.shape, device=q8.device, dtype=torch.float8_e4m3fn)
        one = torch.ones(1, 1, 1, 1, device=q8.device)
        self.o_scale = 1 / v_descale  # 448 / max |V|: no output, a mean of V rows, exceeds 448 at this scale
        self.fixed = {
            s_descale: one / P_SCALE,
            s_scale: one * P_SCALE,
            o_scale: self.o_scale,
            o: self.out,
            amax_s: torch.empty_like(one),
            amax_o: torch.empty_like(one),
        }
        absmax = self.dequantize(self(q8, k8, v8, q_descale, k_descale, v_descale)).abs().max().item()
        if not 0 < absmax < math.inf:
            raise RuntimeError(f"cuDNN FP8 SDPA's output has absmax {absmax}")
        self.o_scale.fill_(2.0 ** math.floor(math.log2(O_TARGET / absmax)))

    def __call__(self, *args):
        self.graph.execute({**self.fixed, **dict(zip(self.inputs, args))}, self.workspace, handle=self.handle)
        return self.out

    def dequantize(self, out8: torch.Tensor) -> torch.Tensor:
        return out8.float() / self.o_scale


class Setup(NamedTuple):
    """A method made ready to time: the call, its argument sets (one per input set), and how to read its result
    as attention output (None: it has none)."""

    call: Callable
    arg_sets: list
    output: Callable | None = lambda out: out


def cudnn_fp8_setup(sets) -> Setup:
    arg_sets = [cudnn_fp8_inputs(*s) for s in sets]
    sdpa = CudnnFp8Attention(*arg_sets[0])
    return Setup(sdpa, arg_sets, sdpa.dequantize)


def method_setups(sets: list[list[torch.Tensor]]) -> dict[str, Callable[[], Setup]]:
    """Each method's setup on ``sets``: made inside the method's own try, since some refuse some inputs (the Hopper
    kernel's preparation) or need a package that may be missing."""
    q = sets[0][0]
    out = torch.empty_like(q)
    default_options = OpenVCConfig().kernel_options
    return {
        "openvc_kernel": lambda: Setup(
            lambda p: attention_prepared(p, out, softmax_scale=q.shape[-1] ** -0.5), [[prepare(*s)] for s in sets]
        ),
        "openvc_prepare": lambda: Setup(prepare, sets, output=None),
        "openvc_api": lambda: Setup(attention, sets),
        "openvc_default": lambda: Setup(lambda *qkv: attention(*qkv, **default_options), sets),
        "fa3_fp8_prequantized": lambda: Setup(run_fa3_fp8, [fa3_fp8_inputs(*s) for s in sets]),
        "fa3_fp8_call": lambda: Setup(run_fa3_fp8_call, sets),
        "cudnn_fp8_prequantized": lambda: cudnn_fp8_setup(sets),
        "fa4_bf16": lambda: Setup(run_fa4, sets),
        "fa3_bf16": lambda: Setup(run_fa3, sets),
        "cudnn_bf16": lambda: Setup(run_cudnn, sets),
    }


def bench_shape(seq: int, heads: int, methods=METHODS) -> dict:
    sets = [
        [torch.randn(1, seq, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for _ in range(INPUT_SETS)
    ]
    return bench_sets(sets, {"seq": seq, "heads": heads, "label": f"{seq}x{heads}"}, methods)


def bench_method(name: str, make_setup, flop: float, rows: torch.Tensor, row: dict):
    """Time one method both ways into ``row``; its output's sampled ``rows`` (batch item 0, first input set), or
    None where it has no output or failed (the error then in ``row["errors"]``)."""
    try:
        setup = make_setup()
        for timing in TIMINGS:
            ms = row["ms"][timing][name] = timed(timing, setup.call, setup.arg_sets)
            row["clocks_after"][timing][name] = at = clocks()  # read as the timed calls end: the load's clocks
            rate = ""
            if setup.output is not None:  # the preparation has no attention FLOPs: a rate would mean nothing
                row["tflops"][timing][name] = tflops(flop, ms)
                rate = f"{row['tflops'][timing][name]:6.0f} TFLOP/s"
            log(f"  {name:22s} {timing:12s} {ms:9.3f} ms {rate:14s} (then: {at})")
        row["host_ms"][name] = host_ms(setup.call, setup.arg_sets)
        log(f"  {name:22s} {'host':12s} {row['host_ms'][name]:9.3f} ms per call")
        if setup.output is None:
            return None
        return setup.output(setup.call(*setup.arg_sets[0]))[:1, rows].float()
    except Exception as e:  # inputs a method cannot take, a peer failing at run time: keep the rest
        row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
        log(f"  {name:22s} failed: {row['errors'][name]}")
        return None


def bench_sets(sets: list[list[torch.Tensor]], row: dict, methods=METHODS) -> dict:
    """Every method of ``methods`` on ``sets`` (rotated; each a (q, k, v) of one shape) in random order, then the
    accuracy on the first set; the numbers are added to ``row``."""
    q, k, v = sets[0]
    flop = attention_flop(q, k)
    setups = method_setups(sets)
    order = random.sample(list(methods), len(methods))
    row.update(order=order, **{key: {timing: {} for timing in TIMINGS} for key in ("ms", "tflops", "clocks_after")})
    row["host_ms"] = {}
    rows = torch.randint(0, q.shape[1], (SAMPLED_ROWS,), device=q.device)
    sampled = {name: bench_method(name, setups[name], flop, rows, row) for name in order}
    if all(name in order and name not in row.get("errors", {}) for name in PAIRED):
        try:
            bench_interleaved(setups, row)
        except Exception as e:  # as in bench_method: keep the rest of the row
            row.setdefault("errors", {})["interleaved"] = f"{type(e).__name__}: {e}"
            log(f"  interleaved failed: {row['errors']['interleaved']}")

    exact = sampled_exact(q, k, v, rows)
    row["rel_l2_vs_float64"] = {name: rel_l2(out, exact) for name, out in sampled.items() if out is not None}
    if sampled.get("openvc_default") is not None and sampled.get("fa4_bf16") is not None:
        options = OpenVCConfig().kernel_options
        row["rel_l2_vs_fa4"] = rel_l2(attention(q, k, v, **options), run_fa4(q, k, v))
    return row


CAPTURE_FORMAT = "openvc-qkv/1"
CAPTURED_NAME = re.compile(r"step(\d+)\.layer(\d+)\.([qkv])")


def check_captured(path: str) -> None:
    """Raises ValueError unless ``path`` is an examples/capture.py file, from its header (no tensors read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            found = (f.metadata() or {}).get("format")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a safetensors file ({e})") from None
    if found != CAPTURE_FORMAT:
        raise ValueError(f"{path} is not an examples/capture.py file: format {found!r}, expected {CAPTURE_FORMAT!r}")


def load_captured(path: str) -> list[tuple[str, list[torch.Tensor]]]:
    """``(name, [q, k, v])`` per captured step and layer of an examples/capture.py file ("step0.layer15"), in
    step-then-layer order, on the CPU as saved."""
    from safetensors.torch import load_file

    check_captured(path)
    entries = {}
    for key, tensor in load_file(path).items():
        match = CAPTURED_NAME.fullmatch(key)
        if match is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} (expected names like 'step0.layer15.q')")
        entries.setdefault((int(match[1]), int(match[2])), {})[match[3]] = tensor
    for (step, layer), qkv in entries.items():
        if sorted(qkv) != ["k", "q", "v"]:
            raise ValueError(f"{path}: step{step}.layer{layer} has {sorted(qkv)}, expected q, k and v")
    return [(f"step{step}.layer{layer}", [qkv[x] for x in "qkv"]) for (step, layer), qkv in sorted(entries.items())]


def bench_captured(path: str, methods=METHODS) -> list[dict]:
    rows = []
    for name, qkv in load_captured(path):
        q, k, v = (x.to("cuda", torch.bfloat16 if x.dtype == torch.float32 else x.dtype) for x in qkv)
        batch, s_q, heads, dim = q.shape
        log(f"{name}: B={batch} Sq={s_q} Sk={k.shape[1]} H={heads} D={dim} {q.dtype}")
        label = {"name": name, "batch": batch, "seq": s_q, "seq_k": k.shape[1], "heads": heads, "label": name}
        rows.append(bench_sets([[q, k, v]], label, methods))
        torch.cuda.empty_cache()
    return rows


REPAIR_SHAPES = "73397x7,75600x40"
REPAIR_RATIOS = (0.0, 0.0025, 0.005, 0.01, 0.02)
REPAIR_INPUTS = ("normal", "heavy-tailed V", "K offsets")
REPAIR_TIMED_MS = 900
REPAIR_ROUNDS = 3
ATTENTION_RANKING_RATIO = 0.005
"""The sweep ranks by residual energy (the default); the "attention" ranking is timed at this rho only."""


def repair_inputs(kind: str, seq: int, heads: int) -> list[torch.Tensor]:
    q, k, v = (torch.randn(1, seq, heads, HEAD_DIM, device="cuda") for _ in range(3))
    if kind == "heavy-tailed V":
        v = v * torch.exp(1.5 * torch.randn(1, seq, heads, 1, device="cuda"))  # log-normal token norms
    elif kind == "K offsets":
        channels = torch.randperm(HEAD_DIM, device="cuda")[:4]
        k[..., channels] += 8.0 * torch.randn(1, 1, heads, 4, device="cuda")
    return [x.bfloat16() for x in (q, k, v)]


def bench_repair(seq: int, heads: int) -> list[dict]:
    """Every setting on each kind of inputs: its error once, its time as the median of REPAIR_ROUNDS medians taken
    in shuffled round-robin order, so that the clock drifting under the power cap weighs on every setting alike."""
    rows = []
    for kind in REPAIR_INPUTS:
        q, k, v = repair_inputs(kind, seq, heads)
        sampled = torch.randint(0, seq, (SAMPLED_ROWS,), device="cuda")
        exact = sampled_exact(q, k, v, sampled)
        rankings = [(ratio, "energy") for ratio in REPAIR_RATIOS] + [(ATTENTION_RANKING_RATIO, "attention")]
        settings = [
            dict(repair_ratio=ratio, repair_ranking=ranking, smooth_k=smooth_k)
            for smooth_k in (False, True)
            for ratio, ranking in rankings
        ]
        times = {i: [] for i in range(len(settings))}
        for _ in range(REPAIR_ROUNDS):
            for i in random.sample(range(len(settings)), len(settings)):
                call = lambda q, k, v, options=settings[i]: attention(q, k, v, **options)
                times[i].append(time_ms(call, [[q, k, v]], REPAIR_TIMED_MS / REPAIR_ROUNDS))
        for i, options in enumerate(settings):
            ms = statistics.median(times[i])
            error = rel_l2(attention(q, k, v, **options)[:, sampled], exact)
            rows.append(dict(seq=seq, heads=heads, inputs=kind, ms=ms, rel_l2=error, **options))
            log(
                f"  {kind:14s} smooth_k={options['smooth_k']!s:5s} rho={options['repair_ratio']:<6} "
                f"{options['repair_ranking']:9s} {ms:8.2f} ms  rel-L2 vs f64 {error:.4f}"
            )
    return rows


def repair_table(rows: list[dict]) -> str:
    """Each setting against rho = 0 with the same inputs and K smoothing: time and error changes."""
    head = (
        f"{'S x H':>11} | {'inputs':>14} | smooth_k | {'rho':>6} | {'ranking':>9} | {'ms':>8} | {'+ms %':>6} | "
        f"{'L2 vs f64':>9} | {'L2 change':>9}"
    )
    lines = [head, "-" * len(head)]
    base = {(r["seq"], r["inputs"], r["smooth_k"]): r for r in rows if r["repair_ratio"] == 0.0}
    for r in rows:
        b = base[r["seq"], r["inputs"], r["smooth_k"]]
        lines.append(
            f"{r['seq']:>6}x{r['heads']:<4} | {r['inputs']:>14} | {r['smooth_k']!s:>8} | {r['repair_ratio']:6.4f} | "
            f"{r['repair_ranking']:>9} | "
            f"{r['ms']:8.2f} | {100 * (r['ms'] / b['ms'] - 1):+6.1f} | {r['rel_l2']:9.4f} | "
            f"{100 * (r['rel_l2'] / b['rel_l2'] - 1):+8.1f}%"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """One line per shape and method that ran: per timing its ms, TFLOP/s and FA4 BF16's time over its own ("x
    FA4"), its host time per call, then its rel-L2 against float64 on the sampled rows."""
    width = max([11, *(len(r["label"]) for r in rows)])  # capture labels ("step12.layer29") run longer than S x H
    short = {"back_to_back": "b2b", "synced": "synced"}
    timings = " | ".join(f"{'ms ' + short[timing]:>9} {'TFLOP/s':>7} {'x FA4':>5}" for timing in TIMINGS)
    head = f"{'S x H':>{width}} | {'method':22} | {timings} | {'host ms':>7} | {'L2 vs f64':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in [name for name in METHODS if name in r["order"]]:
            cells = " | ".join(timing_cells(r, timing, name) for timing in TIMINGS)
            host = r["host_ms"].get(name)
            host = "" if host is None else f"{host:7.3f}"
            lines.append(f"{r['label']:>{width}} | {name:22} | {cells} | {host:>7} | {accuracy_cell(r, name):>9}".rstrip())
    return "\n".join(lines)


def overhead_table(rows: list[dict]) -> str:
    """What the processor's defaults cost over the API call, per shape and timing: from the two methods' own
    medians (timed apart, each at its own clock) and interleaved (``bench_interleaved``); rows without the
    interleaved timing are left out (empty: none has it)."""
    rows = [r for r in rows if "interleaved" in r]
    if not rows:
        return ""
    width = max([11, *(len(r["label"]) for r in rows)])
    cells = " | ".join(f"{timing + ' ' + how:>20}" for timing in TIMINGS for how in ("apart", "interleaved"))
    lines = [f"{'S x H':>{width}} | defaults over API: {cells}"]
    for r in rows:
        over = []
        for timing in TIMINGS:
            api, default = (r["ms"][timing].get(name) for name in PAIRED)
            over.append("" if None in (api, default) else f"{100 * (default / api - 1):+.2f}%")
            over.append(f"{100 * r['interleaved'][timing]['defaults_over_api']:+.2f}%")
        lines.append(f"{r['label']:>{width}} | {'':18} " + " | ".join(f"{cell:>20}" for cell in over))
    return "\n".join(lines)


def timing_cells(row: dict, timing: str, name: str) -> str:
    ms, rate = row["ms"][timing].get(name), row["tflops"][timing].get(name)
    if ms is None:
        return f"{'failed':>9} {'':7} {'':5}"
    fa4 = row["ms"][timing].get("fa4_bf16")
    speedup = f"{fa4 / ms:5.2f}" if fa4 is not None and rate is not None else ""
    return f"{ms:9.3f} {'' if rate is None else f'{rate:7.0f}':>7} {speedup:>5}"


def accuracy_cell(row: dict, name: str) -> str:
    if name in row["rel_l2_vs_float64"]:
        return f"{row['rel_l2_vs_float64'][name]:.4f}"
    return "failed" if name in row.get("errors", {}) else ""


def shapes(text: str) -> list[tuple[int, int]]:
    """An argparse type: comma-separated SxH, tokens x heads, such as 32760x12."""
    out = []
    for part in text.split(","):
        seq, _, heads = part.partition("x")
        try:
            out.append((cli.positive_int(seq), cli.positive_int(heads)))
        except argparse.ArgumentTypeError:
            where = f" in {text!r}" if part != text else ""
            raise argparse.ArgumentTypeError(
                f"{part!r}{where} is not SxH: tokens x heads, both >= 1, such as 32760x12"
            ) from None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        type=shapes,
        help=f"comma-separated SxH (default: {SHAPES}; with --repair: {REPAIR_SHAPES})",
    )
    parser.add_argument(
        "--json",
        type=cli.writable_file,
        default="bench_attention.json",
        help="where to write the rows (default: %(default)s)",
    )
    parser.add_argument("--seed", type=cli.seed, default=0, help="order of the methods and the inputs")
    parser.add_argument("--repair", action="store_true", help="the V residual repair and K smoothing sweep")
    parser.add_argument("--inputs", metavar="FILE", help="time on Q, K, V saved by examples/capture.py instead")
    args = parser.parse_args(argv)
    if args.inputs and args.repair:
        parser.error("--inputs and --repair do not combine: the repair sweep draws its own inputs")
    if args.inputs and args.shapes:
        parser.error("--inputs and --shapes do not combine: the captured tensors have their own shapes")
    if args.inputs and not os.path.isfile(args.inputs):
        parser.error(f"--inputs {args.inputs}: no such file (examples/capture.py writes one)")
    try:
        if args.inputs:
            check_captured(args.inputs)
    except ValueError as e:
        parser.error(f"--inputs {e}")
    if args.shapes is None:
        args.shapes = [] if args.inputs else shapes(REPAIR_SHAPES if args.repair else SHAPES)
    return args


def start_run(script: str, seed: int) -> dict:
    """Exit unless there is a CUDA GPU; seed Python's and torch's generators; the run's metadata (GPU, torch, the
    clocks before), logged."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (Hopper for Open-VC)")
    random.seed(seed)
    torch.manual_seed(seed)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "clocks_before": clocks()}
    log(f"{meta['gpu']}, clocks (sm, mem, temp, power) before: {meta['clocks_before']}")
    return meta


def finish_run(meta: dict, rows: list[dict], path: str) -> None:
    """The clocks after into ``meta``, logged; ``meta`` and ``rows`` written to ``path`` as JSON."""
    meta["clocks_after"] = clocks()
    log(f"clocks after: {meta['clocks_after']}")
    cli.create_parent(path)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    meta = start_run("bench_attention.py", args.seed)
    methods = METHODS
    if not args.repair:
        methods, meta["unavailable"] = available_methods()
        report_unavailable(meta["unavailable"])
        meta["openvc_default_options"] = OpenVCConfig().kernel_options
        meta["peers"] = peer_versions()
        meta["torch_cudnn"] = torch.backends.cudnn.version()
    rows = bench_captured(args.inputs, methods) if args.inputs else []
    for seq, heads in args.shapes:
        log(f"S={seq} H={heads}")
        if args.repair:
            rows.extend(bench_repair(seq, heads))
        else:
            rows.append(bench_shape(seq, heads, methods))
        torch.cuda.empty_cache()
    finish_run(meta, rows, args.json)
    if args.repair:
        log(repair_table(rows))
    else:
        overheads = overhead_table(rows)
        if overheads:
            log(overheads)
        log(table(rows))
    return rows


if __name__ == "__main__":
    main()
