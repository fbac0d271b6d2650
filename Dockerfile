# agentd container image. Build: docker build -t agentd .
# Run: see docs/operations.md ("Docker"): mount the configuration at /etc/agentd
# (read-only) and a volume at /var/lib/agentd (the state directory).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---- build: a virtualenv with agentd and its dependencies -------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README* ./
COPY agentd ./agentd
COPY agentctl ./agentctl
RUN python -m venv /opt/agentd \
    && /opt/agentd/bin/pip install --no-cache-dir . \
    && /opt/agentd/bin/agentd --help > /dev/null \
    && /opt/agentd/bin/agentd demo > /dev/null

# ---- runtime: the virtualenv only, as an unprivileged user ------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="agentd" \
      org.opencontainers.image.description="A zero-trust runtime for multi-agent LLM systems" \
      org.opencontainers.image.licenses="Apache-2.0"
# tini is PID 1: a handler worker's processes killed with it are re-parented to PID 1,
# and agentd (which reaps only the children it started) must not be the one to inherit
# them, or they would stay zombies and count against the container's process limit.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.0-1 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 agentd \
    && useradd --system --uid 10001 --gid agentd --home-dir /var/lib/agentd \
       --no-create-home --shell /usr/sbin/nologin agentd \
    && mkdir -p /var/lib/agentd /etc/agentd \
    && chown agentd:agentd /var/lib/agentd \
    && chmod 0700 /var/lib/agentd
COPY --from=build /opt/agentd /opt/agentd
ENV PATH=/opt/agentd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /var/lib/agentd
VOLUME ["/var/lib/agentd"]
# 8765: the main bus (wss). 9464: metrics and health (set metrics.listen to
# 0.0.0.0:9464 in the container's organism.yaml to scrape it from outside).
EXPOSE 8765 9464
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2).status == 200 else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "agentd"]
CMD ["run", "--config", "/etc/agentd/organism.yaml", "--state-dir", "/var/lib/agentd"]
