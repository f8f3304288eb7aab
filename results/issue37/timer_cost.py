"""A request's timeout, two ways, on uvloop: a timer of its own (`call_later`, then `cancel` once answered: what
`pipeline.fail_after` did) against an entry in `Timeouts` (`add`, then `discard`). CPU per request, best of 5.

    python results/issue37/timer_cost.py
"""
import time

import uvloop

from jaxserve.scheduling.timeouts import Timeouts

N = 100_000


async def main():
    import asyncio

    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(N)]
    timeouts = Timeouts(loop)
    noop = lambda f: None

    def own_timer():
        for f in futures:
            loop.call_later(60.0, noop, f).cancel()

    def one_timer():
        for f in futures:
            timeouts.add(f, 60.0)
            timeouts.discard(f)

    for name, fn in (("call_later + cancel", own_timer), ("Timeouts.add + discard", one_timer)):
        best = min(_timed(fn) for _ in range(5))
        print(f"{name}: {1e6 * best / N:.2f} us a request")


def _timed(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


uvloop.run(main())
