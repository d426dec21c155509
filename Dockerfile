# One image for every service; the manifests pick the entrypoint:
#   fedrl-aggregator, fedrl-agent, fedrl-evaluator (and fedrl for `fedrl ctl`).
# CPU:  docker build -t fedrl:0.1.0 .
# GPU:  docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t fedrl:0.1.0-gpu .
# Offline torch, any base with python 3.11 on PATH as `python` (how tests/deploy/test_image.py
# builds it with buildah where neither Docker Hub nor torch's index can be reached):
#   buildah build --build-arg PYTHON_IMAGE=localhost/fedrl-python:3.11-bookworm \
#     --build-arg TORCH_WHEELS=/wheels --volume /opt/wheels:/wheels:ro -t fedrl:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# A folder holding the torch wheel, mounted into the build; when set, torch comes from it (its
# dependencies from PyPI) and TORCH_INDEX is not asked.
ARG TORCH_WHEELS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/fedrl
ENV PATH=/opt/fedrl/bin:$PATH
# torch first, from the index that matches the device (CPU wheels are ~10x smaller).
RUN if [ -n "${TORCH_WHEELS}" ]; then \
      pip install --no-index --no-deps --find-links "${TORCH_WHEELS}" "torch==${TORCH_VERSION}" \
      && pip install "torch==${TORCH_VERSION}"; \
    else pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fedrl ./fedrl
COPY aggregator_service ./aggregator_service
COPY agent_service ./agent_service
COPY evaluator_service ./evaluator_service
RUN pip install . && python -c "import fedrl.proto.v1.federation_pb2, mujoco, torch"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/fedrl /opt/fedrl
# Non-root, read-only root filesystem friendly: every write goes to /tmp, /state or /data.
ENV PATH=/opt/fedrl/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp MPLCONFIGDIR=/tmp/matplotlib FEDRL_CACHE_DIR=/data/cache
RUN groupadd --gid 10001 fedrl && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin fedrl \
    && mkdir -p /state /data && chown 10001:10001 /state /data
USER 10001:10001
# The ports deploy/ names (gRPC: aggregator 50051, evaluator 50052; metrics 9400; health 9401).
EXPOSE 50051 50052 9400 9401
CMD ["fedrl", "--help"]
