#!/usr/bin/env bash
# The device stack on aarch64, a check anyone can run (issue 17): as root, on an x86 Debian
# (or derivative) machine,
#
#   sudo tools/arm64_check.sh [--cache DIR] [--tolerance REL] [--keep-work]
#
# 1. installs what it needs with apt-get (qemu-user-static, binfmt-support, mmdebstrap,
#    mosquitto) and registers qemu's aarch64 interpreter with the kernel (binfmt_misc);
# 2. builds a Debian bookworm arm64 userland (minbase + python3, python3-venv) with
#    mmdebstrap, cached in DIR/rootfs (default out/arm64/ in this tree; rebuilt when the
#    recipe below changes; the first build downloads its packages from the Debian mirror);
# 3. installs this tree there without extras, in a fresh venv (/opt/fedge), from PyPI's
#    aarch64 wheels (pip's cache kept in the userland): the device stack alone;
# 4. runs `python -m tools.arm64_check host` (x86, this tree's .venv): a DP-SGD round on
#    both engines under aarch64 compared with x86, then one aarch64 `fedge device` in a
#    round with two x86 devices and an x86 aggregator over a local mosquitto.
#
# stdout: one JSON summary (stack size, versions, round results, differences, timings);
# progress on stderr. Exit 0: every check passed; 1: a check failed (the summary says
# which); 2: usage or set-up error; 3: this kernel cannot run aarch64 binaries (binfmt_misc
# unavailable or refused; nothing to check here).
#
# qemu-user note: onnxruntime's cpuinfo library reads /proc/cpuinfo, which qemu-user passes
# through from the x86 host; with /proc and /sys both mounted the import then segfaults.
# The check mounts both (as a device has them) and binds an arm64 /proc/cpuinfo (Cortex-A72,
# a Raspberry Pi 4's, one entry per host CPU) over the host's: an emulation artefact, not
# something a real aarch64 device needs.
set -euo pipefail

if [[ -z "${FEDGE_ARM64_NICED:-}" ]]; then  # everything below at low priority
    FEDGE_ARM64_NICED=1 exec nice -n 15 "$0" "$@"
fi
{  # read whole before it runs: editing this file meanwhile cannot change a running check

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="$REPO/out/arm64"
TOLERANCE=""
KEEP_WORK=0
HOST_PY="${FEDGE_HOST_PYTHON:-$REPO/.venv/bin/python}"
SUITE=bookworm
MIRROR="${FEDGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
INCLUDE=python3,python3-venv,ca-certificates
RECIPE="mmdebstrap --arch=arm64 --variant=minbase --include=$INCLUDE $SUITE"
VENV=/opt/fedge

log() { echo "arm64_check: $*" >&2; }
die() { local code=$1; shift; echo "arm64_check: error: $*" >&2; exit "$code"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --cache) CACHE="$2"; shift 2 ;;
        --tolerance) TOLERANCE="$2"; shift 2 ;;
        --keep-work) KEEP_WORK=1; shift ;;
        -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die 2 "unknown argument '$1' (see --help)" ;;
    esac
done

[[ "$(id -u)" == 0 ]] || die 2 "must run as root (apt-get, binfmt_misc, mounts, chroot);" \
    "try: sudo $0"
[[ "$(uname -m)" == x86_64 ]] || die 2 "the host must be x86_64 (it is $(uname -m)): the" \
    "check compares aarch64 with x86"
