#!/bin/sh
# egressgate microvm guest init: PID 1 of the guest, run from the initramfs (busybox only).
#
# The host (runtimes/microvm/adapter.py) sends the run over the virtio-serial port `eg.in` as a tar that
# ends with the host closing the port: `config` (shell assignments, shlex-quoted by the host), `env`
# (`export K='V'` lines: exactly admission's environment), `argv` (`set -- ...`), and the files the sandbox
# sees read-only (ca.pem, resolv.conf, hosts, passwd, group). Nothing of it is on the kernel command line
# (the QEMU command line is world-readable on the host). The workload's stdio are the ports eg.stdin,
# eg.stdout, eg.stderr; its end is written to eg.status as one line (after a persistent workspace went back
# as a tar on eg.out), then the guest powers off.
#
# The sandbox the workload sees: the root image read-only (an overlay whose upper layer only holds the
# generated files, remounted read-only), a private tmpfs /tmp, the workspace image at its path, a minimal
# /dev (no block devices, no virtio ports), its own /proc; it runs as the run's uid with no capabilities,
# no_new_privs, in a cgroup with memory.max/pids.max, exactly the given environment.
export PATH=/bin
umask 022
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sys /sys
mount -t devtmpfs -o nosuid,noexec dev /dev
while read -r m; do insmod "/lib/modules/$m.ko" 2>/dev/null; done < /etc/modules

die() {
    echo "egressgate-init: $*" > /dev/kmsg
    [ -n "${STATUS:-}" ] && echo "setup-failed $*" > "$STATUS"
    reboot -f
    sleep 10
}

# the virtio ports appear asynchronously (the host announces them after the driver's probe); shell
# builtins only in this loop (every fork+exec costs milliseconds under TCG)
STATUS= IN= OUT= ERR= INP= EXP= i=0
while :; do
    for p in /sys/class/virtio-ports/*; do
        [ -r "$p/name" ] || continue
        read -r name < "$p/name" || continue
        case $name in
            eg.status) STATUS=/dev/${p##*/} ;; eg.in) IN=/dev/${p##*/} ;; eg.stdout) OUT=/dev/${p##*/} ;;
            eg.stderr) ERR=/dev/${p##*/} ;; eg.stdin) INP=/dev/${p##*/} ;; eg.out) EXP=/dev/${p##*/} ;;
        esac
    done
    [ -c "$STATUS" ] && [ -c "$IN" ] && [ -c "$OUT" ] && [ -c "$ERR" ] && [ -c "$INP" ] && [ -c "$EXP" ] && break
    i=$((i + 1)); [ $i -gt 3000 ] && die "virtio ports missing"
    usleep 2000
done

read -r cmdline < /proc/cmdline
case " $cmdline " in
    *" egressgate.probe=1 "*) echo "probe-ok" > "$STATUS"; reboot -f; sleep 10 ;;
esac

mkdir -p /run/eg
tar -x -C /run/eg -f - < "$IN" || die "cannot read the run from eg.in"
. /run/eg/config || die "bad config"

# the network: the guest holds the sandbox end of the /30; the host side routes it to the gateway only
echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6
echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6
ip link set lo up
ip link set eth0 up || die "no network device"
ip addr add "$EG_IP/$EG_PREFIX" dev eth0 || die "cannot set the address"
ip route add default via "$EG_GW" dev eth0 || die "cannot set the route"
hostname "$EG_HOSTNAME"

# the root: the image read-only under an overlay whose tmpfs upper layer gets the generated files
mkdir -p /mnt/lower /mnt/upper /newroot
mount -t ext4 -o ro,noload,nosuid,nodev /dev/vda /mnt/lower 2>/dev/null \
    || mount -o ro,nosuid,nodev /dev/vda /mnt/lower || die "cannot mount the root image"
mount -t tmpfs -o size=16m,mode=0755 upper /mnt/upper
mkdir -p /mnt/upper/u /mnt/upper/w
mount -t overlay -o "lowerdir=/mnt/lower,upperdir=/mnt/upper/u,workdir=/mnt/upper/w" overlay /newroot \
    || die "cannot mount the overlay root"
