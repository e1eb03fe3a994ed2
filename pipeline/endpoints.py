"""The served model's name and the default ports of a dgpipe server, written once: `dgpipe package` and
`serve`, the clients and probes, the serving image's container command and the Kubernetes objects
(k8s/base, held to these by a test) all use them. Stdlib only: the light CLI paths import it."""

from __future__ import annotations

MODEL_NAME = "dgpipe"  # the served model in the Triton repository (`dgpipe package --name` default)

HTTP_PORT = 8000  # Triton's HTTP/REST (KServe v2) endpoint
GRPC_PORT = 8001  # Triton's gRPC endpoint (the OpenAI frontend's stream to the model)
METRICS_PORT = 8002  # Triton's Prometheus metrics
OPENAI_PORT = 9000  # the OpenAI-compatible API of `dgpipe serve`

LOCAL_HTTP_URL = f"http://127.0.0.1:{HTTP_PORT}"
LOCAL_METRICS_URL = f"http://127.0.0.1:{METRICS_PORT}/metrics"
