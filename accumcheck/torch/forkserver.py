"""The fork server data-parallel ranks are started from (``distributed._spawn``): a process that
has imported PyTorch and the runner once (``rankserver``), so that each rank it forks starts in
milliseconds. This module imports no PyTorch: a data-parallel run starts the server before it
imports PyTorch itself, so that the two imports (seconds each) run side by side."""

from __future__ import annotations

import multiprocessing
import sys
from multiprocessing import forkserver

from ..run.launch import launched_world_size

_PRELOAD = __name__.rpartition(".")[0] + ".rankserver"


def start_method() -> str:
    """How ranks are started: from the fork server that has loaded ``rankserver``; where a
    platform has no fork server, spawned afresh."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload([_PRELOAD])
    return "forkserver"


def start_early() -> None:
    """Start the fork server now, in the background, where this process will start ranks of its
    own: not when torchrun started it, nor inside a process group it already belongs to. A server
    already running is kept."""
    if launched_world_size() is not None:
        return
    torch = sys.modules.get("torch")  # a process group can exist only where PyTorch is imported
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if start_method() == "forkserver":
        forkserver.ensure_running()
