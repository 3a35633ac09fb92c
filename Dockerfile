# p2ptrain node image: `p2ptrain` is the entry point (node, ps, launch, bench, ...).
#
# CPU (default): the torch CPU wheel, pinned by constraints.txt:
#   docker build -t p2ptrain .
# CUDA: a CUDA runtime base and the matching PyTorch wheel index, e.g.
#   docker build -t p2ptrain:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   docker run --gpus all p2ptrain:cuda node ...   (nodes use CUDA when present: --device auto)
# With docker compose: docker compose build --build-arg BASE_IMAGE=... --build-arg TORCH_INDEX=...
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where the torch wheel comes from: https://download.pytorch.org/whl/<cpu|cu126|cu128|...>.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# python:*-slim has Python with venv; CUDA bases (Ubuntu) need it installed first.
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 1000 p2ptrain \
    && mkdir -p /runs && chown p2ptrain /runs

WORKDIR /app
# torch first, from TORCH_INDEX only (no fallback index: a CPU build never pulls CUDA packages);
# constraints.txt pins its version (2.13.0 matches 2.13.0+cpu and 2.13.0+cu128 alike).
COPY constraints.txt ./
RUN pip install --index-url "${TORCH_INDEX}" -c constraints.txt torch

# Then the package and its other dependencies (gRPC, protobuf, prometheus-client, ...), pinned alike.
COPY pyproject.toml README.md ./
COPY p2ptrain ./p2ptrain
COPY launcher ./launcher
RUN pip install -c constraints.txt . && p2ptrain --help > /dev/null

USER p2ptrain
# A named volume mounted here starts out owned by the p2ptrain user.
VOLUME ["/runs"]
# gRPC peer port and /metrics port used by docker-compose.yml.
EXPOSE 50051 9100
ENTRYPOINT ["p2ptrain"]
CMD ["--help"]
