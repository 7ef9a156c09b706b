"""Torch entry point of the Hopper ExpCast kernel: preparation, compile cache, custom op.

``attention(q, k, v)`` quantizes and packs with the fused sm90 preparation kernels (``prep_ops``, byte-identical
to ``preparation.prepare_reference``) and runs the sm90 forward kernel; the output is bit-for-bit the same on
repeated calls. ``torch.ops.openvc.attention`` and ``torch.ops.openvc.attention_lse`` (the output and its
log-sum-exp) are the registered custom ops (with fake implementations, so ``torch.compile`` can trace through them).
"""

import contextlib
import functools
import importlib
import types

import torch

from .compile_cache import load_or_compile
from .expcast import codes_per_dot
from .sm90.config import ForwardConfig
from .preparation import REPAIR_ROOM_ALIGN, Prepared, PrepareOptions, preparation_may_rotate
from .sm90.layout import PV_N
from .sm90.target import COMPILE_OPTIONS, row_major_fake
from .quant import BLOCK, num_blocks, smoothing_lse_shift, softmax_scale_or_default
from .rotary import rotate_qk, tables_reason
from .split import TailSplit, plan_tail_split
from .forward_only import raise_on_backward
from .support import HEAD_DIM, KERNEL_DTYPES, KernelUnavailableError, input_unsupported_reason
from .validation import check_attention_args, check_flag, check_shared_scales, check_softmax_scale, check_window

OUT_DTYPE = torch.bfloat16


def compile_attention(config: ForwardConfig, kernel_class: type | None = None):
    """Compile the sm90 forward kernel of ``config`` for sm_90a; no GPU needed.

    Shapes are symbolic: one compiled kernel serves every batch, head count and sequence length.
    ``kernel_class`` (default ``ExpCastAttentionSm90``) is where notes/probe_*.py put their variants.
    """
    import cutlass
    import cutlass.cute as cute

    from .sm90.fwd import CONSUMER_WGS, TILE_M, ExpCastAttentionSm90, ForwardArgs

    batch, heads = cute.sym_int(), cute.sym_int()
    # K's rows and packed V's columns: the real keys' whole tiles, then the repair keys' room (a multiple of 64).
    s_q_pad, s_k_pad = cute.sym_int(divisibility=TILE_M), cute.sym_int(divisibility=REPAIR_ROOM_ALIGN)
    n_q, n_k, s_q, n_r, n_lse = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    slots, split_units = cute.sym_int(), cute.sym_int()
    fake = ForwardArgs(
        q8=row_major_fake(cutlass.Uint8, (batch, heads, s_q_pad, HEAD_DIM), 16),
        k8=row_major_fake(cutlass.Uint8, (batch, heads, s_k_pad, HEAD_DIM), 16),
        v_packed=row_major_fake(cutlass.Uint8, (batch, heads, PV_N, s_k_pad), 16),
        d_q=row_major_fake(cutlass.Float32, (batch, heads, n_q), 4),
        d_k=row_major_fake(cutlass.Float32, (batch, heads, n_k), 4),
        d_v=row_major_fake(cutlass.Float32, (batch, heads), 4),
        d_k_repair=row_major_fake(cutlass.Float32, (batch, heads, n_r), 4),
        tile_repair=row_major_fake(cutlass.Int32, (batch, heads, n_r), 4),
        out=row_major_fake(cutlass.BFloat16, (batch, s_q, heads, HEAD_DIM), 16),
        lse=row_major_fake(cutlass.Float32, (batch, heads, n_lse), 4),
        piece_sums=row_major_fake(cutlass.Float32, (slots, TILE_M, PV_N), 16),
        piece_anchors=row_major_fake(cutlass.Float32, (slots, TILE_M), 4),
        arrivals=row_major_fake(cutlass.Int32, (split_units, CONSUMER_WGS), 4),
        codes_per_dot=cutlass.Float32(1.0),
        seqlen_k=cutlass.Int32(1),
        window=cutlass.Int32(0),
        repair_tiles=cutlass.Int32(0),
        whole_units=cutlass.Int32(1),
        splits=cutlass.Int32(1),
    )
    kernel = (kernel_class or ExpCastAttentionSm90)(config)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *fake, stream, options=COMPILE_OPTIONS)


