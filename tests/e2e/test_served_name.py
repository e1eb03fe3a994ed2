"""`dgpipe package --name tiny-chat` then `dgpipe serve`, as a user runs them: the served name comes from the
repository everywhere (the models list, routing, the watchdog's health pings), and so does the prompt cap
of the OpenAI frontend. Queried with the official `openai` client."""

from __future__ import annotations

import time
import urllib.request

import pytest

from pipeline.demo import sudoku
from tests._utils.availability import needs_tritonserver
from tests._utils.cli import dgpipe
from tests._utils.serve import README_PUZZLE, frontend_only, start_serve

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytestmark = needs_tritonserver

NAME = "tiny-chat"
PROMPT_BYTES = 4000  # the repository's cap, far under the default (1 MiB)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("served-name")
    repo = work / "repo"
    dgpipe("package", "--output", str(repo), "--name", NAME, "--max-prompt-bytes", str(PROMPT_BYTES), ok=True)
    assert sorted(p.name for p in repo.iterdir()) == [NAME]
    srv = start_serve(repo, work)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.openai, api_key="unused", max_retries=0, timeout=120)


def test_the_repository_name_is_served_and_the_server_stays_up(served, client):
    assert [m.id for m in client.models.list()] == [NAME]
    resp = client.completions.create(model=NAME, prompt=README_PUZZLE, max_tokens=82, seed=0)
    assert resp.model == NAME
    assert sudoku.is_valid_solution(README_PUZZLE, resp.choices[0].text), resp.choices[0].text
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": README_PUZZLE}], max_tokens=82, seed=0
    )
    assert sudoku.is_valid_solution(README_PUZZLE, chat.choices[0].message.content)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="dgpipe", prompt=README_PUZZLE, max_tokens=82)
    assert e.value.body["code"] == "model_not_found" and NAME in e.value.body["message"]
    # the watchdog pings the served model every 2 s and stops the server after 3 failed pings
    time.sleep(15)
    assert served.proc.poll() is None, served.stderr.read_text()
    with urllib.request.urlopen(served.health, timeout=10) as r:
        assert r.status == 200
    again = client.completions.create(model=NAME, prompt=README_PUZZLE, max_tokens=82, seed=0)
    assert again.choices[0].text == resp.choices[0].text


def test_the_sidecar_frontend_serves_the_name_it_is_given_with_the_limits_triton_reports(served, tmp_path):
    """`dgpipe serve --triton-url --name NAME` (the pod's OpenAI sidecar) has no repository: it reads the
    model's config from Triton (the prompt cap the repository was packaged with) once Triton has it."""
    grpc = next(w for w in served.stdout.read_text().split() if w.startswith("grpc://"))
    proc, url = frontend_only(grpc, tmp_path, "--name", NAME)
    try:
        sidecar = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        for _ in range(60):  # it asks Triton right after it starts
            try:
                names = [m.id for m in sidecar.models.list()]
                break
            except openai.APIStatusError as e:
                assert e.status_code == 503, e
                time.sleep(0.25)
        assert names == [NAME]
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:
            assert r.status == 200
        resp = sidecar.completions.create(model=NAME, prompt=README_PUZZLE, max_tokens=82, seed=0)
        assert sudoku.is_valid_solution(README_PUZZLE, resp.choices[0].text)
        with pytest.raises(openai.BadRequestError) as e:
            sidecar.completions.create(model=NAME, prompt=README_PUZZLE + " " * PROMPT_BYTES, max_tokens=82)
        assert f"limit of {PROMPT_BYTES} bytes" in e.value.body["message"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_the_frontend_takes_the_repository_prompt_cap(client):
    prompt = README_PUZZLE + " " * PROMPT_BYTES  # over the repository's cap, far under the default one
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=82)
    body = e.value.body
    assert body["param"] == "prompt", body  # refused by the frontend, before Triton
    assert f"'prompt' holds {len(prompt)} bytes" in body["message"]
    assert f"limit of {PROMPT_BYTES} bytes" in body["message"]


def test_max_tokens_past_the_models_context_is_a_400_naming_the_numbers(client):
    """The embedded model holds 512 positions: the puzzle's prompt, 400 tokens and two 82-token canvases
    do not fit, so the request is refused instead of answered with the one canvas that fits."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=README_PUZZLE, max_tokens=400)
    body = e.value.body
    assert body["type"] == "invalid_request_error", body
    assert "max_tokens is 400" in body["message"] and "context of 512 tokens" in body["message"], body
    assert "two 82-token canvases" in body["message"]
    # without max_tokens the checkpoint's default (82, generation_config.json) is served, never refused
    resp = client.completions.create(model=NAME, prompt=README_PUZZLE, seed=0)
    assert sudoku.is_valid_solution(README_PUZZLE, resp.choices[0].text), resp.choices[0].text


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "-x", "tiny chat"])
def test_a_name_that_is_not_a_repository_directory_is_refused(tmp_path, name):
    proc = dgpipe("package", "--output", str(tmp_path / "repo"), "--name", name)
    assert proc.returncode == 2 and "is not a valid model name" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "repo").exists()


@pytest.mark.parametrize("via", ["http", "grpc", "openai"])
def test_generate_asks_the_served_name(served, via, monkeypatch):
    """`dgpipe generate --url` against a server of another name: --name (or $DGPIPE_MODEL_NAME, as the pods
    set it) asks for it on Triton's HTTP and gRPC endpoints and on the OpenAI API; without it, the
    refusal names the model it asked for and how to ask for another."""
    from pipeline.endpoints import MODEL_NAME_ENV

    url = getattr(served, via)
    proc = dgpipe("generate", "--url", url, "--max-tokens", "82", "--name", NAME, README_PUZZLE)
    assert proc.returncode == 0, proc.stderr
    assert sudoku.is_valid_solution(README_PUZZLE, proc.stdout.strip()), proc.stdout
    monkeypatch.setenv(MODEL_NAME_ENV, NAME)
    assert dgpipe("generate", "--url", url, "--max-tokens", "82", README_PUZZLE).returncode == 0
    monkeypatch.delenv(MODEL_NAME_ENV)
    proc = dgpipe("generate", "--url", url, "--max-tokens", "82", README_PUZZLE)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "'dgpipe'" in proc.stderr and "--name" in proc.stderr, proc.stderr
