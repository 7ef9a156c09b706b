"""ExpCast online softmax on wgmma accumulators: code anchor, codes, packing, the anchor's moves, promotion.

Register picture (m64nN f32 accumulator of one warpgroup, per thread): the fragment is
``((2, 2, N/8), 1, 1):((1, 2, 4), 0, 0)``; value ``e + 2 r + 4 c`` sits at row ``r`` (0, 1: this thread's
two rows, 8 apart) and column ``2 (lane % 4) + e + 8 c``. ``rows_view`` re-indexes it as
``(row, column-within-thread)``. Per row the four lanes of a quad together hold all N columns.

Per key tile and row, with ``s`` codes per raw score unit and ``d_k`` the tile's K descale: at once, on the row's
anchor (the first tile's from its max, ``anchor = rne(103.65 - s * rowmax(raw) * d_k)``),
``y = fma(raw, s * d_k * 2^-24, anchor * 2^-24)``, the code in units of FP16's smallest subnormal;
``cvt.rn.relu.f16x2.f32`` rounds two such values to integers on the subnormal grid and clips them at 0, leaving
each code in the low byte of a 16-bit half; one PRMT gathers four of those bytes into a PV A word. The packed
halves' max (``max.u16x2``, fused into VIMNMX3; kept per row) and one warp vote check that no code passed TOP_CODE
(126); a warp where one did moves those rows' anchors (``move_anchor``: by the row's packed top code less 112) and
packs again. Per 64
codes of a thread: 64 FFMA, 32 conversions, 16 PRMT, 18 VIMNMX, a vote; no row max before the FFMAs, no shuffle.
"""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr

from ..expcast import CODE_UNIT, FIRST_ANCHOR_BIAS, LN2, LOG2_PER_CODE, LSE_CODE_OFFSET, MOVE_CODE, TOP_CODE
from .ptx import byte_perm, larger_half, max_u16x2, mul_rn, pack_codes_f16, warp_any_half_above


HALF_LOW_BYTES = 0x6420
"""prmt selector: bytes 0 and 2 of each word (the low bytes of its two FP16 halves), the first word's first."""
REPAIR_KEYS_PER_LANE = 4
"""Repair keys a lane loads the descale (and, in a piece, the token's tile) of per repair tile. A thread's 32 score
columns are the keys ``2 t + e + 8 c`` of its quad position t, the same for the 8 row groups of its warp; so lane
(g, t) of the warp loads those of columns ``4 g .. 4 g + 3`` (``repair_key_source``) and the others take them by
shuffle: 4 loads a lane instead of 32. The descales are loaded before the tile's wgmmas, so that L2's latency passes
under them, held in 4 registers, where 32 would not fit beside the accumulators (ptxas spilled)."""
REPAIR_GROUP_KEYS = 16
"""Keys from a lane's slot p to the next row group's: column 4 g + p is column p's key plus 16 g (column i + 4 is
c + 2: 16 keys on)."""
UNITS_PER_CODE = 1.0 / CODE_UNIT
"""2^24: an FP32 code times it is the code (exact)."""
TOP_CHAINS = 2
"""Running maxima of each of a thread's two rows' packed code words (16 a row), so that the max's tree is 4 chains
deep plus 1, not 15, behind the last conversion; the rows' maxima stay apart for ``move_anchor``."""
EXACT_PACKED_CODES = 2048
"""FP16 holds every whole number below 2^11: a packed top code under this is the row's rounded top code exactly;
``move_anchor`` takes the FP32 max above it (codes that far past the anchor only come from extreme scores)."""
QUAD_SEGMENT = (0b00011 << 8) | 31
"""``shfl.sync.idx``'s c operand (segment mask in bits 8-12, clamp in 0-4) that keeps the source lane's quad
position (lane bits 0-1) from the reading lane and takes bits 2-4 from b: source ``t + b`` for b = 4 g, an
immediate, so the shuffles need no register for their source lanes."""


