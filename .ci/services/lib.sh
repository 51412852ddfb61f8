# Shared helpers for the CI daemon scripts (sourced, not run). Everything they create lives under
# $ORCH_CI_STATE, never inside the repository, and every daemon is stopped by the PID it recorded.

ORCH_CI_STATE="${ORCH_CI_STATE:-/tmp/orchestrate-ci}"

log() { echo "[$(basename "$0" .sh)] $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    # The daemons switch users (munged runs as munge, sshd logs root in): only root can set that up.
    [ "$(id -u)" = 0 ] || die "must run as root (daemons switch users); tests that need them will skip"
}

# apt-get install only what is missing; `install` is a no-op on a machine that already has them.
apt_install_missing() {
    local missing=() bin pkg
    while [ $# -gt 0 ]; do
        bin=$1 pkg=$2; shift 2
        command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    need_root
    log "installing ${missing[*]}"
    # policy-rc.d and the missing systemd keep the packages from starting their own daemons.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# pid_alive FILE NAME: the PID in FILE is running and its command name starts with NAME (so a reused
# PID from an earlier boot is never taken for our daemon).
pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1")
    [ -d "/proc/$pid" ] || return 1
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in "$2"*) return 0 ;; *) return 1 ;; esac
}

# stop_pids NAME=FILE...: TERM every daemon recorded in the FILEs at once (each takes ~2 s to save its
# state and exit), wait up to 10 s for all of them, then KILL what is left.
stop_pids() {
    local arg name file pids=() pid i
    for arg in "$@"; do
        name=${arg%%=*} file=${arg#*=}
        if pid_alive "$file" "$name"; then
            pid=$(cat "$file"); pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
            log "stopping $name (pid $pid)"
        fi
        rm -f "$file"
    done
    for pid in "${pids[@]}"; do
        for i in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        [ -d "/proc/$pid" ] && kill -KILL "$pid" 2>/dev/null && log "killed pid $pid"
    done
    return 0
}

# wait_for SECONDS COMMAND...: poll every 0.1 s until COMMAND succeeds.
wait_for() {
    local deadline=$(( $(date +%s) + $1 )); shift
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -ge "$deadline" ] && return 1
        sleep 0.1
    done
}

# json_env FILE KEY VALUE...: write a flat JSON object of strings (values must not contain quotes).
json_env() {
    local file=$1 sep="" out="{"; shift
    while [ $# -gt 0 ]; do out+="$sep\"$1\": \"$2\""; sep=", "; shift 2; done
    echo "$out}" > "$file.tmp" && mv "$file.tmp" "$file"
}
