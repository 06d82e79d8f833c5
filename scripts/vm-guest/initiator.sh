# The Linux kernel's iSCSI initiator (open-iscsi) against mcsi's target on the host.
# Env: PORT, IQN, CHAP_USER, CHAP_SECRET, TGT_USER, TGT_SECRET.
P=$HOST_IP:$PORT
mkdir -p /run/lock/iscsi
# No udev in the VM: load the SCSI disk driver that udev would load for the session's LUN.
modprobe sd_mod
iscsid
step "open-iscsi: $(iscsiadm --version)"

node() { iscsiadm -m node -T "$IQN" -p "$P" "$@"; }
set_node() { node -o update -n "$1" -v "$2" >/dev/null; }
check_files() { (cd /mnt && sha256sum -c --quiet /tmp/sums) || fail "files differ after $1"; }

step "discovery"
iscsiadm -m discovery -t sendtargets -p "$P" | tee /tmp/disc
grep -q "^$P,1 $IQN\$" /tmp/disc || fail "discovery did not list $IQN at $P"
set_node node.session.timeo.replacement_timeout 60

step "login"
node --login
DEV=$(session_disk)
echo "disk $DEV: $(cat /sys/block/${DEV#/dev/}/device/vendor) $(cat /sys/block/${DEV#/dev/}/device/model), $(blockdev --getsize64 $DEV) bytes"
iscsiadm -m session -P 2 | grep -E 'Digest|MaxRecv|FirstBurst|MaxBurst|ImmediateData|InitialR2T|MaxOutstandingR2T'

step "fio with verify on the block device"
fio --name=raw-rand --filename="$DEV" --direct=1 --ioengine=libaio --iodepth=16 --rw=randwrite \
  --bs=4k --size=48M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --minimal >/tmp/fio1 ||
  fail "fio 4k random write+verify"
fio --name=raw-seq --filename="$DEV" --offset=64M --direct=1 --ioengine=libaio --iodepth=8 \
  --rw=write --bsrange=4k-1m --size=64M --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
  --minimal >/tmp/fio2 || fail "fio 4k-1m sequential write+verify"
echo "fio: random 4k and sequential 4k-1m writes verified (errors: $(cut -d';' -f5 /tmp/fio1), $(cut -d';' -f5 /tmp/fio2))"

step "sense data and task management through the kernel"
# sg_raw CDB...: the command through the kernel's SG_IO on $DEV; its decoded status and sense.
sg() { sg_raw -r 4096 "$DEV" "$@" 2>&1 || true; }
blocks=$(($(blockdev --getsize64 "$DEV") / $(blockdev --getss "$DEV")))
lba=$(printf '%016x' "$blocks" | sed 's/../& /g')
sg 88 00 $lba 00 00 00 01 00 00 | tee /tmp/sense1
grep -q "Logical block address out of range" /tmp/sense1 ||
  fail "READ(16) past the last LBA: no ILLEGAL REQUEST / LBA OUT OF RANGE"
sg ff 00 00 00 00 00 | tee /tmp/sense2
grep -q "Invalid command operation code" /tmp/sense2 ||
  fail "an unknown opcode: no ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE"
sg_reset --device "$DEV" || fail "sg_reset --device (LOGICAL UNIT RESET)"
sg_reset --target "$DEV" || fail "sg_reset --target (TARGET WARM RESET)"
sg_turs -n 3 "$DEV" >/dev/null 2>&1 || true # the unit attentions the resets raised
sg_turs "$DEV" || fail "TEST UNIT READY after the resets"
fio --name=after-reset --filename="$DEV" --direct=1 --ioengine=libaio --iodepth=16 \
  --rw=randwrite --bs=4k --size=8M --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
  --minimal >/tmp/fio5 || fail "fio after the resets"
echo "out-of-range and unknown-opcode sense decoded; LU and target reset; I/O verified after"

step "ext4: mkfs, mount, files, sync, remount, check"
mkfs.ext4 -q "$DEV"
mkdir -p /mnt
mount "$DEV" /mnt
head -c 24M /dev/urandom >/mnt/random.bin
cp -a /usr/lib/x86_64-linux-gnu /mnt/libs
(cd /mnt && find . -type f ! -name lost+found -exec sha256sum {} + >/tmp/sums)
sync
umount /mnt
mount "$DEV" /mnt
check_files "remount"
echo "files: $(wc -l </tmp/sums) verified after remount"
umount /mnt
e2fsck -fn "$DEV" || fail "e2fsck after the first session"
step "logout"
node --logout
iscsiadm -m session 2>/dev/null && fail "a session is left after logout" || true

