"""FP32 bit fields, for the kernels that test floats on their bits (so that no compiler assumption about non-finite
floats can change a test): ``sm90.guards`` (which heads are not finite) and ``sm90.select`` (the order keys)."""

SIGN_BIT = 0x80000000
EXPONENT_BITS = 0x7F800000
"""The exponent field, all ones: +inf's bits. No finite value's bits reach it; inf's and NaN's have it."""
MAGNITUDE_BITS = 0x7FFFFFFF
"""The bits without the sign: above ``EXPONENT_BITS`` exactly for NaN."""
