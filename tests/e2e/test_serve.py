"""The model repository served by a real tritonserver (the nvidia-pytriton wheel's binary, on CPU),
queried with real clients over HTTP (generate, generate_stream) and gRPC streaming."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import urllib.error
import urllib.request

import numpy as np
import pytest

from pipeline.demo import sudoku
from pipeline.limits import Limits
from pipeline.serving.client import complete
from tests._utils.availability import needs_tritonserver
from tests._utils.serve import free_port, metric, scrape, start_tritonserver

pytestmark = needs_tritonserver

PUZZLES = sudoku.make_dataset(4242, 8, (55, 61))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    work = tmp_path_factory.mktemp("serve")
    repo = package(
        default_model_path(), work / "repo", limits=Limits(max_batch=8, max_tokens=512, max_prompt=100)
    )
    srv = start_tritonserver(repo, work)
    try:
        yield srv
    finally:
        srv.stop()


def test_server_start_retries_when_a_port_is_taken(tmp_path):
    """The race, forced: the first ports handed out are held by another socket; the second start works.
    The taken port is refused before any tritonserver starts (one that started would be answered for by
    the server already there)."""
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    repo = package(default_model_path(), tmp_path / "repo", limits=Limits(max_batch=2, max_tokens=128))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        handed = iter([taken])  # the first pick is the taken port, then free ones
        srv = start_tritonserver(repo, tmp_path, pick=lambda: next(handed, None) or free_port())
        try:
            assert srv.ports.http != taken and srv.ready()
            assert not (tmp_path / "tritonserver.0.log").exists()  # refused before tritonserver started
        finally:
            srv.stop()


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_config_is_decoupled_with_our_tensors(server):
    with urllib.request.urlopen(f"{server.http_url}/v2/models/dgpipe/config") as r:
        cfg = json.loads(r.read())
    assert cfg["model_transaction_policy"]["decoupled"] is True
    names = {i["name"] for i in cfg["input"]}
    assert {
        "text_input",
        "max_tokens",
        "stream",
        "seed",
        "stop_words",
        "max_denoising_steps",
        "infill_template",
    } <= names
    assert {o["name"] for o in cfg["output"]} >= {
        "text_output",
        "finish_reason",
        "denoise_steps",
        "num_output_tokens",
    }


def test_http_generate(server):
    puzzle = PUZZLES[0][0]
    status, body = post(
        f"{server.http_url}/v2/models/dgpipe/generate",
        {
            "text_input": puzzle,
            "max_tokens": 82,
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
        },
    )
    assert status == 200, body
    out = json.loads(body)
    assert sudoku.is_valid_solution(puzzle, out["text_output"])
    assert out["finish_reason"] == "stop" and out["num_output_tokens"] == 82


def test_guided_generate_over_http_and_unsupported_schema_is_a_400(server):
    """Constrained decoding through real Triton: the digits the model would not write, and a refusal."""
    url = f"{server.http_url}/v2/models/dgpipe/generate"
    guide = {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[1-3]{81}"}
    status, body = post(
        url, {"text_input": PUZZLES[2][0], "max_tokens": 82, "exclude_input_in_output": True, **guide}
    )
    assert status == 200, body
    assert re.fullmatch("[1-3]{81}", json.loads(body)["text_output"])
    schema = json.dumps({"type": "array", "uniqueItems": True})
    bad = {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema}
    status, body = post(url, {"text_input": PUZZLES[2][0], "max_tokens": 82, **bad})
    assert status == 400 and "keyword 'uniqueItems' at # is not supported" in body, body


def test_http_generate_stream_and_grpc_stream_agree(server):
    puzzle, _ = PUZZLES[1]
    http = complete(server.http_url, puzzle, max_tokens=82, stream=True, seed=7)
    grpc = complete(server.grpc_url, puzzle, max_tokens=82, stream=True, seed=7)
    assert http.text == grpc.text and sudoku.is_valid_solution(puzzle, http.text)
    assert http.denoise_steps == grpc.denoise_steps and len(http.denoise_steps) == 1
    assert http.finish_reason == grpc.finish_reason == "stop"


def test_eight_concurrent_requests_are_all_solved(server):
    def ask(pair):
        puzzle, _ = pair
        return puzzle, complete(server.http_url, puzzle, max_tokens=82, exclude_input_in_output=True)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, PUZZLES))
    solved = sum(sudoku.is_valid_solution(p, r.text) for p, r in results)
    assert all(len(r.text) == 81 for _, r in results)
    assert solved >= 7, f"{solved}/8 solved"


def metrics(server) -> dict[str, float]:
    """The dgpipe_ samples on the metrics port, by name and bucket (`x_bucket{le="1"}`), summed over the
    model instances' series (each instance labels its own: model, version, model_instance)."""
    out: dict[str, float] = {}
    for key, value in scrape(server.metrics_url).items():
        if not key.startswith("dgpipe_"):
            continue
        name, _, labels = key.partition("{")
        le = re.search(r'le="([^"]*)"', labels)
        key = f'{name}{{le="{le[1]}"}}' if le else name
        out[key] = out.get(key, 0.0) + value
    return out