def _kernel(config: ForwardConfig):
    return load_or_compile(_cache_name(config), lambda: compile_attention(config))


@functools.cache
def _cache_name(config: ForwardConfig) -> str:
    """``config.cache_name``, spelled once per variant: it walks the dataclass's fields, host time on every call
    (notes/kernel.md, 2026-12-02 15:10, has the measurements)."""
    return config.cache_name


@functools.cache
def _shipped_config(plain_order: bool, write_lse: bool) -> ForwardConfig:
    """The shipped kernel's config for a visiting order and lse, made once (it is frozen): making one walks its
    fields, host time on every call."""
    return ForwardConfig(plain_order=plain_order, write_lse=write_lse)


@functools.lru_cache(maxsize=64)
def _codes_per_dot_value(softmax_scale: float) -> float:
    """``expcast.codes_per_dot`` as the kernel's float argument, once per scale: making the tensor is host time on
    every call."""
    return float(codes_per_dot(softmax_scale))


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    smooth_k: bool = False,
    repair_ratio: float = 0.0,
    repair_ranking: str = "energy",
    softmax_scale: float | None = None,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
) -> Prepared:
    """Quantize ``(B, S, H, 128)`` q, k, v as ``reference_attention`` does, and pack V for the kernel: the bytes
    of ``prepare_reference`` from the fused kernels, V residual repair keys included (``prep_ops.prepare``), on
    the current stream. ``softmax_scale`` (default ``1 / sqrt(128)``) weighs the "attention" repair ranking;
    ``v_absmax`` and ``k_mean`` replace this call's own V absmax and K mean, as in ``reference_attention``."""
    _check_kernel_args(q, k, v, repair_ratio, None, repair_ranking, softmax_scale, smooth_k, v_absmax, k_mean)
    options = PrepareOptions(smooth_k, repair_ratio, repair_ranking, softmax_scale)
    return _prepare_checked(q, k, v, options, v_absmax, k_mean)


def _check_kernel_args(
    q, k, v, repair_ratio, window, repair_ranking, softmax_scale, smooth_k, v_absmax, k_mean
) -> None:
    """Every check of a kernel call; the shared scales' values are skipped while a CUDA graph is being captured
    (checking them waits for the device)."""
    check_attention_args(
        q, k, v, repair_ratio=repair_ratio, window=window, repair_ranking=repair_ranking,
        softmax_scale=softmax_scale, dtypes=KERNEL_DTYPES,
    )
    # Capture only leaves out the shared scales' values: without shared scales there is nothing to ask.
    shared = v_absmax is not None or k_mean is not None
    capturing = shared and q.is_cuda and torch.cuda.is_current_stream_capturing()
    check_shared_scales(q, k, smooth_k=smooth_k, v_absmax=v_absmax, k_mean=k_mean, values=not capturing)
    reason = input_unsupported_reason(q.device, q.dtype, q.shape[-1])
    if reason is not None:
        raise ValueError(reason)


@functools.cache
def _dsl_module(name: str) -> types.ModuleType:
    """The module ``openvc_kernels.<name>`` (``prep_ops``, ``sm90.fwd``), imported at its first use, not with the
    package: it imports the CuTe DSL. Looked up here once rather than by an import statement in every call."""
    return importlib.import_module(f"{__package__}.{name}")


def _prepare_checked(q, k, v, options: PrepareOptions, v_absmax, k_mean, rotary=None) -> Prepared:
    return _dsl_module("prep_ops").prepare(q, k, v, options, v_absmax=v_absmax, k_mean=k_mean, rotary=rotary)