def repair_key_source(column: int) -> tuple[int, int]:
    """Who loads the repair key of a thread's score ``column`` (``rows_view``'s: ``e + 2 c``): the row group g of
    the lane in its warp (at the thread's quad position) and the slot in that lane, ``column = 4 g + slot``."""
    return column // REPAIR_KEYS_PER_LANE, column % REPAIR_KEYS_PER_LANE


def rows_view(acc: cute.Tensor) -> cute.Tensor:
    """``((2, 2, C), 1, 1)`` accumulator (or its coordinates) -> ``(2 rows, 2 * C columns)`` view."""
    col_groups = cute.size(acc.shape[0][2])
    by_row = cute.make_layout((2, (2, col_groups)), stride=(2, (1, 4)))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, by_row))


@cute.jit
def quad_max(x: Float32) -> Float32:
    """Max across the 4 lanes that hold one row (butterfly over lane bits 0 and 1)."""
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))


@cute.jit
def row_max(scores: cute.Tensor, row: cutlass.Constexpr[int]) -> Float32:
    """Max of one row over the whole tile: a 4-way tree in registers, then across the quad."""
    n = cute.size(scores, mode=[1])
    lanes = [scores[row, i] for i in range(4)]
    for i in cutlass.range_constexpr(4, n):
        lanes[i % 4] = cute.arch.fmax(lanes[i % 4], scores[row, i])
    local = cute.arch.fmax(cute.arch.fmax(lanes[0], lanes[1]), cute.arch.fmax(lanes[2], lanes[3]))
    return quad_max(local)


@cute.jit
def code_anchor(m: Float32, s: Float32) -> Float32:
    """``rne(103.65 - s * m)``: the integer the row's codes are anchored to (``expcast.code_anchor``)."""
    return cute.math.roundeven(Float32(FIRST_ANCHOR_BIAS) - mul_rn(s, m))


@cute.jit
def row_lse(l: Float32, anchor: Float32) -> Float32:
    """The row's log-sum-exp ``(log2(l) + (LSE_CODE_OFFSET - anchor) / 8) ln2`` (``expcast.row_lse``, the same FP32
    steps; log2 is MUFU's lg2.approx, within 2^-22 of the reference's)."""
    octaves = cute.math.log2(l, approx=True, ftz=True) + (Float32(LSE_CODE_OFFSET) - anchor) * LOG2_PER_CODE
    return octaves * Float32(LN2)


