"""SASS census of every sm90 kernel variant, compiled for sm_90a on any machine (no GPU): per kernel, the
instruction count by opcode, a hash of the opcode sequence and a hash of the whole SASS (operands included).

    python notes/sass_census.py census.json                      # compile every kernel, write the census
    python notes/sass_census.py after.json --compare before.json  # ... and print what changed (exit 1 if any)
    python notes/sass_census.py one.json --only fwd_window        # a regex over the kernel names

A change that must keep behaviour (a refactor) keeps every kernel's "sass" hash. Each kernel compiles in its own
process: the DSL reads its dump settings at import. Needs nvdisasm (the ``[sass]`` extra).
"""

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

FORWARD = (
    "from openvc_kernels.ops import compile_attention; from openvc_kernels.sm90.config import ForwardConfig; "
    "compile_attention(ForwardConfig(plain_order={plain}, write_lse={lse}))"
)
PREP = "import torch; from openvc_kernels.prep_ops import compile_prep; compile_prep({kind!r}, {dtype})"
PREP_KINDS = (
    "channel_sums_per_block", "channel_mean", "quantize_q", "quantize_per_block", "quantize_centered_per_block",
    "absmax_per_head", "absmax_and_channel_sums", "pack_v", "pack_v_energy", "select_repair_tokens",
    "select_repair_tokens_resident", "repair_rows", "descale_guards", "absmax_and_rotated_channel_sums",
    "rotary_quantize_qk", "rotary_quantize_qk_centered",
)
DTYPE_FREE_KINDS = ("channel_mean", "select_repair_tokens", "select_repair_tokens_resident", "descale_guards")
"""``prep_ops.PREP_KINDS`` and ``prep_ops.DTYPE_FREE_KINDS`` (compiled once, for no input dtype), copied: this script
imports nothing of the package, each kernel compiles in a process of its own."""
KERNELS = {
    "fwd_window": FORWARD.format(plain=False, lse=False),
    "fwd_plain": FORWARD.format(plain=True, lse=False),
    "fwd_window_lse": FORWARD.format(plain=False, lse=True),
    **{
        f"prep_{kind}_{dtype}": PREP.format(kind=kind, dtype=f"torch.{dtype}")
        for kind in PREP_KINDS
        if kind not in DTYPE_FREE_KINDS
        for dtype in ("bfloat16", "float16")
    },
    **{f"prep_{kind}": PREP.format(kind=kind, dtype=None) for kind in DTYPE_FREE_KINDS},
}
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+((?:@!?U?P\w+\s+)?[A-Z0-9][.A-Z0-9]*[^;]*);")
OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z0-9][.A-Z0-9]*)")
"""An instruction line of nvdisasm's output: ``/*0120*/ @!P0 FFMA R1, R2, R3, R4 ;``; the opcode after the guard."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def census_of(sass: str) -> dict:
    instructions = [" ".join(i.split()) for i in INSTRUCTION.findall(sass)]
    opcodes = [OPCODE.match(i).group(1) for i in instructions]
    return {
        "instructions": len(opcodes),
        "opcodes_hash": _digest(" ".join(opcodes)),
        "sass_hash": _digest("\n".join(instructions)),
        "counts": dict(sorted(Counter(opcodes).items())),
    }


def compile_one(name: str) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="sass", CUTE_DSL_DUMP_DIR=dump)
        subprocess.run([sys.executable, "-c", KERNELS[name]], env=env, check=True)
        (sass,) = Path(dump).glob("*.sass")
        return census_of(sass.read_text())


def differences(before: dict, after: dict) -> list[str]:
    lines = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            lines.append(f"{name}: only {'after' if old is None else 'before'}")
        elif old["sass_hash"] != new["sass_hash"]:
            counts = {op: (old["counts"].get(op, 0), new["counts"].get(op, 0))
                      for op in old["counts"].keys() | new["counts"].keys()}
            moved = ", ".join(f"{op} {a} -> {b}" for op, (a, b) in sorted(counts.items()) if a != b)
            lines.append(f"{name}: {old['instructions']} -> {new['instructions']} instructions; {moved or 'same counts'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="where to write the census (JSON)")
    parser.add_argument("--compare", metavar="BEFORE", help="an earlier census to compare with")
    parser.add_argument("--only", metavar="REGEX", help="only the kernels whose name matches")
    args = parser.parse_args()
    census = {}
    for name in KERNELS:
        if args.only is None or re.search(args.only, name):
            census[name] = compile_one(name)
            print(name, census[name]["instructions"], census[name]["sass_hash"], flush=True)
    Path(args.output).write_text(json.dumps(census, indent=1) + "\n")
    if args.compare is None:
        return 0
    before = json.loads(Path(args.compare).read_text())
    if args.only is not None:
        before = {name: value for name, value in before.items() if re.search(args.only, name)}
    changed = differences(before, census)
    print("\n".join(changed) if changed else "identical")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