HISTOGRAMS = (
    "dgpipe_time_to_first_canvas_seconds",
    "dgpipe_canvas_latency_seconds",
    "dgpipe_steps_per_canvas",
    "dgpipe_request_latency_seconds",
)


def test_metrics_port_shows_our_metrics(server):
    complete(server.http_url, PUZZLES[2][0], max_tokens=82)
    # each model instance's own series (Triton would hand instances asking for the same labels one series),
    # labelled model_instance: Prometheus keeps `instance` for the scrape target
    (series,) = [k for k in scrape(server.metrics_url) if k.startswith("dgpipe_requests_total{")]
    assert 'model="dgpipe"' in series and 'model_instance="dgpipe_0' in series and 'version="1"' in series
    values = metrics(server)
    assert values["dgpipe_requests_total"] >= 2 and values["dgpipe_canvases_total"] >= 1
    assert values["dgpipe_generated_tokens_total"] >= 82
    # every prompt is looked up in the prefix cache; an 81-cell puzzle is shorter than one block: no hit
    assert values["dgpipe_prefix_cache_lookup_tokens_total"] >= 81
    assert values.get("dgpipe_prefix_cache_hit_tokens_total", 0.0) == 0.0
    for name in HISTOGRAMS:  # real Prometheus histograms: buckets up to +Inf, _sum and _count
        assert values[f'{name}_bucket{{le="+Inf"}}'] == values[f"{name}_count"] >= 1
        assert values[f"{name}_sum"] > 0


def test_load_gauges_return_to_zero_and_histograms_count_every_request(server):
    """Concurrent requests (more than the 8 batch slots, so some queue): once all are answered the
    active and queued gauges read 0, and each histogram counted every request or canvas exactly once."""
    prompts = [p for p, _ in PUZZLES + PUZZLES[:4]]  # 12 requests, 8 batch slots
    before = metrics(server)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(server.http_url, p, max_tokens=82), prompts))
    after = metrics(server)
    n = len(results)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert after["dgpipe_active_requests"] == 0 and after["dgpipe_queued_requests"] == 0
    canvases = delta("dgpipe_canvases_total")
    assert delta("dgpipe_requests_total") == n and canvases >= n
    assert delta("dgpipe_request_latency_seconds_count") == n
    assert delta("dgpipe_time_to_first_canvas_seconds_count") == n
    assert delta("dgpipe_canvas_latency_seconds_count") == canvases
    assert delta("dgpipe_steps_per_canvas_count") == canvases
    assert delta("dgpipe_steps_per_canvas_sum") == delta("dgpipe_denoise_steps_total")
    # cumulative buckets: never decreasing with le, the +Inf one equal to the count
    for name in HISTOGRAMS:
        buckets = sorted(
            (float(k.split('le="')[1].rstrip('"}')), v)
            for k, v in after.items()
            if k.startswith(f"{name}_bucket")
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1] == (float("inf"), after[f"{name}_count"])


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"max_tokens": 82}, "text_input"),
        ({"text_input": PUZZLES[0][0], "max_tokens": 0}, "max_tokens' must be >= 1"),
        ({"text_input": PUZZLES[0][0], "max_tokens": 100_000}, "over this server's limit of 512"),
        ({"text_input": "   "}, "empty"),
        ({"text_input": PUZZLES[0][0], "temperature_schedule": "cosine"}, "unknown parameter"),
        ({"text_input": PUZZLES[0][0], "entropy_bound": -1.0}, "entropy_bound"),
        ({"text_input": "1" * 500}, "puzzle"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, body, needle):
    status, text = post(f"{server.http_url}/v2/models/dgpipe/generate", body)
    assert 400 <= status < 500, (status, text)
    assert needle in text
    good = complete(server.http_url, PUZZLES[3][0], max_tokens=82, exclude_input_in_output=True)
    assert len(good.text) == 81 and good.finish_reason == "stop"


