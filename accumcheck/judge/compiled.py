"""numba's ``njit`` as the judge compiles with it: cached on disk, the GIL released, and a cache
that could not be written (a full disk, a file size limit) never failing the run that compiled."""

from __future__ import annotations

from typing import Any, Callable

import numba


def njit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(cache=True, nogil=True, **options)``, its cache written where it can be.

    numba adds a compiled overload to the dispatcher before it saves it to the cache, and lets an
    OSError from the save end the call: the kernel is ready, only the file is missing. Here that
    error is dropped (the next process compiles again), for this dispatcher alone; numba is left
    as it was for every other user."""
    def compile_(fn: Callable[..., Any]) -> Any:
        dispatcher = numba.njit(cache=True, nogil=True, **options)(fn)
        cache = getattr(dispatcher, "_cache", None)
        save = getattr(cache, "save_overload", None)
        if save is not None:
            def save_overload(sig: Any, data: Any) -> None:
                try:
                    save(sig, data)
                except OSError:
                    pass  # not cached: the next process compiles again
            cache.save_overload = save_overload
        return dispatcher
    return compile_
