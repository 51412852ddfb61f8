#!/usr/bin/env bash
# Run a command with the test daemons up: start SLURM and sshd, run "$@", stop both by PID
# whatever happens, exit with the command's status.
#
#   bash .ci/services/with-daemons.sh .venv/bin/python -m pytest -q tests
#
# When the daemons cannot start here (not root, no apt), the command still runs and the daemon
# tests skip with the reason. When they did start, ORCH_REQUIRE_DAEMONS=1 turns any such skip into
# a failure. Daemons that were already running are left running (someone else started them).
set -uo pipefail
here=$(dirname "$0")
. "$here/lib.sh"

started=()
for service in slurm sshd; do
    if bash "$here/$service.sh" status; then
        log "$service already running: leaving it running"
        bash "$here/$service.sh" start || export ORCH_DAEMONS_MISSING=1   # (re)writes env.json
    elif bash "$here/$service.sh" start; then
        started+=("$service")
    else
        log "$service did not start: its tests will skip"
        export ORCH_DAEMONS_MISSING=1
    fi
done
[ "${ORCH_DAEMONS_MISSING:-0}" = 1 ] || export ORCH_REQUIRE_DAEMONS=1

stop_started() {
    local service
    for service in "${started[@]}"; do bash "$here/$service.sh" stop || true; done
}
trap stop_started EXIT
trap 'exit 130' INT TERM

"$@"
