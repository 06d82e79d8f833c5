# Helpers for scripts that run inside the test VM (sourced by the job's run.sh).
set -euo pipefail

# say WORDS: a line the host's vm_expect can wait for.
say() { echo "mcsi-vm: $*"; }

# step WORDS: what the script does next, for the log.
step() { echo "--- $*"; }

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

stty -F /dev/ttyS1 raw -echo 2>/dev/null || true
# Held open for the script's life: a line the host sends while no read has the port open would
# otherwise lose its first bytes (seen: "logout" read as "gout").
exec 8<>/dev/ttyS1 2>/dev/null || true

# wait_host: the next line the host sends with vm_send (on /dev/ttyS1), on stdout.
wait_host() {
  local line
  IFS= read -r line <&8
  printf '%s\n' "${line%$'\r'}"
}

# wait_dev PATH [SECONDS]
wait_dev() {
  local i=0
  while [ ! -e "$1" ]; do
    i=$((i + 1))
    [ $i -le $((${2:-30} * 10)) ] || fail "$1 did not appear"
    sleep 0.1
  done
}

# kernel_errors: I/O errors the kernel logged since boot (block layer, SCSI, ext4).
kernel_errors() {
  dmesg | grep -E 'I/O error|EXT4-fs error|Buffer I/O|blk_update_request|critical medium' || true
}

# wait_for WORD: the host's next line that is WORD; a few other lines (shown) are passed over.
wait_for() {
  local line i
  for i in 1 2 3 4 5; do
    line=$(wait_host) || true
    [ "$line" = "$1" ] && return 0
    echo "from the host: $(printf %q "$line"), waiting for $1"
  done
  fail "the host did not say $1"
}

# session_disk [MATCH] [LUN]: the disk (/dev/sdX) of LUN LUN (any when empty) of the first iSCSI
# session whose block in `iscsiadm -m session -P 3` has a line containing MATCH (a portal such
# as ":3261,", an interface as "Iface Name: node2"; any session when empty). Waits up to 10 s
# for the disk to appear.
session_disk() {
  local d i
  for i in $(seq 100); do
    d=$(iscsiadm -m session -P 3 2>/dev/null | awk -v m="${1:-}" -v n="${2:-}" '
      /Current Portal:/ { ok = (m == ""); lun = "" }
      m != "" && index($0, m) > 0 { ok = 1 }
      /Lun: / { lun = $NF }
      ok && /Attached scsi disk/ && (n == "" || lun == n) { print $4; exit }')
    [ -n "$d" ] && [ -e "/dev/$d" ] && {
      echo "/dev/$d"
      return
    }
    sleep 0.1
  done
  iscsiadm -m session -P 3 >&2 || true
  dmesg | tail -n 20 >&2
  fail "no disk${2:+ for LUN $2} attached to the session${1:+ matching '$1'}"
}
