# `docker build .` with nothing prepared: the egressgate gateway from a public Python image and PyPI.
# (The images compose.yaml runs, built offline from a Debian base by scripts/build-images.sh, are in
# Dockerfile.offline: a file of their own, because the classic builder builds every stage of a Dockerfile.)
# PYTHON_IMAGE and PIP_ARGS exist for mirrors and for the test, which builds this file offline
# (tests/render/test_compose_up_standalone.py: a local Debian Python and a wheel directory instead of PyPI).
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
