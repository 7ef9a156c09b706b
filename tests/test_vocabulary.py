"""The reference and the kernel use one name per quantity: every name in ``reference.py``'s table is in both
sources (no GPU, no cutlass: the sources are read as text)."""

import re
from pathlib import Path

import openvc_kernels

KERNELS = Path(openvc_kernels.__file__).parent
REFERENCE_SOURCES = ("reference.py", "expcast.py", "split.py", "wgmma.py")
KERNEL_SOURCES = ("sm90/fwd.py", "sm90/softmax.py", "sm90/pieces.py", "sm90/epilogue.py", "ops.py")
ROW = re.compile(r"^    (\S[^|]*) \| ([^|]+) \| ")


def _table() -> list[tuple[list[str], list[str]]]:
    rows = []
    for line in openvc_kernels.reference.__doc__.splitlines():
        match = ROW.match(line)
        if match:
            rows.append(tuple([name.strip() for name in cell.split(",")] for cell in match.groups()))
    return rows


def _identifiers(sources: tuple[str, ...]) -> set[str]:
    return {word for name in sources for word in re.findall(r"\w+", (KERNELS / name).read_text())}


def test_table_names_exist_on_both_sides():
    rows = _table()
    assert len(rows) >= 10, "the table in reference.py's docstring is missing or unreadable"
    reference, kernel = _identifiers(REFERENCE_SOURCES), _identifiers(KERNEL_SOURCES)
    for reference_names, kernel_names in rows:
        assert set(reference_names) <= reference, f"not in the reference: {set(reference_names) - reference}"
        assert set(kernel_names) <= kernel, f"not in the kernel: {set(kernel_names) - kernel}"