def check_rotary(q: torch.Tensor, k: torch.Tensor, rotary) -> None:
    """Raise ``ValueError`` unless ``rotary`` is None or the (cos, sin) tables the kernel applies to q and k."""
    if rotary is None:
        return
    accepted = (
        f"accepted: None, or (cos, sin), two torch.float32 tensors (1, S, 1, {HEAD_DIM}) on q's device, S q's and "
        "k's length (self-attention: q and k of one shape)"
    )
    if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
        raise ValueError(f"rotary must be a (cos, sin) pair, got {type(rotary).__name__}; {accepted}")
    if not all(isinstance(t, torch.Tensor) for t in rotary):
        raise ValueError(f"rotary holds {', '.join(type(t).__name__ for t in rotary)}; {accepted}")
    reason = tables_reason(q, k, *rotary)
    if reason is not None:
        raise ValueError(f"rotary cannot be applied: {reason}; {accepted}")


def rotates_in_preparation(return_lse: bool, repair_ranking: str, v_absmax, k_mean) -> bool:
    """Whether a call with a rotary embedding rotates q and k inside the preparation (``prep_ops.prepare``'s
    ``rotary``), never writing them rotated: where nothing else reads them, so not for the lse's K-smoothing shift,
    the "attention" repair ranking, nor a ring shard's shared scales; else ``rotary.rotate_qk`` runs first."""
    return not return_lse and preparation_may_rotate(repair_ranking, v_absmax, k_mean)


