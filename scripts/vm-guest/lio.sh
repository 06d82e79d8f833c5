# LIO (the kernel's target, configured with targetcli-fb) for mcsi's initiator on the host.
# Env: IQN, CHAP_USER, CHAP_SECRET. Answers the host's requests until it sends "done".
mkdir -p /etc/target /run/dbus
# targetcli asks the system bus about user-space backstores: start one (no service manager here).
dbus-daemon --system --fork
modprobe target_core_mod
modprobe iscsi_target_mod
mountpoint -q /sys/kernel/config || mount -t configfs none /sys/kernel/config
T=/iscsi/$IQN/tpg1
tcli() { targetcli "$@" >/tmp/tcli 2>&1 || { cat /tmp/tcli; fail "targetcli $*"; }; }
tcli /backstores/ramdisk create name=r0 size=256M
tcli /iscsi create "$IQN"
tcli "$T/luns" create /backstores/ramdisk/r0
# LIO takes a session's ErrorRecoveryLevel from its ACL's default_erl (the TPG parameter alone
# is overridden at login); demo-mode ACLs copy the TPG's attribute. ERL: 0 (LIO's default) or 2.
tcli "$T" set attribute authentication=0 generate_node_acls=1 demo_mode_write_protect=0 cache_dynamic_acls=1 default_erl="${ERL:-0}"
tcli "$T" set parameter MaxConnections=4
tcli "$T" set parameter ErrorRecoveryLevel="${ERL:-0}"
targetcli "$T" get parameter MaxConnections ErrorRecoveryLevel HeaderDigest DataDigest
step "LIO on $(ls /sys/kernel/config/target/iscsi/ | head -n 1)"
say ready
while true; do
  req=$(wait_host)
  case "$req" in
  chap)
    tcli "$T" set attribute authentication=1
    tcli "$T" set auth userid="$CHAP_USER" password="$CHAP_SECRET"
    say chap on
    ;;
  sessions)
    # Sessions of demo-mode (dynamic) ACLs are not in `targetcli sessions`; configfs lists
    # their initiators, and the sockets show the connections.
    sessions=$(grep -c . "/sys/kernel/config/target/iscsi/$IQN/tpgt_1/dynamic_sessions" || true)
    cat "/sys/kernel/config/target/iscsi/$IQN/tpgt_1/dynamic_sessions"
    ss -Htn state established '( sport = :3260 )' | tee /tmp/conns
    say "sessions shown: $sessions session(s), $(grep -c . /tmp/conns) connection(s)"
    ;;
  stall\ *)
    # One connection's packets vanish both ways, as on a route that died: the host's side
    # of that TCP connection hears nothing, without a reset.
    port=${req#stall }
    dev=$(ip -o route get 10.77.0.1 | sed -n 's/.* dev \([^ ]*\).*/\1/p')
    tc qdisc add dev "$dev" root handle 1: prio
    tc filter add dev "$dev" parent 1: protocol ip u32 match ip dport "$port" 0xffff action drop
    tc qdisc add dev "$dev" ingress
    tc filter add dev "$dev" parent ffff: protocol ip u32 match ip sport "$port" 0xffff action drop
    say "stalled $port on $dev"
    ;;
  unstall)
    tc qdisc del dev "$dev" root
    tc qdisc del dev "$dev" ingress
    say unstalled
    ;;
  done) break ;;
  *) fail "unknown request from the host: $req" ;;
  esac
done
dmesg | grep -iE 'iscsi|target' | tail -n 20 || true
say all passed
