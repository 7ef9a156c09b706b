"""V residual repair's token selection on the GPU: per head, the ``count`` tokens of largest score in ascending token
order, bit for bit ``repair.select_repair_tokens``, in one launch (``torch.topk`` takes about 25). Device code only:
``prep_ops`` compiles the kernel and runs it on torch tensors, on the caller's stream, chained to the launches around
it as the preparation's kernels are (``dependent_launch``): Q's quantization runs beside it on the other SMs.

  SelectRepairTokens()               score (B, H, S) fp32, contiguous -> tokens (B, H, count) int64, ascending
  SelectRepairTokens(resident=True)  the same, S <= RESIDENT_MAX_TOKENS: the keys held in shared memory

Grid (H, B): one CTA of 1024 threads (32 warps) per head. Six passes read the row's keys (four radix passes, two
compaction passes), from where the variant keeps them; nothing else differs (one algorithm, ``_load_keys`` reads
from either place, bit for bit the same tokens). Streaming (the default): every pass reads the score row from
global memory, after the first read from L2 (40 heads of 120,000 tokens: 19 MB), and computes the keys as it
reads. Resident: before the passes the block reads the row once (thread t: tokens ``base + 1024 u + t``,
``LOADS_IN_FLIGHT`` loads in flight) and stores its keys in shared memory, key i at word i (192 KB of dynamic
shared memory at ``RESIDENT_MAX_TOKENS`` = 49,152, after the histograms and counts: ``RESIDENT_SMEM_BYTES``);
the passes read them there, each warp 32 consecutive words at a time (no bank conflicts). A longer row does not
fit (``prep_ops.select_kind`` launches the streaming variant for it; the resident one would read and write past
its shared memory).

1. Keys. Each score's bits become ``repair.order_key``'s unsigned key: a non-negative float's bits with the sign
   bit set, a negative one's bits inverted (keys order as the numbers do), -0.0 the key of +0.0, every NaN
   0xFFFFFFFF (above +inf's 0xFF800000).
2. Radix select of T, the count-th largest key: ``PASSES`` passes over ``DIGIT_BITS``-bit digits, most significant
   first. Pass p histograms (shared memory, ``BINS`` bins, one histogram per pass, all zeroed at the start, one
   barrier after the zeroing and the resident variant's copy) digit p of the keys whose higher digits are T's found
   so far. The block strides over the row, thread t taking tokens ``base + 1024 u + t``, u < ``LOADS_IN_FLIGHT`` (all
   loaded before the first is used); the lanes of a warp that share a digit (``match.any.sync``) add once, their
   count (contended bins: a narrow range of energies shares its top digit), and a warp none of whose keys is on the
   prefix (most warps after the first pass) skips the match (``vote.any``, warp-uniform). After a barrier every warp
   reads the whole histogram and finds the same digit (no broadcast, and the next pass, on its own histogram, needs
   no barrier first): lane l owns bins ``8 l .. 8 l + 7``, a suffix sum over lanes (shuffles down) counts the keys in
   higher bins, and the lane whose bin holds the ``need``-th key from the top reports the digit and what is still
   needed (warp reductions). After the last pass: T, and ``take_equal`` = how many keys equal to T are taken (the
   lowest-index ones); the ``count - take_equal`` keys above T are all taken.
3. Compaction in index order, deterministic: warp w owns tokens ``[w seg, (w + 1) seg)``, ``seg`` a multiple of
   ``WARP_STEP``: 32 consecutive tokens at a time (one per lane), ``LOADS_IN_FLIGHT`` times per loop step. Pass 1
   counts per warp the keys above T and the keys equal to T (ballot + popc); each warp's counts go to shared
   memory, and after a barrier each warp sums the counts of the warps before it (lane l reads warp l's, one warp
   reduction). Pass 2: a token is kept if its key is above T, or equals T and fewer than ``take_equal`` equal
   keys come before it (its warp's count before it plus the equal lanes below it); its output slot is the number
   of kept tokens before it. Slots rise with the token index: ascending order without a sort.

Every loop runs the same trip count on all lanes of a warp (the radix passes the same on the whole block), so the
warp-synchronous instructions inside them (match, ballot) always see the full warp; the last step's lanes past S
load token S - 1 and count for nothing. ``count`` is the output's last extent; 1 <= count <= S (``prep_ops``
launches nothing at count 0); a slot at or past count is never written.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from ..repair import ORDER_KEY_NAN
from .dependent_launch import follow_previous_launch, launch_options
from .float_bits import EXPONENT_BITS, MAGNITUDE_BITS, SIGN_BIT

THREADS = 1024
WARPS = THREADS // 32
DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS
PASSES = 32 // DIGIT_BITS
BINS_PER_LANE = BINS // 32
"""The digit search: lane l of every warp owns bins ``BINS_PER_LANE * l + (0 .. BINS_PER_LANE - 1)``."""
LOADS_IN_FLIGHT = 8
"""Keys a thread loads before it uses the first: a loop step covers this many tokens per thread, so a step waits
for L2 once, not once per token."""
WARP_STEP = 32 * LOADS_IN_FLIGHT
"""Compaction: the tokens one warp covers per step; a warp's segment is a multiple of it."""
NO_DIGIT = BINS
"""A lane's digit where its key does not take part in a pass (a key off the prefix, a token past S)."""

