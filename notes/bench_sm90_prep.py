"""Time the sm90 preparation at Wan 14B 720p (S = 75,600, H = 40, bf16) against a device copy; prints JSON.

Run on a Hopper GPU: ``python notes/bench_sm90_prep.py``. Bytes count reads plus writes. Besides the four
launches: K smoothing (channel mean + centered K launch) and each step of V residual repair at rho = 0.005
(PackV with energies, the attention-mass estimate, choosing the tokens: the kernel and PyTorch's reference, and
both kernel variants on rows of Wan 480p's S = 32,760, which the resident one holds in shared memory; writing the
repair keys).
"""

import faulthandler
import json

import torch

from openvc_kernels import prep_ops as prep
from openvc_kernels.preparation import PrepareOptions, write_repair_rows
from openvc_kernels.quant import BLOCK, num_blocks, quantize_per_block, quantize_per_head
from openvc_kernels.repair import (
    MASS_SAMPLE_ROWS,
    attention_mass,
    choose_repair_tokens,
    repair_count,
    select_repair_tokens,
)
from openvc_kernels.sm90.layout import PV_N, pack_v

BATCH, SEQ_LEN, HEADS, HEAD_DIM = 1, 75_600, 40, 128
ITERS = 20
REPAIR_RATIO = 0.005
TAU = HEAD_DIM**-0.5
SHORT_LEN = 32_760
"""Wan 480p's S: a row the resident variant of the tokens' choice takes (<= ``RESIDENT_MAX_TOKENS``)."""
WATCHDOG_S = 120
"""A hung launch prints every thread's Python stack and exits instead of holding the GPU."""


def _ms(fn) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(ITERS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / ITERS


def main() -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    print(json.dumps({"device": torch.cuda.get_device_name()}), flush=True)
    shape = (BATCH, SEQ_LEN, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = prep.prepare(q, k, v)
    torch.cuda.synchronize()
    print(json.dumps({"compiled and ran": True}), flush=True)
    amax = torch.zeros(BATCH, HEADS, device="cuda")
    unit_amax = torch.ones(BATCH, HEADS, device="cuda")
    x_bytes = q.numel() * q.element_size()
    s_pad = num_blocks(SEQ_LEN) * BLOCK
    x8_bytes = BATCH * HEADS * s_pad * HEAD_DIM
    packed_bytes = BATCH * HEADS * PV_N * s_pad

    copy_dst = torch.empty_like(q)
    energy = torch.empty(BATCH, HEADS, SEQ_LEN, device="cuda")
    mean_k = prep.channel_mean(k)
    count = repair_count(SEQ_LEN, REPAIR_RATIO)
    tokens = choose_repair_tokens(energy.normal_(), count, q, k, ranking="energy", softmax_scale=TAU)
    select_out = torch.empty_like(tokens)
    short = energy[..., :SHORT_LEN].contiguous()
    short_out = torch.empty(BATCH, HEADS, repair_count(SHORT_LEN, REPAIR_RATIO), dtype=torch.int64, device="cuda")
    assert prep.select_kind(SHORT_LEN) == "select_repair_tokens_resident"
    repaired = prep.prepare(q, k, v, PrepareOptions(repair_ratio=REPAIR_RATIO))
    kernels = {
        "copy (torch, one input)": (lambda: copy_dst.copy_(q), 2 * x_bytes),
        "quantize_q (Q)": (
            lambda: prep.load_prep("quantize_q", q.dtype)(q, out.q8, out.d_q, None),
            x_bytes + x8_bytes,
        ),
        "absmax_per_head (V)": (lambda: prep.load_prep("absmax_per_head", v.dtype)(v, amax), x_bytes),
        "pack_v (V)": (
            lambda: prep.load_prep("pack_v", v.dtype)(v, unit_amax, out.v_packed, out.d_v, None),
            x_bytes + packed_bytes,
        ),
        "prepare (all four)": (lambda: prep.prepare_into(q, k, v, out), 4 * x_bytes + 2 * x8_bytes + packed_bytes),
        "smooth_k: channel mean (two launches)": (lambda: prep.channel_mean(k), x_bytes),
        "smooth_k: quantize_centered_per_block (K)": (
            lambda: prep.load_prep("quantize_centered_per_block", k.dtype)(k, out.k8, out.d_k, mean_k),
            x_bytes + x8_bytes,
        ),
        "repair: pack_v_energy (V)": (
            lambda: prep.load_prep("pack_v_energy", v.dtype)(v, unit_amax, out.v_packed, out.d_v, energy),
            x_bytes + packed_bytes + energy.numel() * 4,
        ),
        "repair: attention_mass (torch)": (
            lambda: attention_mass(q.transpose(1, 2), k.transpose(1, 2), TAU),
            x_bytes + 4 * 4 * BATCH * HEADS * MASS_SAMPLE_ROWS * SEQ_LEN,
        ),
        "repair: select_repair_tokens (kernel)": (
            lambda: prep.load_prep("select_repair_tokens")(energy, select_out), energy.numel() * 4
        ),
        "repair: select_repair_tokens (kernel, S = 32,760)": (
            lambda: prep.load_prep("select_repair_tokens")(short, short_out), short.numel() * 4
        ),
        "repair: select_repair_tokens_resident (kernel, S = 32,760)": (
            lambda: prep.load_prep("select_repair_tokens_resident")(short, short_out), short.numel() * 4
        ),
        "repair: select_repair_tokens (torch reference)": (
            lambda: select_repair_tokens(energy, count), energy.numel() * 4
        ),
        "repair: write_repair_rows": (lambda: write_repair_rows(repaired, v, tokens), 0),
        "prepare, rho=0.005 energy ranking": (
            lambda: prep.prepare(q, k, v, PrepareOptions(repair_ratio=REPAIR_RATIO, repair_ranking="energy")), 0
        ),
        "prepare, rho=0.005 attention ranking": (
            lambda: prep.prepare(q, k, v, PrepareOptions(repair_ratio=REPAIR_RATIO, repair_ranking="attention")), 0
        ),
        "prepare, smooth_k": (lambda: prep.prepare(q, k, v, PrepareOptions(smooth_k=True)), 0),
    }
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep.prepare_into(q, k, v, out)
    kernels["prepare, CUDA graph replay"] = (graph.replay, kernels["prepare (all four)"][1])
    print(json.dumps({"captured": True}), flush=True)

    def torch_reference():
        quantize_per_block(q.transpose(1, 2))
        quantize_per_block(k.transpose(1, 2))
        pack_v(quantize_per_head(v.transpose(1, 2))[0])

    for name, (fn, nbytes) in kernels.items():
        ms = _ms(fn)
        rate = {"GB/s": round(nbytes / ms / 1e6, 1)} if nbytes else {}
        print(json.dumps({name: {"ms": round(ms, 4), **rate}}), flush=True)
    print(json.dumps({"torch reference prepare": {"ms": round(_ms(torch_reference), 3)}}), flush=True)


if __name__ == "__main__":
    main()
