#!/usr/bin/env bash
# Build the Debian bookworm Python base image without a registry: debootstrap a minimal tree with
# python3, pip, venv and CA certificates, then `docker import` it under the tag the Dockerfiles
# name (python:3.11-slim by default; its Python is 3.11 too). For a site that cannot pull images
# (air-gapped, or a private daemon in the tests); everywhere else the official image is pulled.
#
#   docker/base/build_base.sh [TAG]       # default TAG: python:3.11-slim
#
# Environment:
#   DOCKER       the docker command (default `docker`; the tests pass `docker -H unix://...`)
#   BASE_CACHE   folder that keeps the root-filesystem tarball between runs (default
#                .cache/docker in the repository, git-ignored); delete it to rebuild
#   DEBIAN_MIRROR  (default http://deb.debian.org/debian)
#
# Needs root (debootstrap) the first time; later runs only `docker import` the cached tarball.
set -euo pipefail

TAG="${1:-python:3.11-slim}"
DOCKER="${DOCKER:-docker}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="${BASE_CACHE:-$ROOT/.cache/docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TARBALL="$CACHE/bookworm-python-rootfs.tar"
PATH="$PATH:/usr/sbin:/sbin"

if [ ! -s "$TARBALL" ]; then
    command -v debootstrap >/dev/null || { echo "build_base: debootstrap is not installed" >&2; exit 1; }
    mkdir -p "$CACHE"
    tree="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$tree"' EXIT
    echo "build_base: debootstrap bookworm into $tree (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
        bookworm "$tree" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
    # pip may install into the image's own Python: the image is the environment (PEP 668's
    # marker is for hosts whose Python the distribution manages).
    rm -f "$tree"/usr/lib/python3*/EXTERNALLY-MANAGED
    ln -sf python3 "$tree/usr/bin/python"
    rm -rf "$tree"/var/lib/apt/lists/* "$tree"/var/cache/apt/*.bin "$tree"/var/cache/apt/archives/*.deb \
        "$tree"/usr/share/doc/* "$tree"/usr/share/man/* "$tree"/usr/share/locale/*
    tar -C "$tree" --numeric-owner -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
fi

$DOCKER import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$TARBALL" "$TAG" >/dev/null
echo "build_base: $TAG from $TARBALL"