RESIDENT_MAX_TOKENS = 49_152
"""The longest row the resident variant takes: its keys, 4 bytes each (192 KB), after the histograms and per-warp
counts, within what a block may have (``SMEM_LIMIT_BYTES``) with 30,464 bytes to spare. ``prep_ops.select_kind``
picks the resident variant up to here, the streaming one above."""
HIST_BYTES = PASSES * BINS * 4
COUNTS_BYTES = 2 * WARPS * 4
"""Shared memory of both variants: the histograms (int32), then the per-warp counts above and equal to T."""
SMEM_BYTES = HIST_BYTES + COUNTS_BYTES
RESIDENT_SMEM_BYTES = SMEM_BYTES + 4 * RESIDENT_MAX_TOKENS
"""The dynamic shared memory a launch requests: 4,352 bytes streaming, 200,960 resident (the keys after the counts,
at a 16-byte aligned offset). No size is passed: the DSL sizes each launch by the kernel's ``SmemAllocator``
allocations (a compile-time constant; the shapes are symbolic) and opts every kernel in to the device's largest
dynamic shared memory (``cudaFuncSetAttribute`` when the kernel is loaded)."""
SMEM_LIMIT_BYTES = 227 * 1024
"""Hopper's shared memory per block (opt-in), static included: ptxas gives these kernels 1 KB of static shared
memory (``STATIC_SMEM_BYTES``, reserved on sm_90), so the DSL's opt-in allows 226 KB dynamic."""
STATIC_SMEM_BYTES = 1024

assert THREADS == PASSES * BINS, "one thread zeroes one histogram bin"
assert SMEM_BYTES % 16 == 0, "the keys start 16-byte aligned, right after the counts"
assert STATIC_SMEM_BYTES + RESIDENT_SMEM_BYTES <= SMEM_LIMIT_BYTES - 16 * 1024, "room to spare"


def _select(cond, if_value, else_value):
    """``if_value if cond else else_value`` as one select (no branch), typed like ``if_value``."""
    return type(if_value)(cutlass.select_(cond, if_value, else_value))


@cute.jit
def _order_key(bits: Uint32) -> Uint32:
    """``repair.order_key`` of a float's bits."""
    # A negative number other than -0.0 (0x80000000): its bits, unsigned, above the sign bit alone.
    key = _select(bits > Uint32(SIGN_BIT), ~bits, bits | Uint32(SIGN_BIT))
    return _select((bits & Uint32(MAGNITUDE_BITS)) > Uint32(EXPONENT_BITS), Uint32(ORDER_KEY_NAN), key)


@cute.jit
def _load_keys(keys_of: cute.Tensor, first: Int32, stride: int, seq_len: Int32, bits: cutlass.Constexpr[bool]):
    """The keys of tokens ``first + stride * u``, u < ``LOADS_IN_FLIGHT``, in registers (all loads issued first),
    each token clamped to S - 1 (every lane loads). ``keys_of`` (S,) uint32 holds the score bits (``bits``: the
    global row, each key computed here) or the keys themselves (the shared-memory copy of the resident variant)."""
    keys = cute.make_rmem_tensor(LOADS_IN_FLIGHT, Uint32)
    for u in cutlass.range_constexpr(LOADS_IN_FLIGHT):
        value = keys_of[cutlass.min(first + stride * u, seq_len - 1)]
        if cutlass.const_expr(bits):
            value = _order_key(value)
        keys[u] = value
    return keys


