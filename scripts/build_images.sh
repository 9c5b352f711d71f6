#!/usr/bin/env bash
# Build the diloco image without reaching a container registry or letting the build reach the package index.
#
#   1. base image  diloco-base:bookworm  from debootstrap (minbase bookworm + python3, venv, iproute2, iptables),
#      from the Debian mirror configured in /etc/apt; its rootfs tarball is cached, the image is reused when present;
#   2. wheelhouse  of every runtime dependency (torch==2.13.0 CPU included) downloaded on the host with pip for the
#      container's Python (bookworm: CPython 3.11, x86_64), cached by a hash of the requirement list;
#   3. docker build --build-arg BASE_IMAGE=diloco-base:bookworm with ./wheelhouse/ in the context (pip --no-index);
#   4. etcd image  diloco-etcd:latest  for docker-compose.ha.yml and the HA chaos tests: the host's etcd binary
#      (Debian's etcd-server, installed by scripts/install_etcd.sh when missing) on the base image
#      (docker/etcd.Dockerfile). Compose runs it when DILOCO_ETCD_IMAGE names it (its default is the public image).
#
# Real users do not need this script: `docker build -f docker/Dockerfile .` uses python:3.11-slim and PyPI, and
# docker-compose.ha.yml pulls the public etcd image.
#
# Environment: DILOCO_IMAGE (diloco:latest), DILOCO_BASE_IMAGE (diloco-base:bookworm), DILOCO_ETCD_IMAGE
# (diloco-etcd:latest; also tagged with the binary's version), DILOCO_CACHE_DIR (/var/cache/diloco-docker), PYTHON
# (the host interpreter whose pip downloads wheels; .venv/bin/python), ETCD_BIN (the etcd binary to copy; `etcd`
# on PATH), DEBIAN_MIRROR (read from /etc/apt/sources.list.d/ when unset). Flags: --rebuild-base,
# --refresh-wheels, --etcd-only (step 4 alone; steps 1 and 4 when the base image is missing).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${DILOCO_IMAGE:-diloco:latest}
BASE_IMAGE=${DILOCO_BASE_IMAGE:-diloco-base:bookworm}
ETCD_IMAGE=${DILOCO_ETCD_IMAGE:-diloco-etcd:latest}
CACHE_DIR=${DILOCO_CACHE_DIR:-/var/cache/diloco-docker}
PYTHON=${PYTHON:-.venv/bin/python}
SUITE=bookworm
TORCH_SPEC=torch==2.13.0
BASE_PACKAGES=python3,python3-venv,iproute2,iptables
REBUILD_BASE=0
REFRESH_WHEELS=0
ETCD_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --rebuild-base) REBUILD_BASE=1 ;;
        --refresh-wheels) REFRESH_WHEELS=1 ;;
        --etcd-only) ETCD_ONLY=1 ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "build_images.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[build_images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
elapsed() { echo "$(($(date +%s) - $1)) s"; }

