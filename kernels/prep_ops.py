"""Host side of the fused preparation (``sm90.prep``; the descale guards, ``sm90.guards``; the repair tokens'
choice, ``sm90.select``): compiling its kernels, and running them on torch tensors.

Compilation is once per (kernel, input dtype) (once per kernel for ``DTYPE_FREE_KINDS``), shapes and strides
symbolic, no GPU needed (``compile_cache`` keeps the compiled kernels). ``prepare`` writes the bytes of
``preparation.prepare_reference`` on the current stream.
"""

import functools
from typing import Callable, NamedTuple

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint8

from .compile_cache import load_or_compile
from .preparation import REPAIR_ROOM_ALIGN, Prepared, PrepareOptions, preparation_may_rotate, repair_room
from .quant import BLOCK, code_span_numerator, mean_tokens, num_blocks, softmax_scale_or_default
from .repair import repair_count, repair_score
from .rotary import TABLE_ALIGN, kernel_table
from .sm90.guards import DescaleGuards
from .sm90.layout import HEAD_DIM, PV_N
from .sm90.prep import (
    AbsmaxAndChannelSums, AbsmaxPerHead, ChannelMean, ChannelSumsPerBlock, PackV, QuantizePerBlock, RepairRows
)
from .sm90.rotary_quant import AbsmaxAndRotatedChannelSums, RotaryQuantizeQK
from .sm90.select import RESIDENT_MAX_TOKENS, SelectRepairTokens
from .sm90.target import COMPILE_OPTIONS, row_major_fake

INPUT_ALIGN = 16
"""Bytes: the vector width of every global access of the preparation kernels."""
TORCH_TO_CUTLASS = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}

PREP_KINDS = (
    "channel_sums_per_block", "channel_mean", "quantize_q", "quantize_per_block", "quantize_centered_per_block",
    "absmax_per_head", "absmax_and_channel_sums", "pack_v", "pack_v_energy", "select_repair_tokens",
    "select_repair_tokens_resident", "repair_rows", "descale_guards", "absmax_and_rotated_channel_sums",
    "rotary_quantize_qk", "rotary_quantize_qk_centered",
)
"""The compiled kernels: K's channel mean in two passes (smooth_k), quantize Q (starting beside the launch before
it: ``sm90.dependent_launch``), quantize K, K minus its channel mean,
V's absmax (alone, or with the mean's first pass over K), packed V without and with the residual energies, for V
residual repair the choice of its tokens (reading the score row from global memory in every pass, or, for
S <= ``RESIDENT_MAX_TOKENS``, once into shared memory: ``select_kind``) and their repair keys, and the descale
guards (``sm90.guards``); where the preparation applies the rotary embedding (``prepare(rotary=...)``), V's absmax
with the first pass of the rotated keys' mean, and Q and K rotated and quantized in one launch (K minus its
channel mean, or not; ``sm90.rotary_quant``)."""
DTYPE_FREE_KINDS = ("channel_mean", "select_repair_tokens", "select_repair_tokens_resident", "descale_guards")
"""Kernels that never read the fp16/bf16 inputs (only FP32 sums, scores or descales): compiled once, for no input
dtype (None)."""


SELECT_KINDS = ("select_repair_tokens", "select_repair_tokens_resident")
"""The two variants of ``sm90.select.SelectRepairTokens``, the same tokens bit for bit: the row streamed from global
memory (L2) in each of its six passes, or loaded once into shared memory (``resident``, for
S <= ``RESIDENT_MAX_TOKENS`` only)."""


def select_kind(seq_len: int) -> str:
    """The variant of the repair tokens' choice that ``prepare`` launches for rows of ``seq_len`` scores: resident
    (the keys in shared memory) where they fit, else streaming."""
    return "select_repair_tokens_resident" if seq_len <= RESIDENT_MAX_TOKENS else "select_repair_tokens"


