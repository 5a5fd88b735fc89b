"""One timing rule for the kernel benchmarks: ``triton.testing.do_bench`` on GPU (median and
20/80 % quantiles), a warmed-up perf_counter median over a few runs on CPU."""
import statistics
import time


def time_ms(fn, on_gpu: bool, runs: int = 5):
    """(median, p20 or fastest, p80 or slowest) in ms."""
    if on_gpu:
        from triton.testing import do_bench
        return tuple(do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8]))
    fn()  # warm-up (imports, interpreter setup)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return statistics.median(times), times[0], times[-1]
