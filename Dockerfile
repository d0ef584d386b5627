# syntax=docker/dockerfile:1
# The kvpilot sidecar image. Two stages: wheels are built in the first; the final image gets
# only the installed packages (no compiler, no build tools, no pip cache).
#
#   scripts/build-image            # tags ghcr.io/kvpilot/kvpilot:<version>, labels included
#
# which runs `docker build` (or podman) with --build-arg KVPILOT_VERSION set from
# pyproject.toml, the one place the version is written (the build stops when they differ),
# and KVPILOT_REVISION from git.
#
# The image holds kvpilot with the extras a sidecar uses: the Kubernetes client (the pod
# runtime), the tuner's scientific stack, and the dashboards. It also carries the kvpool
# plugin alone under /opt/kvpilot-plugin, which the deploy base copies into the vLLM
# container's PYTHONPATH.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG KVPILOT_VERSION
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvpilot_ns/ kvpilot_ns/
COPY collectors/ collectors/
COPY rig/ rig/
COPY tuner/ tuner/
COPY dashboards/ dashboards/
COPY agent/ agent/
# kvpilot and its dependencies as wheels; the plugin alone, without dependencies (vLLM's
# environment already has prometheus-client), for vLLM's PYTHONPATH.
RUN python3 -c 'import sys, tomllib; v = tomllib.load(open("pyproject.toml", "rb"))["project"]["version"]; sys.exit(0 if v == sys.argv[1] else f"KVPILOT_VERSION {sys.argv[1]!r} is not pyproject.toml version {v!r}: build with scripts/build-image")' "${KVPILOT_VERSION}" \
    && pip wheel --no-cache-dir --wheel-dir /wheels ".[kubernetes,tuner,dashboards]" \
    && pip install --no-cache-dir --no-deps --target /plugin /wheels/kvpilot-*.whl

FROM ${PYTHON_IMAGE}
ARG PYTHON_IMAGE
ARG KVPILOT_VERSION
ARG KVPILOT_REVISION=unknown
# RFC 3339, when the image was built (scripts/build-image sets it).
ARG KVPILOT_CREATED=unknown
ARG KVPILOT_SOURCE=https://github.com/kvpilot/kvpilot
# The UID vLLM runs as in the same pod: equal UIDs let the sidecar signal vLLM without
# CAP_KILL (the deploy base runs both containers as 1000).
ARG KVPILOT_UID=1000
LABEL org.opencontainers.image.title="kvpilot" \
      org.opencontainers.image.description="Memory observability and auto-tuning sidecar for vLLM" \
      org.opencontainers.image.source="${KVPILOT_SOURCE}" \
      org.opencontainers.image.url="${KVPILOT_SOURCE}" \
      org.opencontainers.image.documentation="${KVPILOT_SOURCE}/blob/v${KVPILOT_VERSION}/docs/deploy.md" \
      org.opencontainers.image.version="${KVPILOT_VERSION}" \
      org.opencontainers.image.revision="${KVPILOT_REVISION}" \
      org.opencontainers.image.created="${KVPILOT_CREATED}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels \
        "$(ls /wheels/kvpilot-*.whl)[kubernetes,tuner,dashboards]" \
    && useradd --uid "${KVPILOT_UID}" --no-create-home --shell /usr/sbin/nologin kvpilot
COPY --from=build /plugin /opt/kvpilot-plugin
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER ${KVPILOT_UID}
EXPOSE 8474
ENTRYPOINT ["kvpilot"]
# Without a configuration: watch the vLLM beside it on 127.0.0.1:8000 and serve /metrics on
# every interface of the pod. With KVPILOT_CONFIG (as the deploy base sets), the file decides.
CMD ["run", "--listen=0.0.0.0:8474"]