say phase chap
[ "$(wait_host)" = go ] || fail "the host did not restart the target with CHAP"

step "mutual CHAP and CRC32C digests"
iscsiadm -m discoverydb -t sendtargets -p "$P" -o new >/dev/null
for kv in authmethod=CHAP username=$CHAP_USER password=$CHAP_SECRET username_in=$TGT_USER password_in=$TGT_SECRET; do
  iscsiadm -m discoverydb -t sendtargets -p "$P" -o update -n "discovery.sendtargets.auth.${kv%%=*}" -v "${kv#*=}" >/dev/null
done
iscsiadm -m discoverydb -t sendtargets -p "$P" --discover | grep -q "$IQN" || fail "CHAP discovery"
set_node node.session.auth.authmethod CHAP
# open-iscsi offers only MD5 unless told otherwise; mcsi allows MD5 only when configured to.
set_node node.session.auth.chap_algs SHA3-256,SHA256,SHA1,MD5
set_node node.session.auth.username "$CHAP_USER"
set_node node.session.auth.username_in "$TGT_USER"
set_node node.session.auth.password_in "$TGT_SECRET"
set_node "node.conn[0].iscsi.HeaderDigest" CRC32C
set_node "node.conn[0].iscsi.DataDigest" CRC32C
set_node node.session.timeo.replacement_timeout 60
set_node node.session.auth.password wrong-secret-123
if node --login >/tmp/login 2>&1; then fail "login with a wrong CHAP secret succeeded"; fi
echo "wrong initiator secret refused: $(grep -o 'iscsiadm: .*' /tmp/login | tail -n 1)"
set_node node.session.auth.password "$CHAP_SECRET"
set_node node.session.auth.password_in wrong-target-secret
if node --login >/tmp/login 2>&1; then fail "a target that proved the wrong secret was accepted"; fi
echo "wrong target secret refused: $(grep -o 'iscsiadm: .*' /tmp/login | tail -n 1)"
set_node node.session.auth.password_in "$TGT_SECRET"
node --login
DEV=$(session_disk)
iscsiadm -m session -P 2 | grep -E 'HeaderDigest|DataDigest'
iscsiadm -m session -P 2 | grep -q 'HeaderDigest: CRC32C' || fail "header digest not CRC32C"
iscsiadm -m session -P 2 | grep -q 'DataDigest: CRC32C' || fail "data digest not CRC32C"
mount "$DEV" /mnt
check_files "the CHAP login"
echo "files from the first session intact"
fio --name=digest --directory=/mnt --size=32M --rw=randrw --bsrange=4k-256k --ioengine=libaio \
  --direct=1 --iodepth=8 --verify=crc32c --verify_fatal=1 --verify_state_save=0 --minimal \
  >/tmp/fio3 || fail "fio on ext4 with digests"
rm -f /mnt/digest.*

step "target restart while mounted and writing"
fio --name=restart --directory=/mnt --size=40M --rw=randwrite --bs=4k --ioengine=libaio \
  --direct=1 --iodepth=8 --rate_iops=500 --verify=crc32c --verify_backlog=256 --verify_fatal=1 \
  --verify_state_save=0 --minimal >/tmp/fio4 2>&1 &
fio_pid=$!
sleep 4
say restart-target
[ "$(wait_host)" = restarted ] || fail "the host did not restart the target"
t0=$(date +%s)
rc=0
wait $fio_pid || rc=$?
cat /tmp/fio4 | cut -d';' -f1-5
[ $rc = 0 ] || fail "fio failed across the target restart (status $rc)"
echo "fio finished $(( $(date +%s) - t0 )) s after the restart, verified, no error"
dmesg | grep -E 'connection[0-9:]+|session[0-9]+' | tail -n 8 || true
errs=$(kernel_errors)
[ -z "$errs" ] || fail "kernel I/O errors: $errs"
check_files "the restart"
rm -f /mnt/restart.*
umount /mnt
e2fsck -fn "$DEV" || fail "e2fsck after the restart"
node --logout
say all passed
