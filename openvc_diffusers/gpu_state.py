"""What the benchmarks record of the GPU beside their timings: its clocks, temperature and power, read as they run."""

import subprocess

CLOCKS_QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw", "--format=csv,noheader"]


def clocks() -> str:
    """SM and memory clock, temperature and power draw now, as nvidia-smi prints them (empty without it)."""
    try:
        return subprocess.run(CLOCKS_QUERY, capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return ""
