#!/usr/bin/env bash
# Build Redis and Prometheus images without a registry: this host's own `redis-server` and
# `prometheus` binaries (with the libraries they load) on the base image build_base.sh makes.
# For a site that cannot pull redis:7.4-alpine and prom/prometheus (air-gapped); pass the tags to
# Compose as REDIS_IMAGE and PROMETHEUS_IMAGE. tests/deploy runs this very script.
#
#   docker/base/build_ops.sh [REDIS_TAG] [PROMETHEUS_TAG]
#       defaults: gpupool/redis:local gpupool/prometheus:local
#
# Environment:
#   DOCKER      the docker command (default `docker`; the tests pass `docker -H unix://...`)
#   BASE_IMAGE  the image to build on (default python:3.11-slim, build_base.sh's tag)
#
# Needs `redis-server` and `prometheus` installed on this host (Debian: apt install
# redis-server prometheus). Like the official Prometheus image, the second runs /bin/prometheus
# as user nobody, its data in /prometheus.
set -euo pipefail

REDIS_TAG="${1:-gpupool/redis:local}"
PROMETHEUS_TAG="${2:-gpupool/prometheus:local}"
DOCKER="${DOCKER:-docker}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"

ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/bin" "$ctx/lib"
for tool in redis-server prometheus; do
    path="$(command -v "$tool")" || { echo "build_ops: $tool is not installed" >&2; exit 1; }
    cp "$path" "$ctx/bin/$tool"
    # the libraries it loads, but the C library's own (the base has those)
    ldd "$path" | awk '/=> \// {print $3}' | while read -r lib; do
        case "$(basename "$lib")" in libc.so*|libm.so*|ld-*) ;; *) cp "$lib" "$ctx/lib/" ;; esac
    done
done
cat >"$ctx/Dockerfile" <<DOCKERFILE
FROM $BASE_IMAGE
COPY bin/ /usr/local/bin/
COPY lib/ /usr/local/lib/gpupool-ops/
ENV LD_LIBRARY_PATH=/usr/local/lib/gpupool-ops
RUN ln -s /usr/local/bin/prometheus /bin/prometheus \\
    && mkdir /prometheus && chown nobody /prometheus
DOCKERFILE
$DOCKER build --network host -q -t "$REDIS_TAG" "$ctx" >/dev/null
printf 'FROM %s\nUSER nobody\nENTRYPOINT ["/bin/prometheus"]\n' "$REDIS_TAG" >"$ctx/Dockerfile"
$DOCKER build --network host -q -t "$PROMETHEUS_TAG" "$ctx" >/dev/null
echo "build_ops: $REDIS_TAG and $PROMETHEUS_TAG on $BASE_IMAGE"
