# The dgpipe serving image: NGC Triton (CUDA, TensorRT, Python backend) plus dgpipe. The same image
# builds the TensorRT engines on the GPU node (the Deployment's initContainer) and serves them, so a
# plan always matches the TensorRT and GPU it runs on. Keep the tag in step with pipeline/serving/server.py's
# NGC_IMAGE (a test checks it).
#   docker build -t REGISTRY/dgpipe-triton:TAG . && docker push REGISTRY/dgpipe-triton:TAG
FROM nvcr.io/nvidia/tritonserver:25.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# TensorRT's Python bindings at exactly the version of the image's libnvinfer (the bindings wheel uses
# the image's libraries), for `dgpipe engine build`. Fails the build if the version cannot be found.
RUN set -eux; \
    trt="$(ls /usr/lib/*-linux-gnu/libnvinfer.so.* | sed -n 's/.*libnvinfer\.so\.\([0-9]*\.[0-9]*\.[0-9]*\)$/\1/p' | sort -V | tail -n1)"; \
    test -n "$trt"; \
    python3 -m pip install "tensorrt-cu${CUDA_VERSION%%.*}-bindings==${trt}.*"

WORKDIR /opt/dgpipe
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY quantize ./quantize
COPY model_repo ./model_repo
COPY configs ./configs
COPY k8s ./k8s
# dgpipe with the engine-build extra, the Triton client and the OpenAI frontend's FastAPI + uvicorn (the
# pod's `openai` container, the smoke Job's `dgpipe generate --url`); not the [serve] extra: its pytriton
# wheel carries a second tritonserver this image already has.
# configs/ and k8s/ go where pipeline.resources looks for them outside a checkout (<prefix>/share/dgpipe).
RUN set -eux; \
    python3 -m pip install ".[engine]" "tritonclient[all]>=2.50" "fastapi>=0.115" "uvicorn>=0.30" "anyio>=4.1"; \
    prefix="$(python3 -c 'import sys; print(sys.prefix)')"; \
    mkdir -p "$prefix/share/dgpipe"; \
    cp -r configs k8s "$prefix/share/dgpipe/"; \
    dgpipe --version

# Non-root (uid 1000, the uid the pods run as); the NGC image may already define that uid.
RUN id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --user-group --create-home --shell /usr/sbin/nologin dgpipe
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001 8002

ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
CMD ["tritonserver", "--model-repository=/models/build/model_repository"]
