"""Overload of one replica: `python docs/benchmarks/overload.py N OUT.json` (from the repository root).

N concurrent OpenAI completions (the README's puzzle, 4 fixed steps per canvas) against `dgpipe serve` of the
embedded model with max_batch 4, once with max_queue 64 and once unbounded (max_queue 0), one after the
other. Per arm: the statuses (with Retry-After), latency of the answered requests and of the refused ones,
and the server's own counts (dgpipe_requests_total, dgpipe_requests_shed_total). BENCHMARKS.md, Reliability.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import aiohttp

from pipeline.limits import Limits
from pipeline.runtime.session import default_model_path
from pipeline.serving.repository import package
from tests._utils.serve import README_PUZZLE, scrape, start_serve


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


async def flood(url: str, n: int) -> list[tuple[int, str | None, float]]:
    async def one(session: aiohttp.ClientSession, seed: int) -> tuple[int, str | None, float]:
        body = {"model": "dgpipe", "prompt": README_PUZZLE, "max_tokens": 82, "seed": seed,
                "max_denoising_steps": 4, "confidence_threshold": 0.0}  # fmt: skip
        t0 = time.perf_counter()
        async with session.post(url + "/completions", json=body) as r:
            await r.read()
            return r.status, r.headers.get("Retry-After"), time.perf_counter() - t0

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*[one(session, i) for i in range(n)])


def arm(n: int, max_queue: int, work: Path) -> dict:
    limits = Limits(max_batch=4, max_tokens=512, max_prompt=100, max_queue=max_queue)
    srv = start_serve(package(default_model_path(), work / "repo", limits=limits), work)
    try:
        t0 = time.perf_counter()
        res = asyncio.run(flood(srv.openai, n))
        wall = time.perf_counter() - t0
        samples = scrape(srv.metrics)
    finally:
        srv.stop()
    ok = sorted(r[2] for r in res if r[0] == 200)
    return {
        "max_queue": max_queue,
        "statuses": {f"{s} retry-after={ra}": c for (s, ra), c in Counter((r[0], r[1]) for r in res).items()},
        "ok_p50_s": ok[len(ok) // 2] if ok else None,
        "ok_max_s": ok[-1] if ok else None,
        "refused_max_s": max((r[2] for r in res if r[0] == 503), default=None),
        "shed_total": total(samples, "dgpipe_requests_shed_total"),
        "accepted_total": total(samples, "dgpipe_requests_total"),
        "wall_s": wall,
    }


def main() -> None:
    n, out = int(sys.argv[1]), Path(sys.argv[2])
    arms = {}
    for name, max_queue in (("bounded", 64), ("unbounded", 0)):
        arms[name] = arm(n, max_queue, out.parent / f"overload-{name}")
        print(name, json.dumps(arms[name]), flush=True)
    out.write_text(json.dumps({"requests": n, "max_batch": 4, "arms": arms}, indent=2) + "\n")


if __name__ == "__main__":
    main()
