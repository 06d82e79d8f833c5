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

# --- tgt (the Linux user-space target), the calibration peer ---------------------------------

TGT_PID=
TGT_CTL=
TGT_PORT=
TGT_FILE=

# tgt_start LOG IQN FILE SIZE: installs tgt when missing, starts tgtd on a free loopback port
# with FILE (created sparse, SIZE for truncate) as LUN 1 of target IQN (LUN 0 is tgt's
# controller). Sets TGT_PORT, TGT_PID, TGT_CTL, TGT_FILE; returns non-zero if tgt cannot start.
tgt_start() {
  local log=$1 iqn=$2 file=$3 size=$4
  if ! command -v tgtd >/dev/null 2>&1; then
    echo "installing tgt" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y tgt >&2 ||
      { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y tgt >&2; } || true
  fi
  require tgtd tgtadm
  TGT_PORT=$(free_port)
  # tgtd's control "port" names a local socket (/run/tgtd/socket.N, N at most 32767): an unused one.
  TGT_CTL=$((TGT_PORT % 30000 + 1000))
  while [ -e "/run/tgtd/socket.$TGT_CTL" ] || [ -e "/var/run/tgtd/socket.$TGT_CTL" ]; do
    TGT_CTL=$(((TGT_CTL + 1) % 30000 + 1000))
  done
  TGT_FILE=$file
  truncate -s "$size" "$TGT_FILE"
  tgtd -f -C "$TGT_CTL" --iscsi "portal=127.0.0.1:$TGT_PORT" >"$log" 2>&1 &
  TGT_PID=$!
  if ! wait_port "$TGT_PORT" 10 ||
    ! tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op new --tid 1 -T "$iqn" ||
    ! tgtadm -C "$TGT_CTL" --lld iscsi --mode logicalunit --op new --tid 1 --lun 1 -b "$TGT_FILE" ||
    ! tgtadm -C "$TGT_CTL" --lld iscsi --mode target --op bind --tid 1 -I ALL; then
    echo "tgt could not be started (see $log)" >&2
    return 1
  fi
}

# tgt_stop: takes tgtd down (offline, delete, TERM, KILL) and removes its backing file.
tgt_stop() {
  if [ -n "$TGT_PID" ]; then
    tgtadm -C "$TGT_CTL" --op update --mode sys --name State -v offline >/dev/null 2>&1 || true
    tgtadm -C "$TGT_CTL" --op delete --mode system >/dev/null 2>&1 || true
    sleep 0.2
    kill -TERM "$TGT_PID" 2>/dev/null || true
    sleep 0.2
    kill -KILL "$TGT_PID" 2>/dev/null || true
    wait "$TGT_PID" 2>/dev/null || true
    TGT_PID=
    # A tgtd that crashed leaves its control socket behind.
    rm -f "/run/tgtd/socket.$TGT_CTL" "/run/tgtd/socket.$TGT_CTL.lock" 2>/dev/null || true
  fi
  [ -z "$TGT_FILE" ] || rm -f "$TGT_FILE"
  TGT_FILE=
}
