"""`dgpipe bench serve --openai --url http://HOST:PORT/v1`: the OpenAI endpoint driven the way load tools
(NVIDIA AIPerf, guidellm) drive it, with their figures: time to first token, inter-token latency, output
tokens per second and requests per second, errors counted rather than raised.

Each request is what those tools send for a chat benchmark with a fixed output length: a streamed chat
completion with `max_completion_tokens`, vLLM's `ignore_eos` and `min_tokens` (the output runs to the
asked length) and `stream_options` `include_usage` + `continuous_usage_stats` (usage on every chunk,
AIPerf's `--per-chunk-usage`). Token counts are the server's own (`usage.completion_tokens`), as AIPerf's
`--use-server-token-count` reads them. Definitions follow the tools: TTFT from sending the request to the
first chunk with content; ITL = (latency - TTFT) / (output tokens - 1), the mean gap between tokens after
the first (a diffusion model commits a canvas of tokens at once, so the gaps between chunks are the
canvases', and this is the figure the tools print)."""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bench.results import percentile, save_result
from pipeline.bench.workload import BenchRequest

LOAD_JSON = "serve_openai_load.json"


@dataclass
class StreamSample:
    """One request's timings and counts; `error` set (and the rest partial) when it failed."""

    latency: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0
    usage_chunks: int = 0  # chunks that carried usage (every one with continuous_usage_stats)
    usage_monotonic: bool = True  # completion_tokens never went down from one chunk to the next
    text: str = ""
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # between content chunks

    @property
    def itl(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def load_body(model: str, req: BenchRequest, seed: int) -> dict[str, Any]:
    """The chat request a load tool sends for `req` with its output length fixed at `req.max_tokens`."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": req.prompt}],
        "max_completion_tokens": req.max_tokens,
        "ignore_eos": True,
        "min_tokens": req.max_tokens,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def read_stream(lines, start: float, clock=time.perf_counter) -> StreamSample:
    """Fold an SSE response's lines (bytes) into a StreamSample; `start` is when the request was sent."""
    s = StreamSample()
    last_content, last_completion = None, -1
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        now = clock()
        if "error" in event:
            s.error = str(event["error"].get("message", event["error"]))
            break
        s.chunks += 1
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or choice.get("text")
            if piece:
                s.text += piece
                if s.ttft is None:
                    s.ttft = now - start
                else:
                    s.gaps.append(now - last_content)
                last_content = now
        usage = event.get("usage")
        if usage:
            s.usage_chunks += 1
            s.usage_monotonic &= usage["completion_tokens"] >= last_completion
            last_completion = usage["completion_tokens"]
            s.output_tokens, s.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
    s.latency = clock() - start
    if s.error is None and s.usage_chunks == 0:
        s.error = "no usage in the stream"
    return s


def stream_request(url: str, body: dict[str, Any], api_key: str | None, timeout: float = 600) -> StreamSample:
    """POST one streamed chat completion to `url` (.../v1) and time it; failures become `error`."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(
        url.rstrip("/") + "/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return read_stream(resp, start)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()[:300]
        return StreamSample(latency=time.perf_counter() - start, error=f"HTTP {e.code}: {detail}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return StreamSample(latency=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")


def summarize(samples: list[StreamSample], wall: float) -> dict[str, Any]:
    """The load tools' figures over one level: successful requests only, errors counted."""
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    itl = [x for s in ok if (x := s.itl) is not None]
    lat = [s.latency for s in ok]
    ms = lambda xs, q: 1000 * percentile(xs, q) if xs else float("nan")
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s.error for s in samples if s.error})[:3],
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
        "output_tokens_mean": statistics.mean(s.output_tokens for s in ok) if ok else float("nan"),
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p99_ms": ms(ttft, 0.99),
        "itl_p50_ms": ms(itl, 0.5),
        "itl_p99_ms": ms(itl, 0.99),
        "latency_p50_ms": ms(lat, 0.5),
        "latency_p99_ms": ms(lat, 0.99),
        "usage_on_every_chunk": all(s.usage_chunks == s.chunks for s in ok),
        "usage_monotonic": all(s.usage_monotonic for s in ok),
    }


