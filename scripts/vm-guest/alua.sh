# ALUA through the Linux kernel: open-iscsi logs in to both gateways of one LUN (ports 3260 and
# 3261 of the host, portal group tags 1 and 2); the kernel's ALUA handler (scsi_dh_alua) reads
# each path's state from REPORT TARGET PORT GROUPS, and dm-multipath (`prio alua`) groups the
# paths by it. Under fio with verify, the host sets gateway 1's group unavailable (and gateway
# 2's active/optimized) by a reload of both, then back: I/O must move to the other path and
# back, the sessions stay, and fio sees no error.
# Env: IQN.
mkdir -p /run/lock/iscsi /etc/multipath
modprobe sd_mod
modprobe sg
modprobe scsi_dh_alua
modprobe dm_multipath
# udev, so that multipath reads each path's identity as it does on a real host.
/lib/systemd/systemd-udevd --daemon
udevadm trigger --action=add >/dev/null 2>&1 || true
iscsid
step "open-iscsi: $(iscsiadm --version); $(multipath -h 2>&1 | head -n 1)"
for port in 3260 3261; do
  iscsiadm -m discovery -t sendtargets -p "$HOST_IP:$port" >/dev/null
done
iscsiadm -m node -T "$IQN" --login
udevadm settle || true

A=$(basename "$(session_disk :3260,)")
B=$(basename "$(session_disk :3261,)")
step "gateway 1: /dev/$A, gateway 2: /dev/$B"
state_of() { cat "/sys/block/$1/device/access_state" 2>/dev/null || echo "(no access_state)"; }
# expect_states WANT_A WANT_B: polls until the kernel shows both (it reads them again after the
# unit attention, which the I/O or a TEST UNIT READY on each path collects).
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
# writes_of DISK: sectors written through it so far.
writes_of() { awk '{ print $7 }' "/sys/block/$1/stat"; }
# expect_io_on DISK OTHER: within 30 s, writes go through DISK and none through OTHER for 2 s.
expect_io_on() {
  local i w0 o0
  for i in $(seq 30); do
    w0=$(writes_of "$1")
    o0=$(writes_of "$2")
    sleep 2
    if [ "$(writes_of "$1")" -gt "$w0" ] && [ "$(writes_of "$2")" = "$o0" ]; then
      step "I/O goes through $1 only"
      return 0
    fi
  done
  multipath -ll
  fail "I/O did not move to $1"
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

step "dm-multipath, paths grouped by ALUA priority"
cat >/etc/multipath.conf <<'CONF'
defaults {
    user_friendly_names no
    find_multipaths no
    polling_interval 1
}
devices {
    device {
        vendor "MCSI"
        product ".*"
        path_grouping_policy group_by_prio
        prio alua
        hardware_handler "1 alua"
        path_checker tur
        failback immediate
        no_path_retry 30
    }
}
CONF
multipathd
# dm-multipath marks a path group active only once I/O has gone through the map, and the map's
# first table may list the groups before multipathd has read both priorities: read one block
# through the map each round until the prio 50 group is the active one (failback immediate
# moves it there).
MAP=
for i in $(seq 150); do
  multipath -ll 2>/dev/null >/tmp/ll0 || true
  MAP=$(awk 'NR == 1 { print $1 }' /tmp/ll0)
  if [ -n "$MAP" ] && [ -e "/dev/mapper/$MAP" ]; then
    dd if="/dev/mapper/$MAP" of=/dev/null bs=4096 count=1 iflag=direct 2>/dev/null || true
  fi
  grep -q "prio=50 status=active" /tmp/ll0 && grep -q "prio=10 status=enabled" /tmp/ll0 && break
  sleep 0.2
done
multipath -ll | tee /tmp/ll
MAP=$(awk 'NR == 1 { print $1 }' /tmp/ll)
[ -e "/dev/mapper/$MAP" ] || fail "no multipath map"
# Gateway 1's path is in the prio 50 group (active/optimized), gateway 2's in the prio 10 one
# (active/non-optimized); the prio 50 group is the active one.
awk '/prio=50/ { g = "ao" } /prio=10/ { g = "an" } / sd[a-z]+ / { for (i = 1; i <= NF; i++) if ($i ~ /^sd[a-z]+$/) print g, $i }' /tmp/ll >/tmp/groups
cat /tmp/groups
grep -qx "ao $A" /tmp/groups || fail "gateway 1's path is not in the active/optimized group"
grep -qx "an $B" /tmp/groups || fail "gateway 2's path is not in the active/non-optimized group"
grep -q "prio=50 status=active" /tmp/ll || fail "the active/optimized group is not the active one"

step "fio with verify through the map while the groups change"
fio --name=alua --filename="/dev/mapper/$MAP" --direct=1 --ioengine=libaio --iodepth=8 \
  --rw=randwrite --bs=4k --size=32M --verify=crc32c --verify_backlog=128 --time_based \
  --runtime=40 --output=/tmp/fio.txt &
FIO=$!
expect_io_on "$A" "$B"
say io-running
wait_for failed-over
expect_states unavailable active/optimized
expect_io_on "$B" "$A"
if dd if="/dev/$A" of=/dev/null bs=4096 count=1 iflag=direct 2>/dev/null; then
  fail "a read through the unavailable path succeeded"
fi
multipath -ll
say moved
wait_for failed-back
expect_states active/optimized active/non-optimized
expect_io_on "$A" "$B"
multipath -ll
wait "$FIO" || {
  cat /tmp/fio.txt
  fail "fio failed"
}
cat /tmp/fio.txt
grep -q "err= 0" /tmp/fio.txt || fail "fio reports errors"
[ "$(iscsiadm -m session | wc -l)" = 2 ] || fail "a session ended across the reloads"
say checked
wait_for logout
multipath -F || true
iscsiadm -m node -T "$IQN" --logout
