# Clone offload through the Linux kernel: open-iscsi attaches two LUNs of one mcsi target and
# sg_xcopy copies between them with EXTENDED COPY, so the blocks move inside the target. The
# host counts the bytes on the VM's link while the copy runs.
# Env: PORT, IQN, BLOCKS (512-byte blocks to copy).
P=$HOST_IP:$PORT
mkdir -p /run/lock/iscsi
modprobe sd_mod
# sg_xcopy speaks to the disks' SCSI generic nodes.
modprobe sg
iscsid
step "open-iscsi: $(iscsiadm --version); $(sg_xcopy --version 2>&1 | head -n 1)"
iscsiadm -m discovery -t sendtargets -p "$P" >/dev/null
iscsiadm -m node -T "$IQN" -p "$P" --login

# sg_of DISK: the disk's SCSI generic node.
sg_of() {
  local g
  g=$(ls "/sys/block/${1#/dev/}/device/scsi_generic/" 2>/dev/null | head -n 1)
  [ -n "$g" ] || fail "no SCSI generic node for $1"
  wait_dev "/dev/$g" 10
  echo "/dev/$g"
}
SRC=$(session_disk "" 0)
DST=$(session_disk "" 1)
SRC_SG=$(sg_of "$SRC")
DST_SG=$(sg_of "$DST")
echo "source $SRC ($SRC_SG), destination $DST ($DST_SG)"
sg_vpd -p tpc "$SRC" || fail "no Third-party Copy VPD page on $SRC"
sg_copy_results --params "$SRC" || fail "RECEIVE COPY RESULTS (operating parameters) on $SRC"


say ready
wait_for copy
step "sg_xcopy: $BLOCKS blocks from $SRC_SG to $DST_SG"
t0=$(date +%s.%N)
sg_xcopy --on_dst if="$SRC_SG" of="$DST_SG" bs=512 count="$BLOCKS" bpt=8192 list_id=7 id_usage=hold ||
  fail "sg_xcopy"
t1=$(date +%s.%N)
echo "sg_xcopy took $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s"
sg_copy_results --status --list_id=7 "$DST" || fail "RECEIVE COPY RESULTS (copy status) on $DST"
say copied
wait_for logout
iscsiadm -m node -T "$IQN" -p "$P" --logout
[ -z "$(kernel_errors)" ] || fail "kernel I/O errors: $(kernel_errors)"
