# syntax=docker/dockerfile:1
# The kvpilot sidecar image. Two stages: wheels are built in the first; the final image gets
# only the installed packages (no compiler, no build tools, no pip cache).
#
#   docker build -t kvpilot:0.1.0 .
#
# The final image also carries the kvpool plugin alone under /opt/kvpilot-plugin, which the
# deploy base copies into the vLLM container's PYTHONPATH.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
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
RUN pip wheel --no-cache-dir --wheel-dir /wheels . \
    && pip install --no-cache-dir --no-deps --target /plugin /wheels/kvpilot-*.whl

FROM ${PYTHON_IMAGE}
# The UID vLLM runs as in the same pod: equal UIDs let the sidecar signal vLLM without
# CAP_KILL (the deploy base runs both containers as 1000).
ARG KVPILOT_UID=1000
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/kvpilot-*.whl \
    && useradd --uid "${KVPILOT_UID}" --no-create-home --shell /usr/sbin/nologin kvpilot
COPY --from=build /plugin /opt/kvpilot-plugin
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVPILOT_LISTEN=0.0.0.0:9400
USER ${KVPILOT_UID}
EXPOSE 9400
ENTRYPOINT ["kvpilot"]
CMD ["run"]
