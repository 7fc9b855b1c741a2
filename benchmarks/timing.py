"""Device time of a jitted call, shared by the benchmark scripts."""

from __future__ import annotations

import time

import jax
import numpy as np


def _wall_ms(fn, input_sets, first: int, count: int, wait) -> float:
    """Wall time of ``count`` calls enqueued back to back (cycling from set ``first``), waited for once."""
    start = time.perf_counter()
    for j in range(count):
        result = fn(*input_sets[(first + j) % len(input_sets)])
    wait(result)
    return 1e3 * (time.perf_counter() - start)


def median_ms(fn, input_sets, reps: int, sample_ms: float = 5.0, max_burst: int = 50, wait=None) -> float:
    """Median device time per call of ``fn`` in ms over ``reps`` samples.

    Each sample times one call alone and a burst of ``n >= 2`` calls enqueued back to back
    (cycling through ``input_sets``, tuples of arguments) and takes ``(t_burst - t_one) / (n - 1)``:
    the host's dispatch of a burst's first call and the final wait cost the same in both and
    cancel, and the host dispatches the other calls while the device runs. ``n`` is sized from one
    call to make a burst last about ``sample_ms``. Calls the host dispatches more slowly than the
    device runs them measure the host instead (an upper bound on device time). ``wait(result)`` returns once
    the device has finished a call (default ``jax.block_until_ready``; for torch, ``torch.cuda.synchronize``).
    """
    wait = wait or jax.block_until_ready
    for args in input_sets:  # compile and warm up
        wait(fn(*args))
    single_ms = _wall_ms(fn, input_sets, 0, 1, wait)
    burst = int(min(max_burst, max(2, round(sample_ms / max(single_ms, 1e-3)))))
    times = []
    for i in range(reps):
        one = _wall_ms(fn, input_sets, i, 1, wait)
        times.append((_wall_ms(fn, input_sets, i + 1, burst, wait) - one) / (burst - 1))
    return float(np.median(times))
