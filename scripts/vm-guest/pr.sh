# Persistent reservations through the Linux kernel: open-iscsi attaches a LUN of mcsi's target
# (started with --state-dir), sg_persist registers a key with APTPL (then replaces it) and
# reserves; the host kills the target with SIGKILL and starts it again; open-iscsi reconnects,
# and sg_persist must read the same keys and reservation, and the reservation must still hold.
# Env: PORT, IQN.
P=$HOST_IP:$PORT
mkdir -p /run/lock/iscsi
modprobe sd_mod
modprobe sg
iscsid
step "open-iscsi: $(iscsiadm --version); $(sg_persist --version 2>&1 | head -n 1)"
iscsiadm -m discovery -t sendtargets -p "$P" >/dev/null
# Reconnect quickly once the target is back (the replacement timeout keeps I/O queued).
iscsiadm -m node -T "$IQN" -p "$P" -o update -n node.session.timeo.replacement_timeout -v 120 >/dev/null
iscsiadm -m node -T "$IQN" -p "$P" --login

D=$(session_disk)
# state: READ KEYS and READ RESERVATION as sg_persist prints them (the device line aside).
state() {
  { sg_persist -n -k "$D" && sg_persist -n -r "$D"; } 2>&1
}

step "capabilities"
sg_persist -n -c "$D" | tee /tmp/caps
grep -q "(PTPL_C): 1" /tmp/caps || fail "PTPL_C is not 1"
step "register with APTPL, change the key, reserve WRITE EXCLUSIVE, REGISTRANTS ONLY"
sg_persist -n --out --register --param-sark=0x1a2b3c --param-aptpl "$D" || fail "REGISTER"
# The same I_T nexus changes its key (a second nexus would need a second session), then
# reserves with it.
sg_persist -n --out --register --param-rk=0x1a2b3c --param-sark=0x4d5e6f --param-aptpl "$D" ||
  fail "REGISTER (change key)"
sg_persist -n --out --reserve --param-rk=0x4d5e6f --prout-type=5 "$D" || fail "RESERVE"
sg_persist -n -c "$D" | grep -q "(PTPL_A): 1" || fail "PTPL_A is not 1"
state | tee /tmp/before
grep -q "0x4d5e6f" /tmp/before || fail "the key is not listed"
grep -qi "write exclusive, registrants only" /tmp/before || fail "the reservation is not listed"
say registered
wait_for restarted

step "after the target's SIGKILL and restart"
# The first commands meet the reconnection (queued) and then a unit attention; sg_persist is
# retried until it reads the state again.
for i in $(seq 60); do
  state >/tmp/after && grep -q "0x" /tmp/after && break
  sleep 1
done
cat /tmp/after
diff /tmp/before /tmp/after || fail "the keys or the reservation changed across the restart"
# Still enforced: this nexus holds it, so its write goes through; the key it holds is the one.
dd if=/dev/zero of="$D" bs=4096 count=1 oflag=direct 2>/dev/null || fail "the holder's write failed"
sg_persist -n --out --release --param-rk=0x4d5e6f --prout-type=5 "$D" || fail "RELEASE"
sg_persist -n --out --register --param-rk=0x4d5e6f --param-sark=0 "$D" || fail "unregister"
say checked
wait_for logout
iscsiadm -m node -T "$IQN" -p "$P" --logout
