"""The served model's name and the default ports of a dgpipe server, written once: `dgpipe package` and
`serve`, the clients and probes, the serving image's container command and the Kubernetes objects
(k8s/base, held to these by a test) all use them. Stdlib only: the light CLI paths import it."""

from __future__ import annotations

import re

from pipeline.errors import DgpipeError

MODEL_NAME = "dgpipe"  # the served model in the Triton repository (`dgpipe package --name` default)
MODEL_NAME_ENV = "DGPIPE_MODEL_NAME"  # the pods read the served name from this variable (k8s/base)
# The name is the model's directory in the Triton repository, a path segment in Triton's URLs
# (/v2/models/NAME) and a Kubernetes ConfigMap value: letters, digits and . _ - , starting with a letter
# or digit (no "/", "..", spaces or shell characters).
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

HTTP_PORT = 8000  # Triton's HTTP/REST (KServe v2) endpoint
GRPC_PORT = 8001  # Triton's gRPC endpoint (the OpenAI frontend's stream to the model)
METRICS_PORT = 8002  # Triton's Prometheus metrics
OPENAI_PORT = 9000  # the OpenAI-compatible API of `dgpipe serve`

LOCAL_HTTP_URL = f"http://127.0.0.1:{HTTP_PORT}"
LOCAL_METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"


def check_model_name(name: str, where: str = "--name") -> str:
    """A served model name dgpipe can write as a repository directory and put in URLs (`_MODEL_NAME`);
    anything else is refused naming the input (`where`). Returns the name."""
    if not _MODEL_NAME.match(name):
        raise DgpipeError(
            f"{where} {name!r} is not a valid model name",
            "use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit "
            "(it becomes the model's directory in the Triton repository)",
        )
    return name