R=/newroot
mkdir -p "$R/etc/egressgate" "$R/tmp" "$R/proc" "$R/dev" "$R/sys" "$R/run"
rm -f "$R/etc/resolv.conf" "$R/etc/hosts" "$R/etc/passwd" "$R/etc/group"
cp /run/eg/resolv.conf /run/eg/hosts /run/eg/passwd /run/eg/group "$R/etc/"
cp /run/eg/ca.pem "$R/etc/egressgate/ca.pem"
chmod 0444 "$R/etc/resolv.conf" "$R/etc/hosts" "$R/etc/passwd" "$R/etc/group" "$R/etc/egressgate/ca.pem"
[ -n "$EG_WS" ] && mkdir -p "$R$EG_WS"
# sandbox.root_fs read_write: writes land in the tmpfs upper layer and die with the guest
[ -z "$EG_ROOT_RW" ] && { mount -o remount,ro "$R" || die "cannot make the root read-only"; }
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
mount -t tmpfs -o "size=$EG_TMP_BYTES,mode=1777,nosuid,nodev" tmp "$R/tmp"
mount -t tmpfs -o size=1m,mode=0755,nosuid,nodev run "$R/run"
mount -t tmpfs -o size=64k,mode=0755,nosuid,noexec dev "$R/dev"
for d in "null 1 3" "zero 1 5" "full 1 7" "random 1 8" "urandom 1 9" "tty 5 0"; do
    set -- $d; mknod -m 0666 "$R/dev/$1" c "$2" "$3"
done
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mkdir "$R/dev/shm" && mount -t tmpfs -o size=1m,mode=1777,nosuid,nodev shm "$R/dev/shm"
mount -o remount,ro "$R/dev"
if [ -n "$EG_WS" ]; then
    mount -t ext4 -o nosuid,nodev /dev/vdb "$R$EG_WS" || die "cannot mount the workspace image"
fi
# filesystem.deny: what exists of it in the guest is covered by an empty mode-000 file or directory
: > /run/eg/empty; chmod 000 /run/eg/empty
while read -r p; do
    [ -n "$p" ] || continue
    if [ -d "$R$p" ] && [ ! -L "$R$p" ]; then
        mount -t tmpfs -o size=4k,mode=000,ro,nosuid,nodev deny "$R$p" || die "cannot mask $p"
    elif [ -e "$R$p" ] || [ -L "$R$p" ]; then
        mount --bind /run/eg/empty "$R$p" && mount -o remount,bind,ro "$R$p" || die "cannot mask $p"
    fi
done < /run/eg/deny

# limits inside the guest: the workload's cgroup (the host bounds QEMU itself)
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 /sys/fs/cgroup || die "no cgroup2"
echo "+memory +pids" > /sys/fs/cgroup/cgroup.subtree_control || die "no memory/pids controllers"
W=/sys/fs/cgroup/workload
mkdir "$W"
[ -n "$EG_MEM_BYTES" ] && { echo "$EG_MEM_BYTES" > "$W/memory.max"; echo 1 > "$W/memory.oom.group"; }
echo 0 > "$W/memory.swap.max" 2>/dev/null
[ -n "$EG_PIDS_MAX" ] && echo "$EG_PIDS_MAX" > "$W/pids.max"

# the workload: its own cgroup, then no_new_privs, chroot, the run's uid/gid (no groups), its cwd and
# exactly the environment of `env` (the shell's own exported variables are unset first)
sh -c '
    echo 0 > /sys/fs/cgroup/workload/cgroup.procs || exit 120
    _eg_cwd=$1 _eg_uid=$2 _eg_gid=$3
    unset PWD OLDPWD SHLVL PATH HOME TERM
    . /run/eg/argv
    . /run/eg/env
    exec /bin/setpriv --nnp /bin/nsenter -r/newroot "-w/newroot$_eg_cwd" -S "$_eg_uid" -G "$_eg_gid" -F -- "$@"
' sh "$EG_CWD" "$EG_UID" "$EG_GID" < "$INP" > "$OUT" 2> "$ERR" &
wait $!
rc=$?
oom=0 pmax=0
while read -r k v; do [ "$k" = oom_kill ] && oom=$v; done < "$W/memory.events"
while read -r k v; do [ "$k" = max ] && pmax=$v; done < "$W/pids.events"
full=0
if [ -n "$EG_WS" ]; then
    avail=$(stat -f -c %a "$R$EG_WS")
    [ "$avail" -le 1 ] && full=1
fi
echo 1 > "$W/cgroup.kill"
# a persistent workspace goes back to the host as a tar on eg.out (the host never mounts the image)
[ -n "$EG_WS" ] && [ -n "$EG_WS_EXPORT" ] && tar -c -C "$R$EG_WS" -f - . > "$EXP" 2>/dev/null
echo "exit $rc oom $oom pids $pmax full $full" > "$STATUS"
[ -n "$EG_WS" ] && umount "$R$EG_WS"
sync
reboot -f
sleep 10