[[ -x "$HOST_PY" ]] || die 2 "no development python at $HOST_PY (set FEDGE_HOST_PYTHON, or" \
    "run tools/setup.sh once)"
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"
ROOT="$CACHE/rootfs"
exec 9>"$CACHE/lock"
flock 9  # one check at a time per cache (the mounts and the venv are shared)
T_START=$(date +%s.%N)
elapsed() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# ------------------------------------------------------------------- 1. packages
need=()
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v update-binfmts >/dev/null || need+=(binfmt-support)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mosquitto >/dev/null || need+=(mosquitto)
if [[ ${#need[@]} -gt 0 ]]; then
    log "apt-get install ${need[*]}"
    apt-get update -q >&2 || die 2 "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >&2 \
        || die 2 "apt-get install ${need[*]} failed"
fi

# ------------------------------------------------------------------- 2. binfmt_misc
BINFMT=/proc/sys/fs/binfmt_misc
if [[ ! -e "$BINFMT/register" ]]; then
    mount -t binfmt_misc binfmt_misc "$BINFMT" 2>/dev/null \
        || die 3 "this kernel cannot run aarch64 binaries: mounting binfmt_misc on $BINFMT" \
           "was refused (a container without CAP_SYS_ADMIN, or a kernel without" \
           "CONFIG_BINFMT_MISC)"
fi
if [[ -e "$BINFMT/qemu-aarch64" ]]; then
    # registered but disabled: update-binfmts --enable leaves such an entry as it is
    grep -qx enabled "$BINFMT/qemu-aarch64" || echo 1 >"$BINFMT/qemu-aarch64" || true
else
    update-binfmts --enable qemu-aarch64 >&2 || true
fi
grep -qx enabled "$BINFMT/qemu-aarch64" 2>/dev/null \
    || die 3 "this kernel cannot run aarch64 binaries: registering qemu-aarch64 in $BINFMT" \
       "was refused (update-binfmts --enable qemu-aarch64; status: $(cat "$BINFMT/status" \
       2>/dev/null || echo unreadable))"
# without the F flag the kernel looks the interpreter up inside the chroot
FIX_BINARY=0
grep -q '^flags:.*F' "$BINFMT/qemu-aarch64" && FIX_BINARY=1

# ------------------------------------------------------------------- 3. the userland
mounted_under() { findmnt -rn -o TARGET | awk -v r="$1" 'index($0, r "/") == 1'; }
# a run killed outright (SIGKILL: no cleanup) leaves its mounts; the lock says none is ours
stale=$(mounted_under "$ROOT" | sort -r)
if [[ -n "$stale" ]]; then
    log "unmounting what an interrupted run left under $ROOT"
    while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done <<<"$stale"
fi
if [[ -d "$ROOT/tmp" && -z "$(mounted_under "$ROOT")" ]]; then
    # what earlier runs left in the userland's /tmp (a killed pip's build directories, work
    # mount points): none is in use while we hold the lock and nothing is mounted
    rm -rf --one-file-system "${ROOT:?}/tmp/"* "$ROOT/tmp/".[!.]* 2>/dev/null || true
fi
BUILD_S=0
if [[ -f "$ROOT/.fedge-recipe" && "$(cat "$ROOT/.fedge-recipe")" == "$RECIPE" ]]; then
    log "reusing the arm64 userland in $ROOT"
else
    [[ -z "$(mounted_under "$ROOT")" ]] || die 2 "mounts left under $ROOT (an interrupted" \
        "run?): umount them first: $(mounted_under "$ROOT" | tr '\n' ' ')"
    log "building a Debian $SUITE arm64 userland in $ROOT (first run: minutes)"
    T=$(date +%s.%N)
    rm -rf "$ROOT.new" "$ROOT"
    mmdebstrap --arch=arm64 --variant=minbase --include="$INCLUDE" "$SUITE" "$ROOT.new" \
        "$MIRROR" >&2 || die 2 "mmdebstrap failed (network to $MIRROR? see above)"
    echo "$RECIPE" >"$ROOT.new/.fedge-recipe"
    mv "$ROOT.new" "$ROOT"
    BUILD_S=$(elapsed "$T")
fi
if [[ $FIX_BINARY == 0 ]]; then
    interp=$(awk '/^interpreter/ {print $2}' "$BINFMT/qemu-aarch64")
    mkdir -p "$ROOT$(dirname "$interp")"
    cp "$(command -v qemu-aarch64-static)" "$ROOT$interp"
fi
chroot "$ROOT" /bin/true 2>/dev/null \
    || die 3 "this kernel cannot run aarch64 binaries: chroot $ROOT /bin/true failed with" \
       "qemu-aarch64 registered"

# ------------------------------------------------------------------- mounts (undone on exit)
WORK="$(mktemp -d /tmp/fedge-arm64.XXXXXX)"
MOUNTS=()
cleanup() {
    local rc=$?
    for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null \
            || log "could not unmount ${MOUNTS[$i]}"
    done
    [[ -d "$ROOT$WORK" ]] && rmdir "$ROOT$WORK" 2>/dev/null || true
    if [[ $KEEP_WORK == 1 ]]; then log "work directory kept: $WORK"; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
mnt() { mount "$@"; MOUNTS+=("${!#}"); }
mnt -t proc proc "$ROOT/proc"
mnt -t sysfs sysfs "$ROOT/sys"
mnt --bind /dev "$ROOT/dev"
ncpu=$(nproc --all)
for ((c = 0; c < ncpu; c++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\n' "$c"
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\n'
    printf 'CPU part\t: 0xd08\nCPU revision\t: 3\n\n'
done >"$WORK/cpuinfo"
mkdir -p "$ROOT$WORK"
mnt --bind "$WORK" "$ROOT$WORK"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"  # pip resolves PyPI in there

# ------------------------------------------------------------------- 4. the device stack
log "installing this tree without extras in $VENV (aarch64 wheels from PyPI)"
T=$(date +%s.%N)
mkdir "$WORK/src"
for f in pyproject.toml README.md edge_sdk aggregator models tools; do
    cp -r "$REPO/$f" "$WORK/src/"
done
find "$WORK/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
rm -rf "$ROOT$VENV"
chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root \
    python3 -m venv "$VENV" >&2 || die 1 "python3 -m venv failed in the arm64 userland"
# pip trusts what this host trusts (its system CA bundle: a site's own CA, if it has one)
pip_env=(PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_CACHE_DIR=/var/cache/fedge-pip)
if [[ -f /etc/ssl/certs/ca-certificates.crt ]]; then
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/ca-certificates.crt"
    pip_env+=(PIP_CERT="$WORK/ca-certificates.crt")
fi
chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root "${pip_env[@]}" \
    "$VENV/bin/pip" install "$WORK/src" >"$WORK/pip.log" 2>&1 \
    || { tail -30 "$WORK/pip.log" >&2; die 1 "pip install of the device stack failed"; }
INSTALL_S=$(elapsed "$T")
# the packages and sizes, as the userland's python sees them
chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root "$VENV/bin/python" -c '
import importlib.metadata as md, json, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
def size(top):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(top) for f in fs
               if not os.path.islink(os.path.join(d, f)))
def files(d):
    return sum(os.path.getsize(p) for p in (d.locate_file(f) for f in d.files or ())
               if os.path.isfile(p))
dists = {d.metadata["Name"].lower(): d for d in md.distributions()}
mib = {n: round(files(d) / 2**20, 1) for n, d in sorted(dists.items())}
tools = ("pip", "setuptools")  # the venv brings them; a device does not need them to run
print(json.dumps({"venv_mib": round(size(sys.prefix) / 2**20, 1),
                  "site_packages_mib": round(size(site) / 2**20, 1),
                  "device_stack_mib": round(sum(v for n, v in mib.items() if n not in tools), 1),
                  "packages": {n: d.version for n, d in sorted(dists.items())},
                  "packages_mib": mib}))' >"$WORK/stack.json" \
    || die 1 "could not list the installed stack"
# the qemu-user artefact (see the top): importing onnxruntime with the host's x86
# /proc/cpuinfo (139: a segfault), then with the arm64 one bound over it (must be 0)
ort_import() {
    (ulimit -c 0; chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root \
        "$VENV/bin/python" -c 'import onnxruntime' >/dev/null 2>&1) && echo 0 || echo $?
}
ORT_HOST_CPUINFO=$(ort_import 2>/dev/null)
log "import onnxruntime under qemu with the host's /proc/cpuinfo: exit $ORT_HOST_CPUINFO" \
    "(139: the segfault); binding an arm64 /proc/cpuinfo over it"
mnt --bind "$WORK/cpuinfo" "$ROOT/proc/cpuinfo"
ORT_ARM_CPUINFO=$(ort_import 2>/dev/null)
[[ $ORT_ARM_CPUINFO == 0 ]] || die 1 "importing onnxruntime under aarch64 failed (exit" \
    "$ORT_ARM_CPUINFO) even with an arm64 /proc/cpuinfo"
DEBIAN_VERSION=$(cat "$ROOT/etc/debian_version")
"$HOST_PY" - "$WORK/stack.json" "$WORK/setup.json" <<EOF
import json, sys
stack = json.load(open(sys.argv[1]))
json.dump({"debian": "$DEBIAN_VERSION", "rootfs": "$ROOT", "stack": stack,
           "qemu": "$(qemu-aarch64-static --version | head -1)",
           "qemu_cpuinfo": {"onnxruntime_import_exit_host_cpuinfo": $ORT_HOST_CPUINFO,
                            "onnxruntime_import_exit_arm64_cpuinfo": $ORT_ARM_CPUINFO},
           "started_at": $T_START,
           "timings_s": {"rootfs_build": $BUILD_S, "install": $INSTALL_S}},
          open(sys.argv[2], "w"))
EOF

# ------------------------------------------------------------------- 5. the checks
log "checks (DP-SGD round on both engines, then the MQTT round)"
args=(--root "$ROOT" --venv "$VENV" --work "$WORK" --setup "$WORK/setup.json"
      --host-python "$HOST_PY")
[[ -n "$TOLERANCE" ]] && args+=(--tolerance "$TOLERANCE")
set +e
(cd "$REPO" && env -u PYTHONPATH -u VIRTUAL_ENV "$HOST_PY" -m tools.arm64_check host "${args[@]}")
rc=$?
set -e
log "done in $(elapsed "$T_START") s (exit $rc)"
exit "$rc"
}
