"""What the environment says about a job launcher (torchrun), read without importing torch."""

from __future__ import annotations

import os

from .errors import AccumcheckError

# torchrun sets these for every rank; together they are what env:// rendezvous needs.
_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_world_size() -> int | None:
    """WORLD_SIZE when this process was started by torchrun (or a launcher that sets the same
    environment), else None."""
    if all(name in os.environ for name in _TORCHRUN_VARIABLES):
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise AccumcheckError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment is not an "
                                  "integer; unset it or start the job with torchrun") from None
    return None


def launched_rank() -> int:
    """This process's rank in a job started by torchrun; 0 outside one (or where the environment
    is malformed, which ``launched_world_size`` reports)."""
    try:
        return int(os.environ.get("RANK", "0")) if launched_world_size() is not None else 0
    except (AccumcheckError, ValueError):
        return 0
