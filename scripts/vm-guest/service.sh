# The Debian package under systemd, with open-iscsi on the same VM: the package installs,
# `systemctl start mcsi` comes up ready, open-iscsi logs in to LUN 0 and writes with fio's
# verify while `mcsi ctl` adds LUN 1 and an ACL (the initiator rescans and sees LUN 1), removes
# it again and ends another session; `systemctl reload mcsi` applies an edited file; the fio
# runs end with no error on a session that was never logged out; `mcsi ctl save`, then after
# `systemctl restart mcsi` open-iscsi reconnects and the saved configuration is what is served.
IQN=iqn.2026-01.org.mcsi:target
P=127.0.0.1:3260
ME=$(sed -n 's/^InitiatorName=//p' /etc/iscsi/initiatorname.iscsi)
CONF=/etc/mcsi/mcsi.toml

journal() { journalctl -u mcsi --no-pager -o cat | tail -n "${1:-30}" >&2; }
disks() { iscsiadm -m session -P 3 2>/dev/null | awk '/Attached scsi disk/ {print $4}'; }
# tsihs: the TSIHs of the target's sessions, in order.
tsihs() { mcsi ctl sessions | awk '/^TSIH/ {print $2}' | xargs; }

step "install the package"
dpkg -i /job/mcsi.deb >/tmp/dpkg.log 2>&1 || {
  cat /tmp/dpkg.log
  fail "dpkg -i mcsi.deb"
}
if systemctl is-enabled --quiet mcsi; then fail "installing the package enabled the service"; fi
man -P cat mcsi-target 2>/dev/null | grep -q -- "--control" || fail "man mcsi-target does not show the target's options"
echo "man mcsi-target: $(man -P cat mcsi-target 2>/dev/null | wc -l) lines"

step "systemctl start mcsi"
systemctl start mcsi || {
  journal
  fail "systemctl start mcsi"
}
# Type=notify: start returns once the target said READY=1, so it must listen already.
systemctl is-active --quiet mcsi || fail "mcsi is not active after start"
bash -c "exec 3<>/dev/tcp/127.0.0.1/3260" || fail "started, but nothing listens on $P"
mcsi ctl targets

step "open-iscsi logs in to LUN 0"
iscsiadm -m discovery -t sendtargets -p "$P"
iscsiadm -m node -T "$IQN" -p "$P" --login
for i in $(seq 100); do
  DEV=$(disks | head -n 1)
  [ -n "$DEV" ] && [ -e "/dev/$DEV" ] && break
  sleep 0.1
done
[ -e "/dev/$DEV" ] || fail "no disk attached to the session"
DEV=/dev/$DEV
SID=$(iscsiadm -m session | sed -n 's/^tcp: \[\([0-9]*\)\].*/\1/p' | head -n 1)
OURS=$(tsihs)
echo "disk $DEV, open-iscsi session $SID, the target's TSIH $OURS"

step "fio with verify on LUN 0, in rounds, while mcsi ctl changes the target"
rm -f /tmp/stop /tmp/fio.fail
(
  n=0
  while [ ! -e /tmp/stop ]; do
    n=$((n + 1))
    fio --name=live --filename="$DEV" --direct=1 --ioengine=libaio --iodepth=8 --rw=randwrite \
      --bs=4k --size=16M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --minimal \
      >/tmp/fio.$n 2>&1 || {
      cat /tmp/fio.$n
      echo "round $n" >/tmp/fio.fail
      break
    }
  done
  echo "$n" >/tmp/fio.rounds
) &
FIO=$!
sleep 2

mcsi ctl add-lun 1 file:/var/lib/mcsi/lun1.img:64MiB || fail "mcsi ctl add-lun 1"
mcsi ctl allow-initiator "$ME" || fail "mcsi ctl allow-initiator"
iscsiadm -m session -r "$SID" --rescan >/dev/null
for i in $(seq 100); do
  [ "$(disks | wc -l)" -ge 2 ] && break
  sleep 0.1
done
[ "$(disks | wc -l)" -ge 2 ] || fail "the rescan did not find LUN 1"
echo "after the rescan: $(disks | tr '\n' ' ')"
mcsi ctl remove-lun 1 || fail "mcsi ctl remove-lun 1"

# Another session (mcsi's own initiator, named as this host), ended by the administrator.
mcsi bench "iscsi://$P/$IQN/0" --rw randread --runtime 60 >/tmp/bench.out 2>&1 &
BENCH=$!
for i in $(seq 100); do
  [ "$(tsihs | wc -w)" -ge 2 ] && break
  sleep 0.1
done
OTHER=$(for t in $(tsihs); do [ "$t" = "$OURS" ] || echo "$t"; done | head -n 1)
[ -n "$OTHER" ] || fail "the bench's session did not appear"
mcsi ctl end-session "$OTHER" || fail "mcsi ctl end-session $OTHER"
kill "$BENCH" 2>/dev/null || true
wait "$BENCH" 2>/dev/null || true

# What mcsi ctl changed goes into the file; then an edit of the file, applied by systemctl
# reload: LUN 2 added (a reload makes the file the truth, so the ACL must be in it by now).
mcsi ctl save || fail "mcsi ctl save"
grep -q "$ME" "$CONF" || fail "the saved file lacks the ACL"
sed -i '/^  { lun = 0, /a\  { lun = 2, backend = "file:/var/lib/mcsi/lun2.img:64MiB" },' "$CONF"
grep -q "lun = 2" "$CONF" || fail "the test could not edit $CONF"
systemctl reload mcsi || {
  journal
  fail "systemctl reload mcsi"
}
mcsi ctl targets | tee /tmp/targets
grep -q "LUN 2 " /tmp/targets || fail "the reload did not add LUN 2"
grep -q "LUN 0 " /tmp/targets || fail "the reload took LUN 0 away"
grep -q "initiators $ME" /tmp/targets || fail "the reload lost the ACL"

sleep 2
touch /tmp/stop
wait "$FIO" || true
[ -e /tmp/fio.fail ] && fail "fio failed in $(cat /tmp/fio.fail)"
echo "fio: $(cat /tmp/fio.rounds) rounds of 16 MiB random writes, each verified, no error"
case " $(tsihs) " in
*" $OURS "*) ;;
*) fail "open-iscsi's session is not the one it logged in with (TSIH $OURS; now $(tsihs))" ;;
esac
echo "open-iscsi's session (TSIH $OURS) was never logged out"

step "systemctl restart mcsi: the saved configuration is served"
cat "$CONF"
systemctl restart mcsi || {
  journal
  fail "systemctl restart mcsi"
}
for i in $(seq 300); do
  iscsiadm -m session -P 1 2>/dev/null | grep -q "iSCSI Session State: LOGGED_IN" &&
    dd if="$DEV" of=/dev/null bs=4k count=16 iflag=direct 2>/dev/null && break
  sleep 0.1
done
iscsiadm -m session -P 1 | grep -E "Session State|Connection State"
dd if="$DEV" of=/dev/null bs=1M count=16 iflag=direct || fail "no I/O after the restart"
mcsi ctl targets | tee /tmp/targets
grep -q "LUN 2 " /tmp/targets || fail "after the restart LUN 2 (saved) is not served"
grep -q "initiators $ME" /tmp/targets || fail "after the restart the saved ACL is not in force"
fio --name=after --filename="$DEV" --direct=1 --ioengine=libaio --iodepth=8 --rw=randwrite \
  --bs=4k --size=8M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --minimal >/tmp/fio.after ||
  fail "fio with verify after the restart"
iscsiadm -m node -T "$IQN" -p "$P" --logout
systemctl stop mcsi
say "service done"