def input_fake(dtype: type[cutlass.Numeric]):
    """(B, S, H, 128) with any 16-byte-multiple strides and a contiguous head dim."""
    shape = (cute.sym_int(), cute.sym_int(), cute.sym_int(), HEAD_DIM)
    stride = (*(cute.sym_int64(divisibility=INPUT_ALIGN // (dtype.width // 8)) for _ in range(3)), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=INPUT_ALIGN)


def table_fake():
    """A rotary table (S, 128) fp32: rows 16-byte aligned (``rotary.kernel_table``), contiguous within."""
    shape, stride = (cute.sym_int(), HEAD_DIM), (cute.sym_int64(divisibility=TABLE_ALIGN // 4), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=TABLE_ALIGN)


def _rows_fake(shape: tuple):
    """A uint8 output whose last dim is contiguous and whose other strides are free multiples of 16 bytes: a view
    of the real keys inside a buffer with room for repair keys."""
    stride = (*(cute.sym_int64(divisibility=INPUT_ALIGN) for _ in shape[:-1]), 1)
    return cute.runtime.make_fake_tensor(Uint8, shape, stride=stride, assumed_align=INPUT_ALIGN)


def load_prep(kind: str, dtype: torch.dtype | None = None):
    """``compile_prep(kind, dtype)``, compiled once per machine (``compile_cache``)."""
    return load_or_compile(_prep_name(kind, dtype), lambda: compile_prep(kind, dtype))


@functools.cache
def _prep_name(kind: str, dtype: torch.dtype | None) -> str:
    """The compile cache's name of a preparation kernel, spelled once: a call looks up about nine."""
    return f"prep_{kind}" if dtype is None else f"prep_{kind}_{str(dtype).removeprefix('torch.')}"


def compile_prep(kind: str, dtype: torch.dtype | None = None):
    """Compile one preparation kernel (one of ``PREP_KINDS``) for fp16 or bf16 inputs (``dtype``; None for the
    ``DTYPE_FREE_KINDS``), for sm_90a; no GPU needed."""
    if kind not in PREP_KINDS:
        raise ValueError(f"unknown preparation kernel {kind!r}; known: {', '.join(PREP_KINDS)}")
    if (dtype is None) != (kind in DTYPE_FREE_KINDS):
        raise ValueError(f"preparation kernel {kind!r} takes {'no' if dtype is not None else 'an'} input dtype")
    b, h, s_pad = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=BLOCK)
    per_head = row_major_fake(Float32, (b, h), 4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if kind == "channel_mean":
        sums = row_major_fake(Float32, (b, h, cute.sym_int(), HEAD_DIM), 16)
        mean = row_major_fake(Float32, (b, h, HEAD_DIM), 16)
        return cute.compile(ChannelMean(), sums, mean, Int32(1), stream, options=COMPILE_OPTIONS)
    if kind == "descale_guards":
        d_q, d_k = (row_major_fake(Float32, (b, h, cute.sym_int()), 4) for _ in range(2))
        return cute.compile(DescaleGuards(), d_q, d_k, per_head, Float32(1.0), stream, options=COMPILE_OPTIONS)
    if kind in SELECT_KINDS:
        score = row_major_fake(Float32, (b, h, cute.sym_int()), 4)
        tokens = row_major_fake(Int64, (b, h, cute.sym_int()), 8)
        select = SelectRepairTokens(resident=kind == "select_repair_tokens_resident")
        return cute.compile(select, score, tokens, stream, options=COMPILE_OPTIONS)
    x = input_fake(TORCH_TO_CUTLASS[dtype])
    if kind == "channel_sums_per_block":
        args = (ChannelSumsPerBlock(), x, row_major_fake(Float32, (b, h, cute.sym_int(), HEAD_DIM), 16))
    elif kind.startswith("quantize"):
        mean = row_major_fake(Float32, (b, h, HEAD_DIM), 16) if kind == "quantize_centered_per_block" else None
        x8, d = _rows_fake((b, h, s_pad, HEAD_DIM)), row_major_fake(Float32, (b, h, cute.sym_int()), 4)
        args = (QuantizePerBlock(beside_previous=kind == "quantize_q"), x, x8, d, mean)
    elif kind == "absmax_per_head":
        args = (AbsmaxPerHead(), x, per_head)
    elif kind == "absmax_and_channel_sums":
        sums = row_major_fake(Float32, (b, h, cute.sym_int(), HEAD_DIM), 16)
        args = (AbsmaxAndChannelSums(), x, input_fake(TORCH_TO_CUTLASS[dtype]), per_head, sums, None, None)
    elif kind == "absmax_and_rotated_channel_sums":
        sums = row_major_fake(Float32, (b, h, cute.sym_int(), HEAD_DIM), 16)
        k = input_fake(TORCH_TO_CUTLASS[dtype])
        args = (AbsmaxAndRotatedChannelSums(), x, k, per_head, sums, table_fake(), table_fake())
    elif kind.startswith("rotary_quantize_qk"):
        mean = row_major_fake(Float32, (b, h, HEAD_DIM), 16) if kind == "rotary_quantize_qk_centered" else None
        n_blocks = cute.sym_int()
        q8, k8 = (_rows_fake((b, h, s_pad, HEAD_DIM)) for _ in range(2))
        d_q, d_k = (row_major_fake(Float32, (b, h, n_blocks), 4) for _ in range(2))
        k = input_fake(TORCH_TO_CUTLASS[dtype])
        args = (RotaryQuantizeQK(), x, k, table_fake(), table_fake(), q8, d_q, k8, d_k, mean, Int32(1))
    elif kind == "repair_rows":
        s_all, n_k = cute.sym_int(divisibility=REPAIR_ROOM_ALIGN), cute.sym_int()
        repair_keys = cute.sym_int(divisibility=REPAIR_ROOM_ALIGN)
        args = (
            RepairRows(), x, per_head, row_major_fake(cutlass.Int64, (b, h, cute.sym_int()), 8),
            row_major_fake(Uint8, (b, h, s_all, HEAD_DIM), 16), row_major_fake(Float32, (b, h, n_k), 4),
            row_major_fake(Uint8, (b, h, PV_N, s_all), 16), per_head,
            row_major_fake(Float32, (b, h, repair_keys), 4), row_major_fake(cutlass.Int32, (b, h, repair_keys), 4),
        )
    else:
        energy = row_major_fake(Float32, (b, h, cute.sym_int()), 4) if kind == "pack_v_energy" else None
        args = (PackV(), x, per_head, _rows_fake((b, h, PV_N, s_pad)), row_major_fake(Float32, (b, h), 4), energy)
    return cute.compile(*args, stream, options=COMPILE_OPTIONS)



def kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels can read it in place (contiguous head dim, 16-byte strides and base);
    otherwise one contiguous copy. Where a stride is not a multiple of 8 elements (which the compiled kernels
    check), size-1 dims get stride 0: torch reports any stride there (and calls such a tensor contiguous)."""
    elems = INPUT_ALIGN // x.element_size()
    strides = x.stride()  # read once: each read is host time
    aligned = all(st % elems == 0 for st in strides[:3])
    if not aligned:
        x = x.as_strided(x.shape, [st if n > 1 else 0 for n, st in zip(x.shape, strides)])
        strides = x.stride()
        aligned = all(st % elems == 0 for st in strides[:3])
    in_place = strides[3] == 1 and aligned and x.data_ptr() % INPUT_ALIGN == 0
    return x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def empty_prepared(
    batch: int, seq_q: int, seq_k: int, heads: int, device: torch.device | str, *, repair_keys: int = 0
) -> Prepared:
    """Uninitialised outputs for ``prepare_into``, with room for ``repair_keys`` (``preparation.repair_room``) after
    the real keys."""
    n_q, n_k = num_blocks(seq_q), num_blocks(seq_k)
    empty = functools.partial(torch.empty, device=device)
    return Prepared(
        q8=empty(batch, heads, n_q * BLOCK, HEAD_DIM, dtype=torch.uint8),
        d_q=empty(batch, heads, n_q, dtype=torch.float32),
        k8=empty(batch, heads, n_k * BLOCK + repair_keys, HEAD_DIM, dtype=torch.uint8),
        d_k=empty(batch, heads, n_k, dtype=torch.float32),
        v_packed=empty(batch, heads, PV_N, n_k * BLOCK + repair_keys, dtype=torch.uint8),
        d_v=empty(batch, heads, dtype=torch.float32),
        d_k_repair=empty(batch, heads, repair_keys, dtype=torch.float32),
        tile_repair=empty(batch, heads, repair_keys, dtype=torch.int32),
        seqlen_k=seq_k,
    )


def prepare_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: Prepared,
    *,
    smooth_k: bool = False,
    residual_energy: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> Prepared:
    """``prepare``'s real keys into the buffers of ``out`` (from ``empty_prepared``), descale guards applied
    (``quant.apply_descale_guards``'s bytes, for ``softmax_scale``, default ``1 / sqrt(128)``); returns ``out``.
    ``residual_energy`` (B, H, S_k) fp32, where given, receives ``repair.residual_energy`` of every token.
    ``v_absmax`` (B, H) replaces V's absmax (its launch is skipped), ``k_mean`` (B, H, 128) the channel mean that
    K smoothing subtracts (``quant.smoothing_mean``).

    Five launches on the current stream (four with ``v_absmax``): V's absmax, pack V, quantize Q, quantize K, then
    the descale guards in place on ``out.d_q`` and ``out.d_v`` (``sm90.guards``); K smoothing without ``k_mean``
    adds K's mean before K's quantization: its first pass over K in V's absmax launch
    (``sm90.prep.AbsmaxAndChannelSums``; with ``v_absmax``, ``channel_mean``'s launch of its own), then one launch
    (``ChannelMean``). Nothing waits on the host, so a call can be captured in a CUDA graph.
    """
    kernels = load_kernels(q.dtype, smooth_k=smooth_k, energy=residual_energy is not None)
    ready_q, ready_k, ready_v = kernel_ready(q), kernel_ready(k), kernel_ready(v)
    k_for_sums = ready_k if smooth_k and k_mean is None else None
    amax_v, k_sums = _launch_absmax(kernels, ready_v, k_for_sums, v_absmax)
    _launch_pack(kernels, ready_v, amax_v, out, residual_energy)
    kernels.quantize_q(ready_q, out.q8, out.d_q, None)
    mean_k = smoothing_mean(ready_k, k_mean, k_sums) if smooth_k else None
    _launch_k(kernels, ready_k, out, mean_k, softmax_scale)
    return out


def channel_mean(k: torch.Tensor) -> torch.Tensor:
    """``quant.channel_mean`` of ``(B, S, H, 128)`` fp16/bf16 k, bit for bit, in two launches
    (``sm90.prep.ChannelSumsPerBlock``, ``ChannelMean``) on the current stream: ``(B, H, 128)`` FP32."""
    k = kernel_ready(k)
    sums = _empty_block_sums(k)
    load_prep("channel_sums_per_block", k.dtype)(k, sums)
    return _mean_of_block_sums(sums, k.shape[1])


def _empty_block_sums(k: torch.Tensor) -> torch.Tensor:
    """Room for ``ChannelSumsPerBlock``'s sums of ``(B, S, H, 128)`` k: ``(B, H, n_blocks, 128)`` FP32."""
    batch, seq_len, heads, _ = k.shape
    return torch.empty(batch, heads, num_blocks(seq_len), HEAD_DIM, dtype=torch.float32, device=k.device)


def _mean_of_block_sums(sums: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K's channel mean from its block sums, one launch (``sm90.prep.ChannelMean``): ``(B, H, 128)`` FP32."""
    mean = torch.empty(sums.shape[0], sums.shape[1], HEAD_DIM, dtype=torch.float32, device=sums.device)
    load_prep("channel_mean")(sums, mean, mean_tokens(seq_len))
    return mean


def smoothing_mean(
    k: torch.Tensor, k_mean: torch.Tensor | None = None, block_sums: torch.Tensor | None = None
) -> torch.Tensor:
    """``quant.smoothing_mean`` on the GPU: ``k_mean`` where given, else K's channel mean, from ``block_sums``
    where a launch wrote them already (``_launch_absmax``), else from k (``channel_mean``)."""
    if k_mean is not None:
        return k_mean.contiguous()
    return channel_mean(k) if block_sums is None else _mean_of_block_sums(block_sums, k.shape[1])


class PrepKernels(NamedTuple):
    """The five compiled kernels of ``prepare_into`` (``load_kernels``): Q's and K's quantization, V's absmax and
    packed V, the descale guards. Q's is launched right after packed V or the tokens' choice, whose launches wait
    for the kernels before them, into buffers allocated before them: the rule of a kernel that starts beside the
    launch before it (``sm90.dependent_launch``)."""

    quantize_q: Callable
    quantize_k: Callable
    absmax_v: Callable
    pack_v: Callable
    guards: Callable


def _launch_absmax(
    kernels: PrepKernels, v, k_for_sums, v_absmax, tables: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """V's absmax (B, H), unless ``v_absmax`` is given, from ``load_kernels``' ``kernels`` on ``kernel_ready`` v:
    ``(amax_v, sums)``. With ``k_for_sums`` (``kernel_ready`` k, whose channel mean is still to be reduced) and V's
    absmax to take, K's block sums come from the same launch (``sm90.prep.AbsmaxAndChannelSums``; of the keys
    rotated by the (S, 128) ``tables``, cos and sin, where given); else ``sums`` is None (``smoothing_mean`` then
    reduces k itself)."""
    if v_absmax is not None:
        return v_absmax.contiguous(), None
    amax_v = torch.zeros(v.shape[0], v.shape[2], dtype=torch.float32, device=v.device)
    if k_for_sums is None:
        kernels.absmax_v(v, amax_v)
        return amax_v, None
    sums = _empty_block_sums(k_for_sums)
    if tables is None:
        load_prep("absmax_and_channel_sums", v.dtype)(v, k_for_sums, amax_v, sums, None, None)
    else:
        load_prep("absmax_and_rotated_channel_sums", v.dtype)(v, k_for_sums, amax_v, sums, *tables)
    return amax_v, sums


def _launch_pack(kernels: PrepKernels, v, amax_v: torch.Tensor, out: Prepared, residual_energy) -> None:
    """Packed V and its descale into ``out``, with the residual energies where given, for V's absmax ``amax_v``."""
    s_pad = num_blocks(out.seqlen_k) * BLOCK
    kernels.pack_v(v, amax_v, out.v_packed[..., :s_pad], out.d_v, residual_energy)


def _launch_k(kernels: PrepKernels, k, out: Prepared, mean_k, softmax_scale) -> None:
    """K's quantization (K minus ``mean_k`` where given), then the descale guards, which read Q's and V's scales
    too: after Q's quantization and ``_launch_pack``."""
    s_pad = num_blocks(out.seqlen_k) * BLOCK
    kernels.quantize_k(k, out.k8[:, :, :s_pad], out.d_k, mean_k)
    _launch_guards(kernels, out, softmax_scale)


def _launch_guards(kernels: PrepKernels, out: Prepared, softmax_scale) -> None:
    """The descale guards in place on ``out``'s Q and V descales, which read every descale: after Q's, K's and V's
    quantization."""
    numerator = code_span_numerator(softmax_scale_or_default(softmax_scale, HEAD_DIM), HEAD_DIM)
    kernels.guards(out.d_q, out.d_k, out.d_v, numerator)


def load_kernels(dtype: torch.dtype, *, smooth_k: bool, energy: bool) -> PrepKernels:
    """The five compiled kernels of ``prepare_into`` (quantize Q, quantize K, V's absmax, pack V, the descale
    guards), for inputs of ``dtype``, K smoothing and residual energies (V residual repair) as given."""
    return PrepKernels(
        quantize_q=load_prep("quantize_q", dtype),
        quantize_k=load_prep("quantize_centered_per_block" if smooth_k else "quantize_per_block", dtype),
        absmax_v=load_prep("absmax_per_head", dtype),
        pack_v=load_prep("pack_v_energy" if energy else "pack_v", dtype),
        guards=load_prep("descale_guards"),
    )


def rotary_quantize_kind(smooth_k: bool) -> str:
    """The launch that rotates and quantizes Q and K (``sm90.rotary_quant.RotaryQuantizeQK``), K centered or not."""
    return "rotary_quantize_qk_centered" if smooth_k else "rotary_quantize_qk"


# CTAs per SM that ``RotaryQuantizeQK`` needs: two fit at once (its registers), and a third lets an SM whose CTA
# ends early start another while the slower ones finish (measured in notes/kernel.md, 2026-12-05, at Wan 480p).
ROTARY_CTAS_PER_SM = 3


@functools.cache
def head_groups(batch: int, seq_len: int, heads: int, device: torch.device) -> int:
    """G, the CTAs that share one block's heads in ``RotaryQuantizeQK`` (each walks ``heads / G`` of them and reads
    the block's angles): the fewest that give every SM ``ROTARY_CTAS_PER_SM`` CTAs. Each further group reads the
    angles once more, so no more than that."""
    ctas = ROTARY_CTAS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return min(heads, -(-ctas // (batch * num_blocks(seq_len))))


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: PrepareOptions = PrepareOptions(),
    *,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Prepared:
    """Quantize ``(B, S, H, 128)`` fp16/bf16 CUDA tensors q, k, v for the sm90 kernel, on the current stream.

    Byte-identical to ``preparation.prepare_reference`` with the same options, ``v_absmax`` and ``k_mean`` (the
    descale guards of ``quant.apply_descale_guards`` included; ``softmax_scale`` defaults to ``1 / sqrt(128)``),
    except that the repair tokens are ranked by residual energies summed in another order (the choice can differ
    where two tokens nearly tie). With repair: the five launches of ``prepare_into``, the ranking's ops (none for
    the "energy" ranking), one launch choosing the tokens (``sm90.select.SelectRepairTokens``, the rule of
    ``repair.select_repair_tokens``; its variant for S_k: ``select_kind``) and one for the repair keys
    (``sm90.prep.RepairRows``). The choice takes one SM per head; Q's quantization, launched next, starts beside it
    on the others (``sm90.dependent_launch``).
    Arguments are checked by the caller (``validation``, ``support``): same device, dtype, batch and heads.

    ``rotary``: the (1, S, 1, 128) FP32 tables, cos and sin, of a rotary embedding that q and k have not had yet
    (``rotary.rotate_qk``'s): the bytes of ``prepare`` on ``rotate_qk(q, k, *rotary)``, without the rotated q and
    k ever written. K's mean (with K smoothing) is then reduced before packed V, and one launch rotates and
    quantizes Q and K (``sm90.rotary_quant``) where Q's quantization starts otherwise. Nothing else may need the
    rotated q and k: the "energy" ranking, no ``v_absmax`` nor ``k_mean`` (else ``ValueError``); the caller checks
    the tables (``rotary.tables_reason``).
    """
    if rotary is not None and not preparation_may_rotate(options.repair_ranking, v_absmax, k_mean):
        raise ValueError(
            "prepare(rotary=...) rotates q and k only as it quantizes them, but the \"attention\" ranking, v_absmax "
            "and k_mean need them rotated: rotate first (rotary.rotate_qk)"
        )
    batch, seq_q, heads, _ = q.shape
    seq_k = k.shape[1]
    count = repair_count(seq_k, options.repair_ratio)
    kernels = load_kernels(q.dtype, smooth_k=options.smooth_k, energy=count > 0)
    ready_q, ready_k, ready_v = kernel_ready(q), kernel_ready(k), kernel_ready(v)
    tables = None if rotary is None else (kernel_table(rotary[0]), kernel_table(rotary[1]))
    k_for_sums = ready_k if options.smooth_k and k_mean is None else None
    # V's absmax first: the GPU reads V (and K) while the host makes the buffers.
    amax_v, k_sums = _launch_absmax(kernels, ready_v, k_for_sums, v_absmax, tables)
    # Rotated, Q and K are quantized beside the launch before them: K's mean must be there before that one.
    mean_k = smoothing_mean(ready_k, k_mean, k_sums) if options.smooth_k and tables is not None else None
    out = empty_prepared(batch, seq_q, seq_k, heads, q.device, repair_keys=repair_room(count))
    energy = torch.empty(batch, heads, seq_k, dtype=torch.float32, device=q.device) if count else None
    _launch_pack(kernels, ready_v, amax_v, out, energy)
    if count:
        score = repair_score(
            energy, ready_q, ready_k, ranking=options.repair_ranking, softmax_scale=options.softmax_scale
        ).contiguous()
        tokens = torch.empty(batch, heads, count, dtype=torch.int64, device=q.device)
        load_prep(select_kind(score.shape[-1]))(score, tokens)
    # Beside the choice, on the SMs it leaves idle (or beside packed V's last CTAs).
    if tables is None:
        kernels.quantize_q(ready_q, out.q8, out.d_q, None)
        mean_k = smoothing_mean(ready_k, k_mean, k_sums) if options.smooth_k else None
        _launch_k(kernels, ready_k, out, mean_k, options.softmax_scale)
    else:
        s_pad = num_blocks(seq_k) * BLOCK
        load_prep(rotary_quantize_kind(options.smooth_k), q.dtype)(
            ready_q, ready_k, *tables, out.q8, out.d_q, out.k8[:, :, :s_pad], out.d_k, mean_k,
            head_groups(batch, seq_k, heads, q.device),
        )
        _launch_guards(kernels, out, options.softmax_scale)
    if count:
        repair_rows = load_prep("repair_rows", v.dtype)
        repair_rows(
            ready_v, amax_v, tokens, out.k8, out.d_k, out.v_packed, out.d_v, out.d_k_repair, out.tile_repair
        )
    return out

