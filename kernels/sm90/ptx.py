"""Inline-PTX helpers for the sm90 kernels: single instructions the DSL does not expose, or would contract or
convert differently (``mul.rn``, ``prmt``, ``cvt.rn.relu.f16x2``)."""

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
