"""Inline-PTX helpers for the sm90 kernels: single instructions the DSL does not expose, or would contract or
convert differently (``mul.rn``, ``prmt``, ``cvt.rn.relu.f16x2``, ``max.u16x2``, a vote on packed halves, a packed
word's larger half as FP32)."""

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def ptx(result_type, operands: list, instruction: str, constraints: str):
    """One side-effect-free PTX instruction on DSL values (``operands`` as IR values)."""
    return llvm.inline_asm(
        result_type, operands, instruction, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """FP32 product rounded on its own: ``mul.rn`` is never contracted into an FMA by ptxas."""
    operands = [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)]
    return Float32(ptx(T.f32(), operands, "mul.rn.f32 $0, $1, $2;", "=f,f,f"))


@dsl_user_op
def byte_perm(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """``prmt.b32``: byte i of the result is byte ``selector[4i:4i+4]`` of ``b:a`` (a = bytes 0-3)."""
    operands = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a, b)] + [Int32(selector).ir_value(loc=loc, ip=ip)]
    return Uint32(ptx(T.i32(), operands, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,n"))


@dsl_user_op
def pack_codes_f16(high: Float32, low: Float32, *, loc=None, ip=None) -> Uint32:
    """``cvt.rn.relu.f16x2.f32``: ``low`` and ``high`` (codes in units of 2^-24) rounded to FP16 and clipped at 0;
    the half from ``low`` is bytes 0-1 of the word, the one from ``high`` bytes 2-3."""
    operands = [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)]
    return Uint32(ptx(T.i32(), operands, "cvt.rn.relu.f16x2.f32 $0, $1, $2;", "=r,f,f"))


@dsl_user_op
def max_u16x2(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint32:
    """``max.u16x2``: each 16-bit half the larger of the two (codes packed as FP16 words >= 0 order as integers);
    ptxas fuses a tree of them into three-input VIMNMX3."""
    operands = [Uint32(v).ir_value(loc=loc, ip=ip) for v in (a, b)]
    return Uint32(ptx(T.i32(), operands, "max.u16x2 $0, $1, $2;", "=r,r,r"))


@dsl_user_op
def warp_any_half_above(word: Uint32, limit: int, *, loc=None, ip=None) -> Int32:
    """1 in every lane of the warp where some lane's ``word`` holds a 16-bit half above ``limit``, else 0 (one
    ``vote.sync.any``: a warp-uniform value to branch on)."""
    instruction = (
        "{ .reg .pred p, q; .reg .b32 low; and.b32 low, $1, 0xffff; setp.gt.u32 p, low, %d; "
        "setp.gt.or.u32 p, $1, %d, p; vote.sync.any.pred q, p, 0xffffffff; selp.u32 $0, 1, 0, q; }"
        % (limit, (limit << 16) | 0xFFFF)
    )
    return Int32(ptx(T.i32(), [Uint32(word).ir_value(loc=loc, ip=ip)], instruction, "=r,r"))


@dsl_user_op
def larger_half(word: Uint32, *, loc=None, ip=None) -> Float32:
    """The larger 16-bit half of ``word`` as an FP32 whole number: ``max.u16x2`` with the word shifted down, then the
    half's bits in the low mantissa of 2^23 less 2^23 (exact, and no integer-to-float conversion)."""
    instruction = (
        "{ .reg .b32 high, top; .reg .f32 biased; shr.b32 high, $1, 16; max.u16x2 top, $1, high; "
        "and.b32 top, top, 0xffff; or.b32 top, top, 0x4b000000; mov.b32 biased, top; "
        "sub.f32 $0, biased, 0f4B000000; }"
    )
    return Float32(ptx(T.f32(), [Uint32(word).ir_value(loc=loc, ip=ip)], instruction, "=f,r"))
