# etcd for coordinator leadership (docker-compose.ha.yml), built offline by scripts/build_images.sh: the host's etcd
# binary (Debian's etcd-server, dynamically linked against glibc, hence a Debian base of the same release) copied
# onto the debootstrap base image. Real users run the public image instead (DILOCO_ETCD_IMAGE, default
# gcr.io/etcd-development/etcd:v3.5.17); both have etcd at /usr/local/bin/etcd, so one compose command fits both.
#
#   docker build -f docker/etcd.Dockerfile --build-arg BASE_IMAGE=diloco-base:bookworm -t diloco-etcd:latest DIR
#   (DIR: a folder holding the `etcd` binary)

ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="diloco-etcd" \
      org.opencontainers.image.description="etcd for Decoupled DiLoCo coordinator leadership (offline build)"
COPY etcd /usr/local/bin/etcd
RUN mkdir -p /var/lib/etcd && /usr/local/bin/etcd --version
EXPOSE 2379 2380
CMD ["/usr/local/bin/etcd"]
