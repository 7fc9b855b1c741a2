"""Device time of a jitted call, shared by the benchmark scripts."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, input_sets, reps: int, sample_ms: float = 5.0, max_burst: int = 50) -> float:
    """Median device time per call of ``fn`` in ms over ``reps`` samples.

    Each sample enqueues a burst of calls back to back (cycling through ``input_sets``, tuples of
    arguments) and waits once, so the host's dispatch overlaps the device's work instead of adding
    to every call; the burst is sized from one timed call to last about ``sample_ms``.
    """
    for args in input_sets:  # compile and warm up
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*input_sets[0]))
    single_ms = 1e3 * (time.perf_counter() - start)
    burst = int(min(max_burst, max(1, round(sample_ms / max(single_ms, 1e-3)))))
    times = []
    for i in range(reps):
        start = time.perf_counter()
        for j in range(burst):
            result = fn(*input_sets[(i * burst + j) % len(input_sets)])
        jax.block_until_ready(result)
        times.append((time.perf_counter() - start) / burst)
    return 1e3 * float(np.median(times))