ROOTFS=""  # a debootstrap folder to remove if the script stops half-way
ETCD_CONTEXT=""  # the etcd image's build context, removed at exit
trap 'if [[ -n $ROOTFS ]]; then rm -rf "$ROOTFS"; fi; if [[ -n $ETCD_CONTEXT ]]; then rm -rf "$ETCD_CONTEXT"; fi
    rm -f "$CACHE_DIR"/*.tmp' EXIT

docker info >/dev/null 2>&1 || { echo "build_images.sh: no Docker engine; run scripts/start_docker.sh" >&2; exit 1; }
mkdir -p "$CACHE_DIR"
# the legacy builder where the buildx plugin is missing (Debian's docker.io); both read the same Dockerfiles
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

# --- 1. base image ---------------------------------------------------------------------------------------------
debian_mirror() {
    if [[ -n ${DEBIAN_MIRROR:-} ]]; then echo "$DEBIAN_MIRROR"; return; fi
    local f uri
    # deb822 .sources files: the first URIs line of a stanza whose Suites name the release itself
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        uri=$(awk -v suite="$SUITE" '
            /^URIs:/ { u = $2 }
            /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) found = 1 }
            /^[[:space:]]*$/ { if (found && u != "") { print u; exit } u = ""; found = 0 }
            END { if (found && u != "") print u }' "$f" | head -n1)
        if [[ -n $uri ]]; then echo "$uri"; return; fi
    done
    # one-line format
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        uri=$(awk -v suite="$SUITE" '$1 == "deb" && $3 == suite { print $2; exit }' "$f")
        if [[ -n $uri ]]; then echo "$uri"; return; fi
    done
    echo "http://deb.debian.org/debian"
}

build_base() {
    local t0 rootfs tarball mirror
    t0=$(date +%s)
    tarball="$CACHE_DIR/rootfs-$SUITE.tar"
    if [[ $REBUILD_BASE == 1 || ! -s $tarball ]]; then
        command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
        mirror=$(debian_mirror)
        rootfs=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
        ROOTFS=$rootfs
        log "debootstrap $SUITE (minbase + $BASE_PACKAGES) from $mirror"
        debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$mirror" \
            >"$CACHE_DIR/debootstrap.log" 2>&1 || { tail -n 30 "$CACHE_DIR/debootstrap.log" >&2; exit 1; }
        # keep it small: no package cache, lists, docs, man pages or translations
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
            "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
            "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
        find "$rootfs"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
        tar -C "$rootfs" --numeric-owner -cf "$tarball.tmp" .
        mv "$tarball.tmp" "$tarball"
        rm -rf "$rootfs"
        ROOTFS=""
    else
        log "rootfs tarball cached: $tarball"
    fi
    log "docker import -> $BASE_IMAGE"
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        "$tarball" "$BASE_IMAGE" >/dev/null
    log "base image ready in $(elapsed "$t0")"
}

if [[ $REBUILD_BASE == 0 ]] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE present (--rebuild-base to redo it)"
else
    build_base
fi

# --- 4. etcd image (defined here, run at the end, or alone with --etcd-only) ------------------------------------
build_etcd() {
    local t0 bin version
    t0=$(date +%s)
    bin=${ETCD_BIN:-$(command -v etcd || true)}
    if [[ -z $bin ]]; then
        bash scripts/install_etcd.sh
        bin=$(command -v etcd || echo /usr/bin/etcd)
    fi
    version=$("$bin" --version | awk '/^etcd Version:/ { print $3 }')
    [[ -n $version ]] || { echo "build_images.sh: $bin --version names no etcd version" >&2; exit 1; }
    ETCD_CONTEXT=$(mktemp -d)
    cp "$bin" "$ETCD_CONTEXT/etcd"
    log "docker build -> $ETCD_IMAGE and ${ETCD_IMAGE%%:*}:$version (etcd $version from $bin, BASE_IMAGE=$BASE_IMAGE)"
    docker build -f docker/etcd.Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$ETCD_IMAGE" \
        -t "${ETCD_IMAGE%%:*}:$version" "$ETCD_CONTEXT" >"$CACHE_DIR/build-etcd.log" 2>&1 ||
        { tail -n 20 "$CACHE_DIR/build-etcd.log" >&2; exit 1; }
    rm -rf "$ETCD_CONTEXT"
    ETCD_CONTEXT=""
    log "etcd image ready in $(elapsed "$t0"): $ETCD_IMAGE (compose: DILOCO_ETCD_IMAGE=$ETCD_IMAGE)"
}

if [[ $ETCD_ONLY == 1 ]]; then
    build_etcd
    exit 0
fi

# --- 2. wheelhouse ---------------------------------------------------------------------------------------------
# The container's interpreter must match the host's one that downloads (same tag: cp311, manylinux x86_64).
container_py=$(docker run --rm --entrypoint python3 "$BASE_IMAGE" -c \
    'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
host_py=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [[ $container_py != "$host_py" ]]; then
    echo "build_images.sh: $BASE_IMAGE has Python $container_py but $PYTHON is $host_py; set PYTHON to a" \
        "Python $container_py interpreter with pip" >&2
    exit 1
fi

requirements=$("$PYTHON" - "$TORCH_SPEC" <<'EOF'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
deps = [d for d in project["project"]["dependencies"] if not d.replace(" ", "").startswith("torch")]
build = project["build-system"]["requires"]
print("\n".join([sys.argv[1], *deps, *build]))
EOF
)
key=$(printf '%s\npy%s\n' "$requirements" "$container_py" | sha256sum | cut -c1-16)
wheels="$CACHE_DIR/wheelhouse-$key"
if [[ $REFRESH_WHEELS == 1 || ! -f $wheels/.complete ]]; then
    t0=$(date +%s)
    rm -rf "$wheels" "$wheels.tmp"
    mkdir -p "$wheels.tmp"
    log "pip download into $wheels ($(echo "$requirements" | tr '\n' ' '))"
    # shellcheck disable=SC2086 # one requirement a line, no spaces inside
    if ! "$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$wheels.tmp" $requirements \
        >"$CACHE_DIR/pip-download.log" 2>&1; then
        grep -v "is ignored: it is neither a file nor a directory" "$CACHE_DIR/pip-download.log" >&2
        exit 1
    fi
    torch_wheel=$(find "$wheels.tmp" -name 'torch-*.whl' | head -n1)
    if [[ $torch_wheel != *+cpu* ]] || compgen -G "$wheels.tmp/nvidia_*" >/dev/null; then
        echo "build_images.sh: pip picked a CUDA torch ($torch_wheel); put the CPU wheel on PIP_FIND_LINKS" >&2
        exit 1
    fi
    touch "$wheels.tmp/.complete"
    mv "$wheels.tmp" "$wheels"
    log "wheelhouse ready in $(elapsed "$t0"): $(du -sh "$wheels" | cut -f1)"
else
    log "wheelhouse cached: $wheels"
fi
# the build context's wheelhouse/ (git-ignored): hard links when the cache is on the same file system
rm -rf wheelhouse
cp -al "$wheels" wheelhouse 2>/dev/null || cp -r "$wheels" wheelhouse
rm -f wheelhouse/.complete

# --- 3. the image ----------------------------------------------------------------------------------------------
t0=$(date +%s)
: >"$CACHE_DIR/build.log"
log "docker build -> $IMAGE (BASE_IMAGE=$BASE_IMAGE, offline wheelhouse)"
# The build stage is tagged too, so that pruning the untagged leftovers of earlier builds keeps the layer cache
# (the dependency layer with torch is the slow one).
for target in build final; do
    if [[ $target == build ]]; then tag=("--target" "build" "-t" "${IMAGE%%:*}:build-cache"); else tag=("-t" "$IMAGE"); fi
    docker build -f docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" "${tag[@]}" . >>"$CACHE_DIR/build.log" 2>&1 ||
        { tail -n 40 "$CACHE_DIR/build.log" >&2; exit 1; }
done
docker image prune -f --filter label=org.opencontainers.image.title=decoupled-diloco >/dev/null
log "image ready in $(elapsed "$t0"): $IMAGE $(docker image inspect -f '{{.Size}}' "$IMAGE" |
    awk '{printf "%.0f MB", $1 / 1e6}')"

build_etcd
