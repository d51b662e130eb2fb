"""What the benchmarks record about the machine they ran on (imported by each when it runs)."""

from __future__ import annotations


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"
