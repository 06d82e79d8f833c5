# open-iscsi against a target behind an emulated NAT that also redirects its logins: discovery
# at the public address must give that address (the target's `advertise`), and the login there
# must follow the target's redirection to another portal (RFC 7143 11.13.5).
# Env: PUB_PORT (the NAT's public port, forwarded to the target's private portal),
# REDIRECT_PORT (the portal logins are redirected to), IQN.
P=$HOST_IP:$PUB_PORT
mkdir -p /run/lock/iscsi
modprobe sd_mod
iscsid
step "open-iscsi: $(iscsiadm --version)"

step "discovery through the NAT"
iscsiadm -m discovery -t sendtargets -p "$P" | tee /tmp/disc
grep -q "^$P,1 $IQN\$" /tmp/disc || fail "discovery did not give the advertised address $P for $IQN"
if grep -q "172\.31\.255\." /tmp/disc; then fail "discovery gave the private portal"; fi

step "login at the public address, redirected"
iscsiadm -m node -T "$IQN" -p "$P" --login
iscsiadm -m session -P 1 | tee /tmp/sess
grep -q "Current Portal: $HOST_IP:$REDIRECT_PORT" /tmp/sess ||
  fail "the session is not on the portal the login was redirected to ($HOST_IP:$REDIRECT_PORT)"
grep -q "Persistent Portal: $P" /tmp/sess || fail "the node's own portal is not $P"
DEV=
for i in $(seq 100); do
  DEV=$(iscsiadm -m session -P 3 2>/dev/null | awk '/Attached scsi disk/ {print $4; exit}')
  [ -n "$DEV" ] && [ -e "/dev/$DEV" ] && break
  sleep 0.1
done
[ -n "$DEV" ] && [ -e "/dev/$DEV" ] || fail "no disk attached to the session"
fio --name=redirected --filename="/dev/$DEV" --direct=1 --ioengine=libaio --iodepth=8 \
  --rw=randwrite --bs=4k --size=16M --verify=crc32c --verify_fatal=1 --verify_state_save=0 \
  --minimal >/tmp/fio || fail "fio 4k random write+verify on the redirected session"
echo "fio: verified (errors: $(cut -d';' -f5 /tmp/fio))"
iscsiadm -m node -T "$IQN" -p "$P" --logout
say "discovery done"
