#!/usr/bin/env bash
# Install the Debian packages that tests and benchmarks run against. Idempotent: does nothing for
# a group whose tools are all on PATH.
#
#   bash scripts/install_ops_deps.sh              # prometheus, dns and browser (the tests' default)
#   bash scripts/install_ops_deps.sh bench        # wrk and nginx (make bench's wrk phase)
#   bash scripts/install_ops_deps.sh prometheus bench
#   bash scripts/install_ops_deps.sh docker       # docker.io, docker-compose, debootstrap (make docker-test)
#   bash scripts/install_ops_deps.sh dns          # dnsmasq (tests/deploy/test_dns_discovery.py)
#   bash scripts/install_ops_deps.sh browser      # chromium, chromedriver (tests/gateway/ui)
#
# Groups: `prometheus` installs Debian's `prometheus` package (prometheus + promtool); `bench`
# installs `wrk` (a C load generator) and `nginx` (an upstream answering from memory; the bench
# runs its own unprivileged nginx on a free port with a generated config). `docker` installs
# Debian's docker.io (the engine; the tests start their own dockerd, its own socket and data
# root), docker-compose (Compose v1: Debian has no compose plugin) and debootstrap (the base
# image, docker/base/build_base.sh); `dns` installs dnsmasq-base (a DNS server, no service);
# `browser` installs Debian's chromium and chromium-driver (headless Chromium driven by
# Selenium in the pool page's tests).
#
# Needs root (or sudo) and apt. Exits non-zero, saying why, when it cannot install; the test or
# bench phase then skips with that reason. Debian's packages also register services; this script
# starts none of them (policy-rc.d 101 while installing).
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

groups=("$@")
[ "${#groups[@]}" -eq 0 ] && groups=(prometheus dns browser)

packages=()
tools=()
for group in "${groups[@]}"; do
    case "$group" in
        prometheus) packages+=(prometheus); tools+=(prometheus promtool) ;;
        bench) packages+=(wrk nginx); tools+=(wrk nginx) ;;
        docker) packages+=(docker.io docker-compose debootstrap); tools+=(dockerd docker-compose debootstrap) ;;
        dns) packages+=(dnsmasq-base); tools+=(dnsmasq) ;;
        browser) packages+=(chromium chromium-driver); tools+=(chromium chromedriver) ;;
        *) echo "install_ops_deps: unknown group '$group' (known: prometheus, bench, docker, dns, browser)" >&2; exit 2 ;;
    esac
done

PATH="$PATH:/usr/sbin:/sbin"  # nginx lives in /usr/sbin
missing=()
for tool in "${tools[@]}"; do
    have "$tool" || missing+=("$tool")
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_ops_deps: present: ${tools[*]}"
    exit 0
fi

if ! have apt-get; then
    echo "install_ops_deps: apt-get not found; install ${packages[*]} by hand" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install_ops_deps: need root (or passwordless sudo) to apt-get install ${packages[*]}" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
echo "install_ops_deps: apt-get update"
if ! $SUDO apt-get update -q >/tmp/install_ops_deps.log 2>&1; then
    echo "install_ops_deps: apt-get update failed (see /tmp/install_ops_deps.log):" >&2
    tail -n 20 /tmp/install_ops_deps.log >&2
    exit 1
fi
echo "install_ops_deps: apt-get install ${packages[*]}"
# policy-rc.d 101: do not start the packaged services (no init here, or not wanted in CI).
POLICY=/usr/sbin/policy-rc.d
CREATED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    CREATED_POLICY=1
fi
status=0
$SUDO apt-get install -y -q --no-install-recommends "${packages[@]}" \
    >>/tmp/install_ops_deps.log 2>&1 || status=$?
if [ "$CREATED_POLICY" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
fi
if [ "$status" -ne 0 ]; then
    echo "install_ops_deps: apt-get install ${packages[*]} failed (see /tmp/install_ops_deps.log):" >&2
    tail -n 20 /tmp/install_ops_deps.log >&2
    exit 1
fi

for tool in "${tools[@]}"; do
    if ! have "$tool"; then
        echo "install_ops_deps: the packages installed no \`$tool\` on PATH" >&2
        exit 1
    fi
done
echo "install_ops_deps: installed ${packages[*]}"