@functools.cache
def build_failure(
    dtype: torch.dtype, *, plain_order: bool, smooth_k: bool, repair: bool, lse: bool = False, rotary: bool = False
) -> str | None:
    """Compile (or load) every kernel a call with these options runs (``lse``: the kernel that writes the
    log-sum-exp; ``rotary``: the rotary embedding inside the preparation, ``rotates_in_preparation``); None when
    they are ready, else the ``KernelUnavailableError`` message (cause and fix), so that a caller can fall back
    instead of failing."""
    try:
        from . import prep_ops

        prep_ops.load_kernels(dtype, smooth_k=smooth_k, energy=repair)
        if smooth_k:
            prep_ops.load_prep("channel_sums_per_block", dtype)
            prep_ops.load_prep("absmax_and_channel_sums", dtype)
            prep_ops.load_prep("channel_mean")
        if repair:
            # Both variants of the tokens' choice: which one runs depends on S (prep_ops.select_kind), and this
            # answer holds for every S.
            for kind in prep_ops.SELECT_KINDS:
                prep_ops.load_prep(kind)
            prep_ops.load_prep("repair_rows", dtype)
        if rotary:
            prep_ops.load_prep(prep_ops.rotary_quantize_kind(smooth_k), dtype)
            if smooth_k:
                prep_ops.load_prep("absmax_and_rotated_channel_sums", dtype)
        _kernel(ForwardConfig(plain_order=plain_order, write_lse=lse))
    except KernelUnavailableError as error:
        return str(error)
    return None


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_workspace(plan: TailSplit, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces' sums, anchors and arrival counters (zeroed) for ``plan`` (``sm90/pieces.py``); without a
    split the kernel never reads them: compact one-slot stand-ins, never empty tensors, and nothing zeroed."""
    split = plan.splits > 1
    slots, split_units = (plan.split_units * plan.splits, plan.split_units) if split else (1, 1)
    sums = torch.empty(slots, BLOCK, PV_N, dtype=torch.float32, device=device)
    anchors = torch.empty(slots, BLOCK, dtype=torch.float32, device=device)
    # One counter per consumer warpgroup of each split unit.
    arrivals = (torch.zeros if split else torch.empty)(split_units, 2, dtype=torch.int32, device=device)
    return sums, anchors, arrivals


def forward_args(
    prepared: Prepared,
    out: torch.Tensor,
    *,
    softmax_scale: float,
    window: int | None,
    split_tail: bool,
    lse: torch.Tensor | None = None,
):
    """The forward kernel's arguments (``sm90.fwd.ForwardArgs``) for ``attention_prepared``'s call; ``lse``
    (B, H, S_q) fp32 for the kernel that writes it."""
    p = prepared
    batch, heads, s_q_pad, _ = p.q8.shape
    units, n_k = batch * heads * (s_q_pad // BLOCK), num_blocks(p.seqlen_k)
    sms = sm_count(out.device) if split_tail else None
    plan = plan_tail_split(units, n_k, sms)
    piece_sums, piece_anchors, arrivals = _split_workspace(plan, out.device)
    # What the kernel takes but never reads, without repair (d_k_repair, tile_repair) and without write_lse (lse):
    # compact (B, H, 1) stand-ins, never empty tensors.
    stand_in = p.d_v[..., None] if not (p.repair_tiles and lse is not None) else None
    return _dsl_module("sm90.fwd").ForwardArgs(
        q8=p.q8,
        k8=p.k8,
        v_packed=p.v_packed,
        d_q=p.d_q,
        d_k=p.d_k,
        d_v=p.d_v,
        d_k_repair=p.d_k_repair if p.repair_tiles else stand_in,
        tile_repair=p.tile_repair if p.repair_tiles else stand_in.view(torch.int32),
        out=out,
        lse=lse if lse is not None else stand_in,
        piece_sums=piece_sums,
        piece_anchors=piece_anchors,
        arrivals=arrivals,
        codes_per_dot=_codes_per_dot_value(softmax_scale),
        seqlen_k=p.seqlen_k,
        # Any window from n_k on visits in the same order (start = min(query tile + window, n_k - 1)): clamped so
        # that the kernel's Int32 holds it and the sum.
        window=min(window or 0, n_k),
        repair_tiles=p.repair_tiles,
        whole_units=plan.whole_units,
        splits=plan.splits,
    )


def attention_prepared(
    prepared: Prepared,
    out: torch.Tensor,
    *,
    softmax_scale: float,
    window: int | None = 4,
    split_tail: bool = True,
    return_lse: bool = False,
    **tuning,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on prepared inputs into ``out`` ((B, S_q, H, 128) bf16, contiguous, S_q the length that was
    prepared); returns ``out``, or with ``return_lse`` ``(out, lse)``: lse FP32 (B, S_q, H), a view of a (B, H, S_q)
    buffer, each row's log-sum-exp of its prepared scores (with K smoothing those of ``q . (k - mean)``:
    ``attention`` adds the ``q . mean`` back).

    ``split_tail``: share the key range of the last wave's query tiles out over the idle SMs (``split.py``; as
    ``reference_attention(sm_count=...)`` models it with this GPU's SM count); False runs one CTA per query tile.
    ``tuning``: ``ForwardConfig``'s knobs other than the visiting order (which ``window`` sets) and ``write_lse``
    (which ``return_lse`` sets), for the probes. Raises ``ValueError`` for an option or an ``out`` it cannot take.
    """
    check_softmax_scale(softmax_scale)
    check_window(window)
    check_flag("split_tail", split_tail)
    check_flag("return_lse", return_lse)
    check_prepared_out(prepared, out)
    return _attention_prepared_checked(prepared, out, softmax_scale, window, split_tail, return_lse, **tuning)


def check_prepared_out(prepared: Prepared, out: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the kernel writes every row of ``out`` for ``prepared``: it visits the prepared
    query tiles and stops at ``out``'s length, so that length must end in the last tile (``Prepared`` does not keep
    q's exact length)."""
    batch, heads, s_q_pad, _ = prepared.q8.shape
    device = prepared.q8.device
    accepted = (
        f"accepted: a contiguous {OUT_DTYPE} tensor (batch, seq_q, heads, {HEAD_DIM}) = ({batch}, S_q, {heads}, "
        f"{HEAD_DIM}) on {device}, S_q from {s_q_pad - BLOCK + 1} to {s_q_pad} (in the last prepared query tile: q's "
        "length when it was prepared; rows past it would be written from the tile's padding)"
    )
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}; {accepted}")
    shape = tuple(out.shape)
    fits = (
        len(shape) == 4
        and (shape[0], shape[2], shape[3]) == (batch, heads, HEAD_DIM)
        and s_q_pad - BLOCK < shape[1] <= s_q_pad
    )
    if not fits or out.dtype != OUT_DTYPE or out.device != device or not out.is_contiguous():
        layout = "contiguous" if out.is_contiguous() else "strided"
        raise ValueError(f"out is a {layout} {out.dtype} tensor of shape {shape} on {out.device}; {accepted}")


def _attention_prepared_checked(prepared, out, softmax_scale, window, split_tail, return_lse, **tuning):
    """``attention_prepared`` on checked arguments (``attention``'s own ``out`` needs no check)."""
    if tuning:
        config = ForwardConfig(plain_order=window is None, write_lse=return_lse, **tuning)
    else:
        config = _shipped_config(window is None, return_lse)
    batch, s_q, heads, _ = out.shape
    lse = torch.empty(batch, heads, s_q, dtype=torch.float32, device=out.device) if return_lse else None
    args = forward_args(prepared, out, softmax_scale=softmax_scale, window=window, split_tail=split_tail, lse=lse)
    _kernel(config)(*args)
    return (out, lse.transpose(1, 2)) if return_lse else out


def _run(
    q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, rotary, return_lse
):
    """The custom ops' body: the checks, then ``_run_checked``."""
    # The checks run here, inside the op, where torch.compile does not trace (it would stop at the package lookup).
    _check_kernel_args(q, k, v, repair_ratio, window, repair_ranking, softmax_scale, smooth_k, v_absmax, k_mean)
    check_rotary(q, k, rotary)
    return _run_checked(
        q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, rotary, return_lse
    )


def _run_checked(
    q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, rotary, return_lse
):
    """The rotary embedding (inside the preparation where ``rotates_in_preparation``), the fused preparation, the
    kernel, and with K smoothing the lse's ``q . mean`` shift (K's mean then reduced here, once, for both), on
    checked arguments."""
    if rotary is not None and not rotates_in_preparation(return_lse, repair_ranking, v_absmax, k_mean):
        q, k = rotate_qk(q, k, *rotary)
        rotary = None
    if return_lse and smooth_k:
        k_mean = _dsl_module("prep_ops").smoothing_mean(k, k_mean)
    options = PrepareOptions(smooth_k, repair_ratio, repair_ranking, softmax_scale)
    prepared = _prepare_checked(q, k, v, options, v_absmax, k_mean, rotary)
    out = torch.empty(q.shape, dtype=OUT_DTYPE, device=q.device)
    result = _attention_prepared_checked(prepared, out, softmax_scale, window, True, return_lse)
    if return_lse and smooth_k:
        result[1].add_(smoothing_lse_shift(q, k_mean, softmax_scale))
    return result


@torch.library.custom_op("openvc::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window: int | None,
    smooth_k: bool,
    repair_ratio: float,
    repair_ranking: str,
    v_absmax: torch.Tensor | None,
    k_mean: torch.Tensor | None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
    return _run(
        q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, rotary, False
    )


@_attention_op.register_fake
def _(q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, cos=None, sin=None):
    return q.new_empty(q.shape, dtype=OUT_DTYPE)


@torch.library.custom_op("openvc::attention_lse", mutates_args=())
def _attention_lse_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window: int | None,
    smooth_k: bool,
    repair_ratio: float,
    repair_ranking: str,
    v_absmax: torch.Tensor | None,
    k_mean: torch.Tensor | None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = None if rotary_cos is None else (rotary_cos, rotary_sin)
    return _run(
        q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, rotary, True
    )


@_attention_lse_op.register_fake
def _(q, k, v, softmax_scale, window, smooth_k, repair_ratio, repair_ranking, v_absmax, k_mean, cos=None, sin=None):
    batch, s_q, heads, _ = q.shape
    # The real lse's strides: a (B, S_q, H) view of a (B, H, S_q) buffer.
    lse = q.new_empty(batch, heads, s_q, dtype=torch.float32).transpose(1, 2)
    return q.new_empty(q.shape, dtype=OUT_DTYPE), lse


_attention_op.register_autograd(raise_on_backward)
_attention_lse_op.register_autograd(raise_on_backward)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    window: int | None = 4,
    smooth_k: bool = False,
    repair_ratio: float = 0.0,
    repair_ranking: str = "energy",
    return_lse: bool = False,
    v_absmax: torch.Tensor | None = None,
    k_mean: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Open-VC FP8 ExpCast attention on a Hopper GPU: ``(B, S, H, 128)`` fp16/bf16 in, bf16 out.

    ``softmax_scale`` defaults to ``1 / sqrt(128)``; ``window`` is the mid-window look-ahead in key tiles
    (``None``: plain order); ``smooth_k`` subtracts K's per-channel mean before quantizing; ``repair_ratio`` rho
    of V residual repair (``round(rho * S)`` extra keys per head, 0 = none) ranked by ``repair_ranking``
    ("attention" or "energy", as in ``reference_attention``). Matches
    ``reference_attention(..., accumulation="wgmma", sm_count=ops.sm_count(device))`` (the tail split, ``split.py``)
    to rel-L2 1e-3 (FP32 order and the MUFU exponentials); the exact-sum reference differs more (the FP8 wgmma's
    14-bit sums move a few codes; measured in the README). Forward-only: a backward through the output raises.
    Raises ``ValueError`` for inputs the kernel cannot take and ``KernelUnavailableError`` (cause and fix) where its
    packages are missing or it fails to compile.

    ``return_lse``, ``v_absmax``, ``k_mean`` as in ``reference_attention``: ``(out, lse)`` with lse FP32 (B, S_q, H)
    (custom op ``openvc::attention_lse``), and the shared V absmax and K mean of a ring of K/V shards (the fused
    preparation then skips its V absmax launch). Their values (finite, absmax >= 0) are checked except while a
    CUDA graph is captured.

    ``rotary``: (cos, sin), the FP32 ``(1, S, 1, 128)`` tables of a rotary embedding to apply to q and k first
    (self-attention: q and k of one shape), with diffusers' Wan roundings (``rotary.rotary_reference``); the
    result is that of the call on ``rotary.rotate_qk(q, k, cos, sin)``, bit for bit. Where the rotated q and k
    are needed nowhere else (``rotates_in_preparation``) the preparation rotates them as it quantizes them, and
    they are never written.
    """
    check_flag("return_lse", return_lse)
    compiling = torch.compiler.is_compiling()
    if not compiling:
        # Eager, every check runs here, before any work, on the caller's own values (before the casts below);
        # traced, the floats may be symbolic (dynamic=True), and the op checks them at run time (``_run``).
        _check_kernel_args(q, k, v, repair_ratio, window, repair_ranking, softmax_scale, smooth_k, v_absmax, k_mean)
        check_rotary(q, k, rotary)
    tau = softmax_scale_or_default(softmax_scale, q.shape[-1])
    args = (q, k, v, float(tau), window, bool(smooth_k), float(repair_ratio), repair_ranking, v_absmax, k_mean)
    op = _attention_lse_op if return_lse else _attention_op
    cos, sin = (None, None) if rotary is None else rotary
    if compiling or not _nothing_sees_the_op(q, k, v, v_absmax, k_mean, cos, sin):
        return op(*args, cos, sin)
    # The op's body, checked once: the op's dispatch and its second check are host time on every call
    # (notes/kernel.md has the measurement). A profile still shows the op's name around its work.
    profiled = torch._C._autograd._profiler_enabled()
    with torch.profiler.record_function(op._qualname) if profiled else contextlib.nullcontext():
        return _run_checked(*args, rotary, return_lse)


def _nothing_sees_the_op(*tensors: torch.Tensor | None) -> bool:
    """Whether calling the custom op's body directly is the same as calling the op: plain tensors, no autograd
    to record (the op's backward raises), and no dispatch or function mode, functorch transform or JIT tracer
    that would see the op itself."""
    # One pass over the tensors, then torch's C queries (torch._C._is_tracing: torch.jit.is_tracing's, outside
    # TorchScript).
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad_enabled and t.requires_grad)):
            return False
    return not (
        torch._C._len_torch_dispatch_stack()
        or torch._C._len_torch_function_stack()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch._C._is_tracing()
    )
