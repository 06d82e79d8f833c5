# The Linux kernel's NBD client against `mcsi nbd` on the host. Env: PORT, EXPORT.
modprobe nbd nbds_max=2
step "nbd-client: $(nbd-client -V 2>&1 | head -n 1)"
nbd-client "$HOST_IP" "$PORT" /dev/nbd0 -N "$EXPORT" -C 2 || fail "nbd-client could not map the export"
echo "nbd0: $(blockdev --getsize64 /dev/nbd0) bytes, logical block $(blockdev --getss /dev/nbd0)"
step "ext4: mkfs, mount, files, sync, remount, check"
mkfs.ext4 -q /dev/nbd0
mkdir -p /mnt
mount /dev/nbd0 /mnt
head -c 24M /dev/urandom >/mnt/random.bin
cp -a /usr/lib/x86_64-linux-gnu /mnt/libs
(cd /mnt && find . -type f -exec sha256sum {} + >/tmp/sums)
sync
fstrim -v /mnt || true
umount /mnt
mount /dev/nbd0 /mnt
(cd /mnt && sha256sum -c --quiet /tmp/sums) || fail "files differ after remount"
echo "files: $(wc -l </tmp/sums) verified after remount"
umount /mnt
e2fsck -fn /dev/nbd0 || fail "e2fsck"
errs=$(kernel_errors)
[ -z "$errs" ] || fail "kernel I/O errors: $errs"
nbd-client -d /dev/nbd0
say all passed
