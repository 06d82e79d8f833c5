# Shared helpers for the interop scripts (sourced, not run).

MCSI=${MCSI:-target/release/mcsi}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_port PORT [SECONDS]: wait until something accepts TCP connections on 127.0.0.1:PORT.
wait_port() {
  local port=$1 limit=${2:-30} i=0
  while ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    i=$((i + 1))
    if [ $i -gt $((limit * 10)) ]; then
      echo "nothing listens on 127.0.0.1:$port after ${limit}s" >&2
      return 1
    fi
    sleep 0.1
  done
}

# start_target LOGFILE ARGS...: starts `mcsi target ARGS` in the background, sets TARGET_PID.
start_target() {
  local log=$1
  shift
  "$MCSI" target "$@" >"$log" 2>&1 &
  TARGET_PID=$!
}

# stop_target: SIGTERM, then wait for a clean exit (status 0) within 20 s.
stop_target() {
  [ -n "${TARGET_PID:-}" ] || return 0
  kill -TERM "$TARGET_PID" 2>/dev/null || true
  local i=0 rc=0
  while kill -0 "$TARGET_PID" 2>/dev/null; do
    i=$((i + 1))
    if [ $i -gt 200 ]; then
      echo "target did not exit within 20 s of SIGTERM" >&2
      kill -KILL "$TARGET_PID" 2>/dev/null || true
      TARGET_PID=
      return 1
    fi
    sleep 0.1
  done
  wait "$TARGET_PID" || rc=$?
  TARGET_PID=
  if [ $rc -ne 0 ]; then
    echo "target exited with status $rc after SIGTERM" >&2
    return 1
  fi
}

require() {
  local tool
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "missing tool: $tool (scripts/test installs it; or apt-get install the package)" >&2
      exit 1
    fi
  done
}
