"""`dgpipe serve` with its OpenAI-compatible frontend, run as a user runs it (the CLI, a real tritonserver on
the embedded Sudoku model), queried with the official `openai` client: chat and text completions, streaming
with usage, the API key, and refusals in OpenAI's error schema."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import urllib.error
import urllib.request

import pytest

from pipeline.demo import sudoku
from pipeline.limits import Limits
from tests._utils.availability import needs_tritonserver
from tests._utils.cli import ROOT, dgpipe
from tests._utils.serve import README_PUZZLE, free_port, frontend_only, start_serve, without_api_key

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = needs_tritonserver

PUZZLE = README_PUZZLE
KEY = "test-key-0123"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from pipeline.runtime.session import default_model_path
    from pipeline.serving.repository import package

    work = tmp_path_factory.mktemp("openai")
    repo = package(
        default_model_path(), work / "repo", limits=Limits(max_batch=8, max_tokens=512, max_prompt=100)
    )
    srv = start_serve(repo, work, {"DGPIPE_API_KEY": KEY})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.openai, api_key=KEY, max_retries=0, timeout=120)


def test_chat_completion_solves_the_readme_puzzle_with_usage(client):
    resp = client.chat.completions.create(
        model="dgpipe", messages=[{"role": "user", "content": PUZZLE}], max_tokens=82, seed=0
    )
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert sudoku.is_valid_solution(PUZZLE, choice.message.content), choice.message.content
    assert resp.usage.prompt_tokens > 0 and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_text_completion_and_models(client):
    resp = client.completions.create(model="dgpipe", prompt=PUZZLE, max_tokens=82, temperature=0.8)
    assert sudoku.is_valid_solution(PUZZLE, resp.choices[0].text)
    assert resp.usage.completion_tokens > 0
    assert [m.id for m in client.models.list()] == ["dgpipe"]


def test_streaming_yields_chunks_and_a_final_usage(client):
    stream = client.chat.completions.create(
        model="dgpipe",
        messages=[{"role": "user", "content": PUZZLE}],
        max_tokens=82,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"max_denoising_steps": 24},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sudoku.is_valid_solution(PUZZLE, text)
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_async_streaming_completion(served):
    async def run() -> str:
        aclient = openai.AsyncOpenAI(base_url=served.openai, api_key=KEY, max_retries=0, timeout=120)
        stream = await aclient.completions.create(model="dgpipe", prompt=PUZZLE, max_tokens=82, stream=True)
        pieces = [c.choices[0].text async for c in stream]
        await aclient.close()
        return "".join(pieces)

    assert sudoku.is_valid_solution(PUZZLE, asyncio.run(run()))


def test_bad_api_key_is_a_401_and_health_stays_open(served):
    bad = openai.OpenAI(base_url=served.openai, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="dgpipe", messages=[{"role": "user", "content": PUZZLE}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with urllib.request.urlopen(served.openai.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200


def test_refusals_are_400s_in_openais_schema_and_the_server_keeps_serving(client, served):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="dgpipe", messages=[{"role": "user", "content": PUZZLE}], n=9)
    assert e.value.param == "n" and e.value.body["type"] == "invalid_request_error"
    # a value only the Triton model can judge: its message comes back as a 400
    with pytest.raises(openai.BadRequestError, match="over this server's limit"):
        client.completions.create(model="dgpipe", prompt=PUZZLE, max_tokens=100000)
    req = urllib.request.Request(
        served.openai + "/chat/completions",
        data=b'{"model": "dgpipe", "messages": [',
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(req, timeout=10)
    assert http.value.code == 400 and b'"invalid_request_error"' in http.value.read()
    test_text_completion_and_models(client)  # still serving


def test_dgpipe_generate_against_the_openai_port_uses_the_api_key(served):
    def run(*args: str, key: str | None) -> subprocess.CompletedProcess:
        env = {"DGPIPE_API_KEY": key} if key else {}
        return dgpipe(
            "generate", "--url", served.openai, *args, base_env=without_api_key(), env=env, cwd=ROOT
        )

    ok = run(PUZZLE, "--max-tokens", "82", "--json", key=KEY)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert sudoku.is_valid_solution(PUZZLE, out["text"]) and out["output_tokens"] > 0
    chat = run("--chat", PUZZLE, "--stream", "--max-tokens", "82", key=KEY)
    assert chat.returncode == 0 and sudoku.is_valid_solution(PUZZLE, chat.stdout.strip()), chat.stderr
    denied = run(PUZZLE, key=None)
    assert denied.returncode == 2 and "401" in denied.stderr and "DGPIPE_API_KEY" in denied.stderr


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_frontend_only_in_front_of_a_running_triton_and_an_unreachable_one(served, tmp_path):
    grpc = next(w for w in served.stdout.read_text().split() if w.startswith("grpc://"))
    proc, url = frontend_only(grpc, tmp_path)
    try:
        assert get_status(url.removesuffix("/v1") + "/health") == 200
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        resp = c.chat.completions.create(
            model="dgpipe", messages=[{"role": "user", "content": PUZZLE}], max_tokens=82
        )
        assert sudoku.is_valid_solution(PUZZLE, resp.choices[0].message.content)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    proc, url = frontend_only(f"grpc://127.0.0.1:{free_port()}", tmp_path)  # nothing listens there
    try:
        assert get_status(url.removesuffix("/v1") + "/health") == 503
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="dgpipe", prompt=PUZZLE)
        assert e.value.status_code == 503 and e.value.code == "service_unavailable"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_bench_serve_openai_drives_the_endpoint_as_load_tools_do(served, tmp_path):
    """`dgpipe bench serve --openai --url`: streamed chat requests with the fields AIPerf and guidellm send
    (ignore_eos, min_tokens, continuous usage), all answered at the asked length with usage on every chunk;
    `dgpipe bench requests` writes the same requests for the tools themselves."""
    args = ["bench", "serve", "--openai", "--url", served.openai, "--concurrency", "2", "--requests", "4"]
    args += ["--output-tokens", "164", "--out", str(tmp_path)]
    dgpipe(*args, env={"DGPIPE_API_KEY": KEY}, ok=True)
    result = json.loads((tmp_path / "serve_openai_load.json").read_text())
    assert result["model"] == "dgpipe" and result["output_tokens_asked"] == [164]
    assert {"ignore_eos", "min_tokens", "stream_options"} <= set(result["fields"])
    (row,) = result["rows"]
    assert row["concurrency"] == 2 and row["requests"] == 4 and row["errors"] == 0, row["error_examples"]
    assert row["output_tokens_mean"] == 164  # two canvases, run to the end: the end token ignored
    assert row["usage_on_every_chunk"] and row["usage_monotonic"]
    assert 0 < row["ttft_p50_ms"] < row["latency_p50_ms"] and row["itl_p50_ms"] > 0
    dgpipe("bench", "requests", str(tmp_path / "reqs.jsonl"), "--requests", "3", ok=True)
    rows = [json.loads(line) for line in (tmp_path / "reqs.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(sudoku.parse_puzzle(r["text"]) and r["output_length"] == 82 for r in rows)


def test_the_smoke_job_check_passes_against_the_openai_frontend_with_its_key(served):
    """The smoke Job runs `python3 -m pipeline.deploy.smoke --url http://dgpipe-triton:9000/v1` with the
    deployment's API key in $DGPIPE_API_KEY: the same here, against a frontend that requires the key; without
    the key the check fails (and says why) instead of raising."""
    import sys

    from pipeline.deploy.smoke import smoke_test_for
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.runtime.session import default_model_path

    smoke = smoke_test_for(open_checkpoint(default_model_path()))
    args = [a.replace("$$", "$") for a in smoke.args(served.openai)]  # as the kubelet hands them over
    assert args[args.index("--url") + 1].endswith("/v1")

    def run(key: str | None) -> tuple[int, dict]:
        env = {**without_api_key(), **({"DGPIPE_API_KEY": key} if key else {})}
        proc = subprocess.run([sys.executable, "-m", "pipeline.deploy.smoke", *args], capture_output=True,
                              text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
        return proc.returncode, json.loads(proc.stdout)

    rc, result = run(KEY)
    assert rc == 0 and result["ok"] and result["problem"] is None, result
    assert sudoku.is_valid_solution(smoke.prompt, result["answer"])
    rc, result = run(None)
    assert rc == 1 and not result["ok"] and "API key" in result["problem"], result


def test_serve_prints_the_openai_url_and_ctrl_c_stops_both(served):
    """Last in the file: it stops the module's server."""
    assert served.openai.startswith("http://127.0.0.1:") and served.openai.endswith("/v1")
    assert "(API key required)" in served.stdout.read_text()
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(served.openai.removesuffix("/v1") + "/health", timeout=5)
