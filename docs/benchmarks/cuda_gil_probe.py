"""Whether a Python thread runs while another waits for the GPU in cuStreamSynchronize.

    python docs/benchmarks/cuda_gil_probe.py [--seconds 0.5]

`hipc serve`'s engine thread waits for each batch step in the driver's stream synchronize
(cuda-bindings, runtime/backends/cuda.py); the HTTP threads stream the tokens meanwhile only
if that wait releases the GIL. A counting thread's rate is measured while the main thread
(1) sleeps, (2) waits in cuStreamSynchronize for ~--seconds of queued memsets, (3) spins in
Python (holding the GIL, a reference for "blocked"). (2) near (1): the wait releases the GIL.
"""

from __future__ import annotations

import argparse
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    from cuda.bindings import driver as cu

    def ok(result):
        if int(result[0]) != 0:
            raise SystemExit(f"CUDA error {result[0]}")
        return result[1] if len(result) == 2 else None

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    stream = ok(cu.cuStreamCreate(0))
    nbytes = 1 << 30
    buf = ok(cu.cuMemAlloc(nbytes))

    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counter, daemon=True)
    t.start()
    time.sleep(0.1)

    def rate(wait) -> tuple[float, float]:
        c0, t0 = count[0], time.perf_counter()
        wait()
        dt = time.perf_counter() - t0
        return (count[0] - c0) / dt, dt

    def spin() -> None:
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            pass

    # time one memset, then queue enough for --seconds
    ok(cu.cuMemsetD32Async(buf, 0, nbytes // 4, stream))
    ok(cu.cuStreamSynchronize(stream))
    t0 = time.perf_counter()
    for _ in range(10):
        ok(cu.cuMemsetD32Async(buf, 0, nbytes // 4, stream))
    ok(cu.cuStreamSynchronize(stream))
    one = (time.perf_counter() - t0) / 10

    def gpu_wait() -> None:
        for _ in range(max(1, int(args.seconds / one))):
            ok(cu.cuMemsetD32Async(buf, 0, nbytes // 4, stream))
        ok(cu.cuStreamSynchronize(stream))

    sleeping = rate(lambda: time.sleep(args.seconds))
    syncing = rate(gpu_wait)
    spinning = rate(spin)
    stop.set()
    t.join()
    ok(cu.cuMemFree(buf))
    import cuda.bindings

    print(
        f"cuda-bindings {getattr(cuda.bindings, '__version__', '?')}; 1 GiB memset {one * 1e3:.2f} ms"
    )
    for name, (r, dt) in (("sleep", sleeping), ("cuStreamSynchronize", syncing),
                          ("Python spin (GIL held)", spinning)):  # fmt: skip
        print(f"counting thread while the main thread {name}: {r:,.0f} /s over {dt:.2f} s "
              f"({r / sleeping[0]:.2f} of sleep's)")  # fmt: skip


if __name__ == "__main__":
    main()
