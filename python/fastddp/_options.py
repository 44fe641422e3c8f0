"""fastddp's switches read from the environment (documented in the README)."""

import os

WORLD1_REDUCER_ENV = "FASTDDP_WORLD1_REDUCER"


def world1_reducer_requested() -> bool:
    """``FASTDDP_WORLD1_REDUCER=1``: build the C++ reducer at world size 1 too, so that a
    single process (one GPU over NCCL, or gloo) runs every bucket, hook and stream path.
    Without it, a world-size-1 model has no reducer unless a comm hook is registered."""
    value = os.environ.get(WORLD1_REDUCER_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{WORLD1_REDUCER_ENV}={value!r}: use 1 to build the reducer at world "
                     "size 1, 0 or unset for the bare module")