BAD_IN_A_BUSY_BATCH = [  # each reached the shared batch before: poisoned its slot, or failed every request
    ({"t_min": 1e-45, "t_max": 1e-45}, "input 't_min' must be in [0.001, 100]"),
    ({"t_min": 1e39, "t_max": 1e39}, "input 't_min' must be in [0.001, 100] (got inf)"),
    ({"seed": 2**63}, "input 'seed' must be in [0, 9223372036854775807]"),
    ({"max_denoising_steps": 10**6, "confidence_threshold": 0}, "over this server's limit of 256"),
]


def test_bad_values_in_a_busy_batch_get_400_and_never_touch_the_valid_requests(server):
    """The poisoning and big-seed requests sent among concurrent valid ones: each bad one gets a 400 naming
    its range, every valid one gets the answer it gets alone, and so do the requests after them in every
    batch slot (8 slots, 16 later requests)."""
    url = f"{server.http_url}/v2/models/dgpipe/generate"
    puzzles = [p for p, _ in PUZZLES]

    def ask(i: int) -> str:
        body = {
            "text_input": puzzles[i % 8],
            "max_tokens": 82,
            "seed": i % 8,
            "exclude_input_in_output": True,
        }
        status, text = post(url, body)
        assert status == 200, text
        return json.loads(text)["text_output"]

    alone = [ask(i) for i in range(6)]
    assert sum(sudoku.is_valid_solution(puzzles[i], t) for i, t in enumerate(alone)) >= 5

    def bad(case):
        values, _ = case
        return post(url, {"text_input": puzzles[0], "max_tokens": 82, **values})

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        valid = [pool.submit(ask, i) for i in range(6)]
        refused = [pool.submit(bad, case) for case in BAD_IN_A_BUSY_BATCH]
        assert [f.result() for f in valid] == alone
        for (values, needle), f in zip(BAD_IN_A_BUSY_BATCH, refused, strict=True):
            status, text = f.result()
            assert status == 400 and needle in text, (values, status, text)
        later = list(pool.map(ask, range(16)))
    assert later[:6] == alone and later[8:14] == alone  # same seed, same answer, whichever slot it got


def grpc_errors(server, inputs: list) -> list:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    errors: list = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    client.async_stream_infer("dgpipe", inputs)
    client.stop_stream()
    client.close()
    return errors


def test_undecodable_bytes_and_wrong_dtype_over_grpc(server):
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"\xff\xfe" + b"." * 79], dtype=np.object_))
    errors = grpc_errors(server, [text])
    assert errors and errors[0] is not None and "not valid UTF-8" in str(errors[0])
    # a wrong datatype is refused by Triton itself, naming the input (HTTP's JSON parser in Triton 2.51
    # answers a string-for-integer with a 500 that does not name the field, so this is checked over gRPC)
    text.set_data_from_numpy(np.array([PUZZLES[0][0].encode()], dtype=np.object_))
    mt = grpcclient.InferInput("max_tokens", [1], "FP32")
    mt.set_data_from_numpy(np.array([82.0], dtype=np.float32))
    errors = grpc_errors(server, [text, mt])
    assert errors and "max_tokens" in str(errors[0]) and "INT32" in str(errors[0])
    good = complete(server.grpc_url, PUZZLES[0][0], max_tokens=82, stream=True)
    assert len(good.text) == 81