class ExpCastSoftmax:
    """One consumer thread's ExpCast softmax over its two rows of each key tile (FA4's ``Softmax`` in spirit).

    Bound once for the whole loop: the QK accumulator ``acc_s`` (the tile's raw scores, encoded in place), its rows
    view ``scores``, the same of a last repair tile of 64 keys (``acc_s_half``, ``scores_half``: keys 0..63 are
    columns 0..15 of either view, ``tile_scores``), the (row, key) coordinates ``key_coords`` of those values (the
    rows view of the tile's identity tensor partitioned like them) and ``s``, the codes per raw score unit (d_q
    included). Row state, (2,) FP32 each: the code ``anchor`` and ``pending`` (O's rescale since the PV sum last moved
    into it, ``promote``).

    The kernel builds its softmax from ``ExpCastAttentionSm90.softmax_class``; notes/probe_*.py subclass this class
    to leave steps out or swap them.
    """

    move_code = MOVE_CODE
    """Where a moved row's top code lands (``expcast.MOVE_CODE``); probes swap it."""

    def __init__(self, acc_s: cute.Tensor, acc_s_half: cute.Tensor, key_coords: cute.Tensor, s: Float32):
        self.acc_s = acc_s
        self.scores = rows_view(acc_s)
        self.acc_s_half = acc_s_half
        self.scores_half = rows_view(acc_s_half)
        self.key_coords = key_coords
        self.anchor = cute.make_rmem_tensor((2,), Float32)
        self.pending = cute.make_rmem_tensor((2,), Float32)
        self.pending.fill(1.0)
        self.s = s
        # This lane's repair keys' descales of the coming repair tile (``load_repair_keys``).
        self.repair_d_k = cute.make_rmem_tensor((REPAIR_KEYS_PER_LANE,), Float32)

    @cute.jit
    def online_codes(
        self, has_padding: cutlass.Boolean, valid_keys: Int32, d_k: Float32, is_first: cutlass.Constexpr[bool]
    ):
        """One key tile's codes: mask padding keys, anchor the row on its first tile, encode in place on the anchor
        (checked after the PV wait: ``pack_codes_checked``)."""
        if has_padding:
            self.mask_keys(valid_keys)
        if const_expr(is_first):
            self.first_anchor(d_k)
        self.encode(mul_rn(self.s, d_k))

    @cute.jit
    def mask_keys(self, valid_keys: Int32):
        """Padding keys (column >= valid_keys) get -inf: their code is 0."""
        scores, coords = self.scores, self.key_coords
        for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            if coords[0, i][1] >= valid_keys:
                for r in cutlass.range_constexpr(2):
                    scores[r, i] = -Float32.inf

    @cute.jit
    def first_anchor(self, d_k: Float32):
        """The row's anchor from its first key tile's max (K-descaled): ``expcast.code_anchor``."""
        for r in cutlass.range_constexpr(2):
            self.anchor[r] = code_anchor(mul_rn(row_max(self.scores, r), d_k), self.s)

    @cute.jit
    def encode(self, coef: Float32):
        """In place: each raw score becomes ``fma(raw, coef * 2^-24, anchor * 2^-24)``, its code times 2^-24.

        Both scalings are exact (powers of two), so the FFMA's result is the FP32 rounding of the code;
        ``pack_codes`` rounds it to an integer and clips it at 0 (``expcast.encode``, ``expcast.round_codes``).
        """
        scores, anchor = self.scores, self.anchor
        unit = Float32(CODE_UNIT)
        coef = coef * unit
        for r in cutlass.range_constexpr(2):
            bias = anchor[r] * unit
            for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                scores[r, i] = cute.math.fma(scores[r, i], coef, bias)

    @cute.jit
    def load_repair_keys(self, d_k: cute.Tensor, first: Int32, half: cutlass.Constexpr[bool]):
        """Start loading the K descales (``d_k``, the head's R) of this lane's ``REPAIR_KEYS_PER_LANE`` keys of the
        repair tile whose keys start at ``first``. Called before the tile's wgmmas, read in ``encode_repair``.
        ``half``: a tile of 64 keys, the last, whose other 64 are past R (lanes of row groups 4..7 load none)."""
        self.load_lane_keys(d_k, first, half, self.repair_d_k)

    @cute.jit
    def load_lane_keys(self, row: cute.Tensor, first: Int32, half: cutlass.Constexpr[bool], into: cute.Tensor):
        """``into[p] = row[repair_key(first, p)]`` for this lane's slots; in a half tile, none past the row's end."""
        for p in cutlass.range_constexpr(REPAIR_KEYS_PER_LANE):
            key = self.repair_key(first, p)
            if const_expr(half):
                if key < row.shape[0]:
                    into[p] = row[key]
            else:
                into[p] = row[key]

    def repair_key(self, first: Int32, slot: int) -> Int32:
        """The key this lane loads into ``slot``: that of score column ``4 g + slot`` (g: the lane's row group in its
        warp), column ``slot``'s key plus ``REPAIR_GROUP_KEYS g``."""
        return first + self.key_coords[0, slot][1] + REPAIR_GROUP_KEYS * (cute.arch.lane_idx() // 4)

    def tile_scores(self, half: bool) -> cute.Tensor:
        """The rows view of a tile's scores (32 columns a thread), or of a half tile's (16: keys 0..63)."""
        return self.scores_half if half else self.scores

    @cute.jit
    def encode_repair(
        self, tiles: cute.Tensor, first: Int32, visits, whole: cutlass.Boolean, half: cutlass.Constexpr[bool]
    ):
        """A repair tile: ``encode`` with a coefficient per key (each key's own descale: repair keys come from any
        block; ``load_repair_keys``) on the row's final anchor, which the tile does not move; code 0 for
        the keys whose token's tile (``tiles``, the head's R, from ``first``) this CTA did not visit
        (``visits(tile)`` false: another piece's keys). ``whole``: this CTA visits every tile (an unsplit unit), so
        every key is its own and neither ``tiles`` nor ``visits`` is read. ``half``: a tile of 64 keys, the last
        (``load_repair_keys``), its scores in ``acc_s_half``.

        A repair key's score equals that of the real key it copies, which this CTA visited, so its code is at most
        TOP_CODE on the final anchor, as that key's; the zero keys padding the last repair tile score 0, which a row
        whose scores are all negative encodes above TOP_CODE (127 would be E4M3's NaN, and NaN times their zero values
        is NaN): codes are clamped to TOP_CODE.
        """
        if whole:
            self.encode_repair_keys(None, None, half)
        else:
            token_tiles = cute.make_rmem_tensor((REPAIR_KEYS_PER_LANE,), Int32)
            self.load_lane_keys(tiles, first, half, token_tiles)
            self.encode_repair_keys(token_tiles, visits, half)

    @cute.jit
    def encode_repair_keys(
        self, token_tiles: cute.Tensor | None, visits: cutlass.Constexpr, half: cutlass.Constexpr[bool]
    ):
        """``encode_repair``'s codes; ``visits`` None keeps every key (one path per case, each fully unrolled). Each
        column's descale (and token's tile, ``token_tiles``: this lane's) comes by shuffle from the lane that loaded
        it (``repair_key_source``); a half tile's columns come from row groups 0..3 only."""
        scores, anchor, s, descales = self.tile_scores(half), self.anchor, self.s, self.repair_d_k
        unit = Float32(CODE_UNIT)
        top = Float32(TOP_CODE * CODE_UNIT)
        biases = [anchor[r] * unit for r in range(2)]
        for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
            group, slot = repair_key_source(i)
            share = functools.partial(cute.arch.shuffle_sync, offset=4 * group, mask_and_clamp=QUAD_SEGMENT)
            coef = mul_rn(s, share(descales[slot])) * unit
            if const_expr(visits is None):
                for r in cutlass.range_constexpr(2):
                    scores[r, i] = cute.arch.fmin(cute.math.fma(scores[r, i], coef, biases[r]), top)
            else:
                kept = visits(share(token_tiles[slot]))
                for r in cutlass.range_constexpr(2):
                    code = cute.arch.fmin(cute.math.fma(scores[r, i], coef, biases[r]), top)
                    scores[r, i] = code if kept else Float32(0.0)

    @cute.jit
    def pack_codes(self, frag_p: cute.Tensor, half: cutlass.Constexpr[bool]):
        """Encoded accumulator -> E4M3 A fragment of the PV wgmma (see layout.py); ``half``: its first two
        k-blocks (keys 0..63) only, all that a half tile's PV reads.

        ``frag_p`` is ``((4, 2, 2), 1, K/32)``: 16 bytes per 32-key k-block, word ``r + 2 h`` holding row r,
        k positions ``4 lane + 16 h + 0..3``. Those take accumulator columns ``2 lane + e + 8 c`` of the
        k-block's 4 column groups, c = 2h (bytes 0, 1) and 2h + 1 (bytes 2, 3): one conversion per column group
        (e = 0 low half, e = 1 high half), one PRMT per word. Returns, per row, the max of its converted words' halves
        (``max.u16x2``; its codes' top is the larger half), for ``pack_codes_checked`` (codes above 255 wrap in their
        byte, not in the halves); where they go unused (the first tile, the repair tiles, a repack) the max trees are
        dead code and compile away.
        """
        codes = self.acc_s_half if half else self.acc_s
        p_words = cute.recast_tensor(frag_p, Uint32)
        k_blocks = cute.size(frag_p, mode=[2]) // (2 if half else 1)
        tops = [[None] * TOP_CHAINS for _ in range(2)]
        for kb in cutlass.range_constexpr(k_blocks):
            for h in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(2):
                    c = 4 * kb + 2 * h
                    first = pack_codes_f16(codes[1 + 2 * r + 4 * c], codes[2 * r + 4 * c])
                    second = pack_codes_f16(codes[1 + 2 * r + 4 * (c + 1)], codes[2 * r + 4 * (c + 1)])
                    p_words[r + 2 * h + 4 * kb] = byte_perm(first, second, HALF_LOW_BYTES)
                    pair = max_u16x2(first, second)
                    chain = tops[r]
                    chain[h] = pair if chain[h] is None else max_u16x2(chain[h], pair)
        return tuple(max_u16x2(chain[0], chain[1]) for chain in tops)

    @cute.jit
    def pack_codes_checked(self, frag_p: cute.Tensor, acc_pv: cute.Tensor):
        """``pack_codes`` of a real (whole) tile, encoded on the rows' anchors before the tile's max was known: a warp
        where some code passed TOP_CODE moves those rows' anchors (``move_anchor``) and packs again."""
        tops = self.pack_codes(frag_p, False)
        if warp_any_half_above(max_u16x2(tops[0], tops[1]), TOP_CODE) != 0:
            self.move_anchor(acc_pv, tops)
            self.pack_codes(frag_p, False)

    @cute.jit
    def move_anchor(self, acc_pv: cute.Tensor, tops: tuple[Uint32, Uint32]):
        """A row whose top code passed TOP_CODE moves its anchor down by ``shift`` = that code less MOVE_CODE, so that
        the top code becomes 112 (``expcast.code_shift``): its codes by ``shift`` (FP32, exact for every code above 0),
        the wgmma's sum ``acc_pv`` and ``pending`` (O's at its next promotion) by ``alpha = 2^(-shift / 8)``. The PV
        sum of the tiles before is already in ``acc_pv`` (or, at a promotion, in O, with ``pending`` reset).

        The top code is the larger half of the row's packed maximum (``tops``, ``pack_codes``: this lane's 32 of the
        row's codes), the max over the row's four lanes (shuffles: before any branch that could split the warp):
        ``rne(max(y) 2^24)`` itself below EXACT_PACKED_CODES. Where any lane of the warp holds a code at or above it
        (FP16 rounds those to fewer digits, or to inf), the whole warp takes the FP32 codes' max instead, rounded."""
        scores, anchor, pending = self.scores, self.anchor, self.pending
        tile = rows_view(acc_pv)
        unit = Float32(CODE_UNIT)
        top = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            top[r] = quad_max(larger_half(tops[r]))
        if warp_any_half_above(max_u16x2(tops[0], tops[1]), EXACT_PACKED_CODES - 1) != 0:
            for r in cutlass.range_constexpr(2):
                top[r] = cute.math.roundeven(row_max(scores, r) * Float32(UNITS_PER_CODE))
        for r in cutlass.range_constexpr(2):
            if top[r] > Float32(TOP_CODE):
                shift = top[r] - Float32(self.move_code)
                anchor[r] = anchor[r] - shift
                alpha = cute.math.exp2(-shift * LOG2_PER_CODE, fastmath=True)
                pending[r] = pending[r] * alpha
                for i in cutlass.range_constexpr(cute.size(tile, mode=[1])):
                    tile[r, i] = tile[r, i] * alpha
                step = shift * unit
                for i in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                    scores[r, i] = scores[r, i] - step

    @cute.jit
    def promote(self, acc_o: cute.Tensor, acc_pv: cute.Tensor, due: cutlass.Boolean):
        """If ``due``, move the wgmma's sum into the FP32 one, ``O = fma(O, pending, PV)`` (l, column 128, included),
        and reset ``pending`` to 1: O takes every anchor move since the last promotion at once (with none, the FMA by
        1.0 is the plain add). Runs after the PV wait (it reads the wgmma's sum) and before the codes' check, whose
        moves rescale what it leaves (``move_anchor``)."""
        if due:
            rows, tile, pending = rows_view(acc_o), rows_view(acc_pv), self.pending
            for r in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(cute.size(rows, mode=[1])):
                    rows[r, i] = cute.math.fma(rows[r, i], pending[r], tile[r, i])
                pending[r] = Float32(1.0)
