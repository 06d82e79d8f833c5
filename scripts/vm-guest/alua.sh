# ALUA through the Linux kernel: open-iscsi logs in to both gateways of one LUN (ports 3260 and
# 3261 of the host, portal group tags 1 and 2); the kernel's ALUA handler (scsi_dh_alua) reads
# each path's state from REPORT TARGET PORT GROUPS. The host then swaps the states in both
# gateways' files and reloads them; the sessions stay, and the kernel must see the new states
# (from ASYMMETRIC ACCESS STATE CHANGED) and read through the new active/optimized path.
# Env: IQN.
mkdir -p /run/lock/iscsi
modprobe sd_mod
modprobe sg
modprobe scsi_dh_alua
iscsid
step "open-iscsi: $(iscsiadm --version); $(sg_rtpg --version 2>&1 | head -n 1)"
for port in 3260 3261; do
  iscsiadm -m discovery -t sendtargets -p "$HOST_IP:$port" >/dev/null
done
iscsiadm -m node -T "$IQN" --login

# disk_of PORT: the disk of the session through the portal on PORT.
disk_of() {
  local d i
  for i in $(seq 100); do
    d=$(iscsiadm -m session -P 3 2>/dev/null |
      awk -v p=":$1," '/Current Portal:/ { cur = index($3, p) > 0 } cur && /Attached scsi disk/ { print $4; exit }')
    [ -n "$d" ] && [ -e "/dev/$d" ] && {
      echo "$d"
      return
    }
    sleep 0.1
  done
  fail "no disk attached to the session through port $1"
}
A=$(disk_of 3260)
B=$(disk_of 3261)
step "gateway 1: /dev/$A, gateway 2: /dev/$B"
wait_for() {
  local line i
  for i in 1 2 3 4 5; do
    line=$(wait_host) || true
    [ "$line" = "$1" ] && return 0
    echo "from the host: $(printf %q "$line"), waiting for $1"
  done
  fail "the host did not say $1"
}
state_of() { cat "/sys/block/$1/device/access_state" 2>/dev/null || echo "(no access_state)"; }
# expect_states WANT_A WANT_B: polls until the kernel shows both (it reads them again after a
# unit attention, which a TEST UNIT READY on each path collects).
expect_states() {
  local i a b
  for i in $(seq 60); do
    a=$(state_of "$A")
    b=$(state_of "$B")
    [ "$a" = "$1" ] && [ "$b" = "$2" ] && {
      step "the kernel sees $A $a, $B $b"
      return 0
    }
    sg_turs "/dev/$A" >/dev/null 2>&1 || true
    sg_turs "/dev/$B" >/dev/null 2>&1 || true
    sleep 0.5
  done
  fail "the kernel sees $A $a and $B $b, not $1 and $2"
}

step "TPGS and the port groups"
sg_inq "/dev/$A" | tee /tmp/inq
grep -q "TPGS=1" /tmp/inq || fail "INQUIRY does not say TPGS=1 (implicit ALUA)"
sg_rtpg -d "/dev/$A" | tee /tmp/rtpg
grep -q "target port group id : 0x1" /tmp/rtpg || fail "REPORT TARGET PORT GROUPS has no group 1"
sg_vpd -p di "/dev/$B" | tee /tmp/vpd
grep -qi "target port group: 0x2" /tmp/vpd || fail "VPD 83h through gateway 2 does not name group 2"
[ -e "/sys/block/$A/device/dh_state" ] && step "handler: $(cat "/sys/block/$A/device/dh_state")"
expect_states active/optimized active/non-optimized
dd if="/dev/$A" of=/dev/null bs=4096 count=16 iflag=direct 2>/dev/null || fail "a read through the optimized path"
say ready
wait_for swapped

step "after both gateways reloaded the swapped states"
expect_states standby active/optimized
dd if="/dev/$B" of=/dev/null bs=4096 count=16 iflag=direct 2>/dev/null || fail "a read through the new optimized path"
if dd if="/dev/$A" of=/dev/null bs=4096 count=1 iflag=direct 2>/dev/null; then
  fail "a read through the standby path succeeded"
fi
[ "$(iscsiadm -m session | wc -l)" = 2 ] || fail "a session ended across the reload"
say checked
wait_for logout
iscsiadm -m node -T "$IQN" --logout
