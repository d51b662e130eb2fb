"""What the benchmarks record about the machine they ran on (imported by each when it runs)."""

from __future__ import annotations

import os


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def cpu_family(model: str) -> str:
    """The processor as the docs name it: "AMD EPYC 7B13 64-Core Processor" gives "AMD EPYC",
    "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz" gives "Intel Xeon Platinum"."""
    words = []
    for word in model.replace("(R)", "").replace("(TM)", "").split():
        if any(ch.isdigit() for ch in word) or word in ("CPU", "Processor", "@"):
            break
        words.append(word)
    return " ".join(words) or model


def load() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def write_result(path: str, result: dict) -> int:
    """A benchmark's figures as JSON at ``path`` (its folder made where missing); 0, the exit code."""
    import json
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {target}")
    return 0
