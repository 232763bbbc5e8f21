"""A local world of CPU processes: run a function on N forked ranks joined by gloo (examples, tests, benchmarks)."""
from __future__ import annotations

from dataclasses import dataclass

def _child(rank: int, world: int, store_path: str, timeout_s: float, fn, args: tuple, err_path: str) -> None:
    import os
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # first: libgomp is not fork-safe once the parent used threads
    code = 0
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        fn(rank, world, *args)
        dist.destroy_process_group()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        with open(err_path, "w") as f:
            f.write(traceback.format_exc())
        code = 1
    os._exit(code)  # skip atexit handlers (a broken peer must not hang the exit)


@dataclass(frozen=True)
class WorldResult:
    exitcodes: tuple[int | None, ...]
    """Per rank; None = still running at the deadline (then killed)."""
    errors: tuple[str, ...]
    """Per rank: the traceback text of a failure ('' if none)."""
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c == 0 for c in self.exitcodes)

    def explain(self) -> str:
        return "\n".join(f"rank {r}: exit {c}\n{e}" for r, (c, e) in enumerate(zip(self.exitcodes, self.errors))
                         if c != 0)


def run_world(world: int, fn, args: tuple = (), *, tmpdir: str, timeout_s: float = 60.0,
              deadline_s: float = 180.0) -> WorldResult:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes joined by gloo over a FileStore.

    Each child sets one torch thread first, uses a process-group timeout of ``timeout_s``, and exits
    without atexit handlers. The parent waits at most ``deadline_s`` in all, then kills what is left.
    """
    import multiprocessing as mp
    import os
    import time

    ctx = mp.get_context("fork")
    store = os.path.join(tmpdir, f"store-{time.monotonic_ns()}")
    errs = [os.path.join(tmpdir, f"err-{time.monotonic_ns()}-{r}.txt") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(r, world, store, timeout_s, fn, args, errs[r]), daemon=True)
             for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline_s - (time.monotonic() - t0)))
    codes: list[int | None] = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    texts = tuple(open(e).read() if os.path.exists(e) else "" for e in errs)
    return WorldResult(exitcodes=tuple(codes), errors=texts, seconds=time.monotonic() - t0)