def test_cancellation_between_steps(server):
    """A client that cancels its stream frees the request at the next step; the server keeps serving."""
    import time

    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton):
        t = grpcclient.InferInput(name, [1], triton)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t

    client = grpcclient.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    drafts: list = []
    client.start_stream(callback=lambda result, error: drafts.append((result, error)))
    client.async_stream_infer(
        "dgpipe",
        [
            tensor("text_input", PUZZLES[4][0].encode(), np.object_, "BYTES"),
            tensor("max_denoising_steps", 48, np.int32, "INT32"),
            tensor("confidence_threshold", 0.0, np.float32, "FP32"),  # fixed 48 steps: long enough to cancel
            tensor("stream_drafts", True, np.bool_, "BOOL"),
        ],
    )
    deadline = time.monotonic() + 60
    while not drafts and time.monotonic() < deadline:
        time.sleep(0.01)
    client.stop_stream(cancel_requests=True)
    client.close()
    assert drafts and len(drafts) < 48, "cancelled before the canvas finished"

    def cancelled() -> float:
        return metric(server.metrics_url, "dgpipe_requests_cancelled_total")

    while cancelled() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() >= 1
    assert len(complete(server.http_url, PUZZLES[5][0], max_tokens=82).text) > 0


def test_serve_image_prints_the_ngc_command(tmp_path):
    import subprocess
    import sys

    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    repo = package(default_model_path(), tmp_path / "repo")
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "serve", "--repo", str(repo), "--image", "nvcr.io/x/dgpipe:1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("docker run") and "--gpus all" in out and "nvcr.io/x/dgpipe:1 tritonserver" in out
    assert f"{repo.resolve()}:/models:ro" in out


def test_bench_serve_against_the_server(server, tmp_path):
    from pipeline.bench.serve import run_bench_serve

    run_bench_serve(server.http_url, server.grpc_url, [1, 2], 2, tmp_path)
    result = json.loads((tmp_path / "serve.json").read_text())
    assert {(r["protocol"], r["concurrency"]) for r in result["rows"]} == {
        (p, c) for p in ("http", "grpc", "in-process") for c in (1, 2)
    }
    for r in result["rows"]:
        # every request came back as an 81-digit solution (ok_rate counts those), and the throughput
        # columns agree with the request count: HTTP and gRPC count the 82-token canvas per request
        assert (r["requests"], r["ok_rate"]) == (2, 1.0), r
        if r["protocol"] != "in-process":
            assert r["tokens_per_s"] == pytest.approx(82 * r["requests_per_s"]), r
        else:  # the runtime's own token count: 81 digits + the end token
            assert 0 < r["tokens_per_s"] <= 82 * r["requests_per_s"] * (1 + 1e-9), r
        assert r["p50_ms"] > 0 and r["p99_ms"] < 120_000, r  # within the client timeout
    assert (tmp_path / "serve_throughput.png").stat().st_size > 1000


def test_deploy_smoke_check_against_the_server(server):
    """What the smoke Job runs (pipeline.deploy.smoke), with the Sudoku build's test: passes; the old
    "Hello" smoke prompt is refused by the Sudoku model and fails the check instead of raising."""
    import subprocess
    import sys

    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.runtime.session import default_model_path

    smoke = smoke_test_for(open_checkpoint(default_model_path()))

    def run(test) -> tuple[int, dict]:
        args = [a.replace("$$", "$") for a in test.args(server.http_url)]  # as the kubelet hands them over
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.deploy.smoke", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        return proc.returncode, json.loads(proc.stdout)

    rc, result = run(smoke)
    assert rc == 0 and result["ok"] and result["problem"] is None, result
    assert sudoku.is_valid_solution(smoke.prompt, result["answer"])
    rc, result = run(smoke.with_prompt("Hello"))
    assert rc == 1 and not result["ok"] and "puzzle" in result["problem"], result
