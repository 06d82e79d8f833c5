# Fencing with Pacemaker's fence_scsi (Debian's fence-agents): two cluster nodes are two iSCSI
# sessions of the VM under two initiator names (open-iscsi interfaces node1 and node2), each
# with its own disk for the one LUN. fence_scsi unfences both (each registers its key; the
# first reserves WRITE EXCLUSIVE, REGISTRANTS ONLY); then node 1 fences node 2: node 2's key is
# preempted (PREEMPT AND ABORT), its writes get RESERVATION CONFLICT and change nothing, node 1's
# go through; node 2 is unfenced again and writes.
# Env: PORT, IQN.
P=$HOST_IP:$PORT
# fence_scsi's keys: hexadecimal, as sg_persist prints them (no 0x, no leading zeros).
K1=6d630001
K2=6d630002
mkdir -p /run/lock/iscsi
modprobe sd_mod
modprobe sg
iscsid
step "open-iscsi: $(iscsiadm --version); fence-agents $(fence_scsi -V 2>&1 | head -n 1)"
for n in node1 node2; do
  iscsiadm -m iface -I "$n" -o new >/dev/null
  iscsiadm -m iface -I "$n" -o update -n iface.initiatorname -v "iqn.2026-01.org.mcsi:vm-$n" >/dev/null
done
iscsiadm -m discovery -t sendtargets -p "$P" -I node1 -I node2 >/dev/null
iscsiadm -m node -T "$IQN" -p "$P" -I node1 --login
iscsiadm -m node -T "$IQN" -p "$P" -I node2 --login
D1=$(session_disk "Iface Name: node1")
D2=$(session_disk "Iface Name: node2")
BS=$(blockdev --getss "$D1")
step "node 1: $D1, node 2: $D2 (the same LUN, ${BS}-byte blocks)"
[ "$D1" != "$D2" ] || fail "the two nodes share one disk"

keys() { sg_persist -n -i -k "$1" 2>&1; }
# write_block DISK BYTE: one block of BYTE at LBA 0 through DISK (O_DIRECT).
write_block() {
  head -c "$BS" /dev/zero | tr '\0' "\\$(printf %03o "$2")" >/tmp/block
  dd if=/tmp/block of="$1" bs="$BS" count=1 oflag=direct conv=notrunc 2>/tmp/dd.err
}
# first_byte DISK: the first byte of LBA 0 read through DISK (O_DIRECT), in decimal.
first_byte() {
  dd if="$1" bs="$BS" count=1 iflag=direct 2>/dev/null | od -An -tu1 -N1 | tr -d ' '
}

step "unfence node 2, then node 1"
fence_scsi -d "$D2" -k "$K2" -o on || fail "fence_scsi on (node 2)"
fence_scsi -d "$D1" -k "$K1" -o on || fail "fence_scsi on (node 1)"
keys "$D1" | tee /tmp/keys
grep -q "0x$K1" /tmp/keys && grep -q "0x$K2" /tmp/keys || fail "both keys are not registered"
sg_persist -n -i -r "$D1" | tee /tmp/resv
grep -qi "write exclusive, registrants only" /tmp/resv || fail "no WRITE EXCLUSIVE, REGISTRANTS ONLY reservation"
write_block "$D1" 17 || fail "node 1 cannot write while both are registered: $(cat /tmp/dd.err)"
write_block "$D2" 34 || fail "node 2 cannot write while both are registered: $(cat /tmp/dd.err)"
[ "$(first_byte "$D1")" = 34 ] || fail "node 1 does not read node 2's write"

step "node 1 fences node 2"
fence_scsi -d "$D1" -k "$K2" -o off || fail "fence_scsi off (node 2 from node 1)"
keys "$D1" | tee /tmp/keys
grep -q "0x$K1" /tmp/keys || fail "node 1's key is gone"
! grep -q "0x$K2" /tmp/keys || fail "node 2's key is still registered"
fence_scsi -d "$D1" -k "$K2" -o status 2>&1 | tee /tmp/status || true
grep -q "Status: OFF" /tmp/status || fail "fence_scsi does not report node 2 off"
sg_persist -n -i -r "$D1" | tee /tmp/resv
grep -q "Key=0x$K1" /tmp/resv || grep -qi "key=0x$K1" /tmp/resv || fail "node 1 does not hold the reservation"

step "node 2's writes are refused"
# The first command of node 2 collects the unit attention of the preemption.
sg_turs "$D2" >/dev/null 2>&1 || true
sg_turs "$D2" >/dev/null 2>&1 || true
head -c "$BS" /dev/zero >/tmp/zero
if sg_raw -s "$BS" -i /tmp/zero "$D2" 2a 00 00 00 00 00 00 00 01 00 >/tmp/raw 2>&1; then
  cat /tmp/raw
  fail "node 2's WRITE(10) was accepted after fencing"
fi
cat /tmp/raw
grep -qi "reservation conflict" /tmp/raw || fail "node 2's WRITE(10) did not get RESERVATION CONFLICT"
if write_block "$D2" 51; then fail "node 2's write through the block layer succeeded after fencing"; fi
echo "dd through node 2: $(tail -n 1 /tmp/dd.err)"
[ "$(first_byte "$D2")" = 34 ] || fail "node 2 cannot read, or its refused writes changed the block"
write_block "$D1" 68 || fail "node 1 cannot write after fencing node 2: $(cat /tmp/dd.err)"
[ "$(first_byte "$D1")" = 68 ] || fail "node 1 does not read its own write"
dmesg | grep -i "reservation\|nexus" | tail -n 3 || true

step "unfence node 2"
fence_scsi -d "$D2" -k "$K2" -o on || fail "fence_scsi on (node 2 again)"
keys "$D1" | grep -q "0x$K2" || fail "node 2's key is not registered again"
write_block "$D2" 85 || fail "node 2 cannot write once unfenced: $(cat /tmp/dd.err)"
[ "$(first_byte "$D1")" = 85 ] || fail "node 1 does not read node 2's write"

step "release"
sg_persist -n -o -L -T 5 -K "$K1" "$D1" >/dev/null || fail "RELEASE"
sg_persist -n -o -C -K "$K1" "$D1" >/dev/null || fail "CLEAR"
iscsiadm -m node -T "$IQN" -p "$P" --logout >/dev/null
say fenced