@cute.jit
def _lane_count(mask) -> Int32:
    """How many lanes of a 32-bit lane mask are set."""
    return Int32(cute.arch.popc(Uint32(mask)))


class SelectRepairTokens:
    """``repair.select_repair_tokens(score, count)``: per head the ``count`` tokens of largest ``order_key``, ties
    to the lower index, ascending. Grid (H, B), 1024 threads. ``resident``: the row's keys are read from global
    memory once, into shared memory, and every pass reads them there (S <= ``RESIDENT_MAX_TOKENS``)."""

    def __init__(self, resident: bool = False):
        self.resident = resident

    @cute.jit
    def __call__(self, mScore: cute.Tensor, mTokens: cute.Tensor, stream: cuda.CUstream):
        """mScore (B, H, S) fp32, rows contiguous; mTokens (B, H, count) int64, every entry written."""
        self.kernel(cute.recast_tensor(mScore, Uint32), mTokens).launch(
            grid=[mScore.shape[1], mScore.shape[0], 1], block=[THREADS, 1, 1], stream=stream,
            **launch_options(),
        )

    @cute.kernel
    def kernel(self, mBits: cute.Tensor, mTokens: cute.Tensor):
        follow_previous_launch()
        tidx, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        # Outside any branch: warp_idx is a full-warp shuffle (see prep._block_absmax).
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        lower_lanes = cute.arch.lanemask_lt()
        smem = cutlass.memory.SmemAllocator()
        # hist[p * BINS + digit]: pass p's histogram.
        hist = smem.allocate_tensor(Int32, cute.make_layout(PASSES * BINS), byte_alignment=16)
        warp_above = smem.allocate_tensor(Int32, cute.make_layout(WARPS))
        warp_equal = smem.allocate_tensor(Int32, cute.make_layout(WARPS))

        row = mBits[b, h, None]
        seq_len = mBits.shape[2]
        count = mTokens.shape[2]
        hist[tidx] = Int32(0)
        # Where every pass reads the keys: the score row (bits, each key computed as it is read), or its keys in
        # shared memory, loaded here as the passes load them (thread t: tokens base + 1024 u + t).
        keys_of, bits = row, True
        if cutlass.const_expr(self.resident):
            keys_of = smem.allocate_tensor(Uint32, cute.make_layout(RESIDENT_MAX_TOKENS), byte_alignment=16)
            bits = False
            for base in cutlass.range(0, seq_len, THREADS * LOADS_IN_FLIGHT):
                keys = _load_keys(row, base + tidx, THREADS, seq_len, True)
                for u in cutlass.range_constexpr(LOADS_IN_FLIGHT):
                    token = base + u * THREADS + tidx
                    if token < seq_len:
                        keys_of[token] = keys[u]
        cute.arch.barrier()

        # ---- 2. radix select: T = prefix after the last pass, need = take_equal ----
        prefix = Uint32(0)
        need = Int32(count)
        for p in cutlass.range_constexpr(PASSES):
            shift = 32 - DIGIT_BITS * (p + 1)
            high_mask = (0xFFFFFFFF << (shift + DIGIT_BITS)) & 0xFFFFFFFF  # the digits found so far
            for base in cutlass.range(0, seq_len, THREADS * LOADS_IN_FLIGHT):
                keys = _load_keys(keys_of, base + tidx, THREADS, seq_len, bits)
                for u in cutlass.range_constexpr(LOADS_IN_FLIGHT):
                    token, key = base + u * THREADS + tidx, keys[u]
                    takes_part = (token < seq_len) & ((key & Uint32(high_mask)) == prefix)
                    # After the first pass few keys are on the prefix: a warp with none skips the match.
                    if cute.arch.vote_any_sync(takes_part):
                        digit = _select(
                            takes_part, Int32((key >> Uint32(shift)) & Uint32(BINS - 1)), Int32(NO_DIGIT)
                        )
                        peers = cute.arch.match_sync(cute.arch.FULL_MASK, digit)
                        if ((peers & lower_lanes) == Uint32(0)) & (digit != NO_DIGIT):  # the lowest lane of its peers
                            cute.arch.atomic_add(hist.iterator + (p * BINS + digit), _lane_count(peers), scope="cta")
            cute.arch.barrier()

            # Every warp: the digit whose bin holds the need-th key from the top, and what remains needed in it.
            first_bin = p * BINS + lane * BINS_PER_LANE
            bins = cute.make_rmem_tensor(BINS_PER_LANE, Int32)
            local = Int32(0)
            for j in cutlass.range_constexpr(BINS_PER_LANE):
                bins[j] = hist[first_bin + j]
                local += bins[j]
            suffix = local  # keys in this lane's bins and all higher lanes'
            for bit in cutlass.range_constexpr(5):
                higher = cute.arch.shuffle_sync_down(suffix, offset=1 << bit)
                suffix = _select(lane + (1 << bit) < 32, suffix + higher, suffix)
            running = suffix - local  # keys in higher bins than this lane's
            found_digit, found_need = Int32(0), Int32(0)
            for j in cutlass.range_constexpr(BINS_PER_LANE - 1, -1, -1):
                hit = (running < need) & (running + bins[j] >= need)
                found_digit = _select(hit, lane * BINS_PER_LANE + j, found_digit)
                found_need = _select(hit, need - running, found_need)
                running += bins[j]
            # One lane hits (the bins hold at least need keys); the others report 0.
            digit = cute.arch.warp_redux_sync(found_digit, "max")
            need = cute.arch.warp_redux_sync(found_need, "max")
            prefix = prefix | (Uint32(digit) << Uint32(shift))
        threshold, take_equal = prefix, need

        # ---- 3. compaction: this warp's tokens [first_token, end) ----
        segment = cute.ceil_div(cute.ceil_div(seq_len, WARP_STEP), WARPS) * WARP_STEP
        first_token = warp * segment
        end = cutlass.min(first_token + segment, seq_len)
        above, equal = Int32(0), Int32(0)
        for base in cutlass.range(first_token, end, WARP_STEP):
            keys = _load_keys(keys_of, base + lane, 32, seq_len, bits)
            for u in cutlass.range_constexpr(LOADS_IN_FLIGHT):
                token, key = base + 32 * u + lane, keys[u]
                above += _lane_count(cute.arch.vote_ballot_sync((token < seq_len) & (key > threshold)))
                equal += _lane_count(cute.arch.vote_ballot_sync((token < seq_len) & (key == threshold)))
        if lane == 0:
            warp_above[warp] = above
            warp_equal[warp] = equal
        cute.arch.barrier()

        # The counts of the warps before this one: lane l reads warp l's, one sum over the warp.
        earlier = lane < warp
        above_before = cute.arch.warp_redux_sync(_select(earlier, warp_above[lane], Int32(0)), "add")
        equal_before = cute.arch.warp_redux_sync(_select(earlier, warp_equal[lane], Int32(0)), "add")
        kept = above_before + cutlass.min(equal_before, take_equal)  # tokens kept before this warp's
        equal_seen = equal_before
        for base in cutlass.range(first_token, end, WARP_STEP):
            keys = _load_keys(keys_of, base + lane, 32, seq_len, bits)
            for u in cutlass.range_constexpr(LOADS_IN_FLIGHT):
                token, key = base + 32 * u + lane, keys[u]
                is_above = (token < seq_len) & (key > threshold)
                is_equal = (token < seq_len) & (key == threshold)
                equal_lanes = Uint32(cute.arch.vote_ballot_sync(is_equal))
                keep = is_above | (is_equal & (equal_seen + _lane_count(equal_lanes & lower_lanes) < take_equal))
                kept_lanes = Uint32(cute.arch.vote_ballot_sync(keep))
                slot = kept + _lane_count(kept_lanes & lower_lanes)
                if keep & (slot < count):
                    mTokens[b, h, slot] = Int64(token)
                equal_seen += _lane_count(equal_lanes)
                kept += _lane_count(kept_lanes)
