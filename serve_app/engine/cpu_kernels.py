"""CPU paged-attention decode kernel (C++, built once per machine with torch's extension builder).

The reference path (gather the blocks, then `scaled_dot_product_attention`) copies every decode
request's whole context each layer and runs thousands of tiny attention problems; the kernel
(csrc/paged_decode.cpp, whose header explains its loops) reads K/V in place from the block tables,
with the query heads of a GQA group sharing each K/V row it loads. fp32 accumulation.

`paged_decode_kernel()` returns the op, or None (with a warning) when it cannot be built; callers
then use the reference path. `python -m serve_app.engine.cpu_kernels` builds it ahead of time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


@functools.cache
def paged_decode_kernel():
    """Build (or load the cached build of) the kernel; None if that fails."""
    try:
        from torch.utils.cpp_extension import load

        # the name carries the source's hash: checkouts with different kernels never share a build
        digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
        module = load(
            name=f"serve_app_paged_decode_{digest}",
            sources=[str(_SOURCE)],
            # fast-math for vectorized exp (glibc libmvec); finite-math off to keep inf/nan semantics
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
            extra_ldflags=["-fopenmp"],
            verbose=bool(os.environ.get("SERVE_APP_VERBOSE_BUILD")),
        )
    except Exception as exc:  # no compiler, no ninja, ...: the reference path still works
        logger.warning("CPU paged-attention kernel unavailable (%s); using the torch reference path", exc)
        return None
    return module.paged_decode


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print("[kernel] building the CPU paged-attention kernel (about a minute the first time) ...", flush=True)
    print("[kernel] ready" if paged_decode_kernel() is not None else "[kernel] unavailable: reference path will be used")
