#!/usr/bin/env bash
# A real sshd on 127.0.0.1 for the SSH launch tests: its own port, host key, user key and config,
# all under $ORCH_CI_STATE/ssh (the system's sshd and ~/.ssh are left alone).
#
#   sshd.sh install   apt-get openssh-server/-client if missing
#   sshd.sh start     install, generate keys and configs, start sshd, wait until a real login works
#                     (idempotent: a running sshd is left alone)
#   sshd.sh status    exit 0 when sshd runs
#   sshd.sh stop      stop sshd by the PID it recorded
#   sshd.sh env       print `export` lines (also in $ORCH_CI_STATE/ssh/env.json for the tests)
#
# Host keys are checked for real: known_hosts holds the generated host key as [127.0.0.1]:PORT,
# and the ssh config snippet defines two aliases (orch-a, orch-b) for the same sshd, so tests get
# two "hosts". StrictModes is off because the state lives under /tmp, which is world-writable:
# with it on, sshd ignores authorized_keys there.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

DIR="$ORCH_CI_STATE/ssh"
PORT="${ORCH_SSH_PORT:-16822}"
USER_NAME=$(id -un)

install() {
    apt_install_missing sshd openssh-server ssh openssh-client ssh-keygen openssh-client
}

write_config() {
    mkdir -p "$DIR"
    chmod 700 "$DIR"
    [ -s "$DIR/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C orchestrate-ci-host -f "$DIR/host_ed25519"
    [ -s "$DIR/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C orchestrate-ci-user -f "$DIR/id_ed25519"
    cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
    echo "[127.0.0.1]:$PORT $(cut -d' ' -f1,2 "$DIR/host_ed25519.pub")" > "$DIR/known_hosts"
    cat > "$DIR/sshd_config" <<EOF
# Written by .ci/services/sshd.sh for the daemon tests; not for production.
Port $PORT
ListenAddress 127.0.0.1
HostKey $DIR/host_ed25519
PidFile $DIR/sshd.pid
AuthorizedKeysFile $DIR/authorized_keys
AuthenticationMethods publickey
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AllowUsers $USER_NAME
StrictModes no
UsePAM no
# The tests open several sessions at once (one per host plus the stop commands).
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
EOF
    cat > "$DIR/ssh_config" <<EOF
# Two aliases for the same test sshd, so launch tests see two hosts.
Host orch-a orch-b 127.0.0.1
    HostName 127.0.0.1
    Port $PORT
    User $USER_NAME
    IdentityFile $DIR/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $DIR/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
EOF
}

login_works() {
    ssh -F "$DIR/ssh_config" -o ConnectTimeout=2 orch-a true
}

start() {
    install
    need_root
    if pid_alive "$DIR/sshd.pid" sshd; then
        log "already running (pid $(cat "$DIR/sshd.pid"))"
    else
        write_config
        mkdir -p /run/sshd && chmod 755 /run/sshd   # privilege separation directory; no systemd to make it
        /usr/sbin/sshd -t -f "$DIR/sshd_config" || die "bad sshd config"
        /usr/sbin/sshd -f "$DIR/sshd_config" -E "$DIR/sshd.log"
        wait_for 10 test -s "$DIR/sshd.pid" || die "sshd did not start; see $DIR/sshd.log"
    fi
    wait_for 10 login_works || die "cannot log in through sshd; see $DIR/sshd.log"
    json_env "$DIR/env.json" ORCH_SSH_HOST 127.0.0.1 ORCH_SSH_PORT "$PORT" ORCH_SSH_USER "$USER_NAME" \
        ORCH_SSH_KEY "$DIR/id_ed25519" ORCH_SSH_KNOWN_HOSTS "$DIR/known_hosts" \
        ORCH_SSH_CONFIG "$DIR/ssh_config" ORCH_SSH_ALIASES "orch-a orch-b" ORCH_SSH_PID_FILE "$DIR/sshd.pid"
    log "sshd up on 127.0.0.1:$PORT (pid $(cat "$DIR/sshd.pid"))"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    status) pid_alive "$DIR/sshd.pid" sshd ;;
    stop) stop_pids sshd="$DIR/sshd.pid"; rm -f "$DIR/env.json" ;;
    env)
        [ -f "$DIR/ssh_config" ] || die "not started"
        echo "export ORCH_SSH_PORT=$PORT ORCH_SSH_CONFIG=$DIR/ssh_config ORCH_SSH_KEY=$DIR/id_ed25519" \
             "ORCH_SSH_KNOWN_HOSTS=$DIR/known_hosts"
        ;;
    *) echo "usage: $0 {install|start|status|stop|env}" >&2; exit 2 ;;
esac