def run_openai_load(
    url: str,
    requests: list[BenchRequest],
    concurrency: list[int],
    out: Path,
    model: str,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Closed-loop clients at each concurrency (each sends its next request when the previous one ends),
    all requests of a level streamed as a load tool does; writes out/serve_openai_load.json."""
    rows = []
    stream_request(url, load_body(model, requests[0], 0), api_key)  # connections and imports warmed
    for c in concurrency:
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(c) as pool:
            samples = list(
                pool.map(
                    lambda ir: stream_request(url, load_body(model, ir[1], ir[0]), api_key),
                    enumerate(requests),
                )
            )
        rows.append({"concurrency": c, **summarize(samples, time.perf_counter() - start)})
    result = {
        "url": url,
        "model": model,
        "requests_per_level": len(requests),
        "output_tokens_asked": sorted({r.max_tokens for r in requests}),
        "fields": sorted(load_body(model, requests[0], 0)),
        "rows": rows,
    }
    save_result(out, LOAD_JSON, result)
    return result


def served_model(url: str, api_key: str | None) -> str:
    """The first model `GET /v1/models` lists (what a load tool asks for when given no model name)."""
    from pipeline.errors import DgpipeError

    req = urllib.request.Request(
        url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)["data"][0]["id"]
    except urllib.error.HTTPError as e:
        hint = "pass --api-key or set DGPIPE_API_KEY" if e.code == 401 else "is dgpipe serve running there?"
        raise DgpipeError(f"cannot list the models at {url}/models (HTTP {e.code})", hint) from e
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as e:
        raise DgpipeError(
            f"cannot list the models at {url}/models ({e})", "is dgpipe serve running there?"
        ) from e


def write_requests(path: Path, requests: list[BenchRequest]) -> Path:
    """The benchmark's requests as JSONL that AIPerf (`--custom-dataset-type single_turn`: `text`,
    `output_length`) and guidellm (`kind=json_file`: the `text` column, `output_tokens_count`) both read,
    so a load tool sends the same held-out prompts with the same output lengths; written atomically."""
    from pipeline.atomic import atomic_write_text

    lines = []
    for r in requests:
        n = r.max_tokens
        lines.append(json.dumps({"text": r.prompt, "output_length": n, "output_tokens_count": n}))
    return atomic_write_text(path, "\n".join(lines) + "\n")


def held_out_requests(n: int, output_tokens: int | None = None) -> list[BenchRequest]:
    """`n` held-out requests of the embedded model's prompt format (the serving benchmarks' requests), each
    asking for `output_tokens` (default: the reference answer's canvas length)."""
    from dataclasses import replace

    from pipeline.bench.serve import REQUEST_SEED
    from pipeline.bench.workload import bench_requests
    from pipeline.runtime.session import load_session

    reqs = bench_requests(load_session(), n, REQUEST_SEED, "`dgpipe bench serve --openai`")
    return [replace(r, max_tokens=output_tokens) for r in reqs] if output_tokens else reqs


def bench_openai_load(
    url: str,
    concurrency: list[int],
    requests: int,
    out: Path,
    model: str | None,
    api_key: str | None,
    output_tokens: int | None = None,
) -> dict[str, Any]:
    """`run_openai_load` with held-out prompts of the embedded model's format (the serving benchmarks'
    requests) and, without `model`, the name the server lists."""
    name = model or served_model(url, api_key)
    return run_openai_load(url, held_out_requests(requests, output_tokens), concurrency, out, name, api_key)


def render(result: dict[str, Any]) -> list[str]:
    head = (
        f"{result['url']} ({result['model']}), {result['requests_per_level']} streamed chat requests per level\n"
        f"{'conc':>5}{'req/s':>8}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
        f"{'ITL p99':>9}{'p50 ms':>9}{'errors':>8}"
    )
    lines = [head]
    for r in result["rows"]:
        lines.append(
            f"{r['concurrency']:>5}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>10.1f}"
            f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>9.2f}"
            f"{r['latency_p50_ms']:>9.1f}{r['errors']:>8}"
        )
        lines += [f"      error: {e}" for e in r["error_examples"]]
    return lines
