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
