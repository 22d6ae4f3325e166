"""The benchmarks' one timer: a warm-up call, then the median of `repeats` calls."""
import time


def median_ms(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3
