#!/usr/bin/env bash
# Builds, once per input, the Debian 12 guest image that make e2e-vm boots,
# and prints its directory (the last line of output):
#
#   disk.img     raw ext4 root file system (the guest boots it with qemu's
#                -snapshot: the cached file is never written)
#   vmlinuz      the guest's kernel, initrd.img its initramfs
#   kernel       the kernel's release (uname -r)
#   build.log    what debootstrap and apt printed
#
# The image is made from Debian's packages with debootstrap (minbase, systemd
# as PID 1) from the mirror the host's apt uses, and cached under
# $VM_CACHE (default ~/.cache/nomad-driver-csi, beside the cached Nomad
# agent) in a directory named after a hash of this script and its
# variant, so a fresh clone reuses it and an edit here rebuilds it.
#
# Variant (VM_KERNEL): "bookworm" (default) installs Debian 12's kernel;
# "bullseye" installs Debian 11's (5.10, the oldest Debian's archive
# offers) into the same Debian 12 system, so that only the kernel differs.
#
# Nothing in the image depends on the driver: what runs in the guest comes
# over a 9p share at boot (see run.sh), and the image's own unit,
# ncsi-guest.service, mounts it, runs its guest.sh and powers off.
#
# Needs root, debootstrap and mkfs.ext4 (make vm-deps installs them).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
suite=bookworm
kernel_suite=${VM_KERNEL:-bookworm}
case $kernel_suite in
bookworm | bullseye) ;;
*)
	echo "VM_KERNEL must be bookworm or bullseye, got \"$kernel_suite\"" >&2
	exit 2
	;;
esac
cache=${VM_CACHE:-$HOME/.cache/nomad-driver-csi}
# The disk's size: room for the tests' loop devices, logs and /tmp (the
# file is sparse; the guest's writes go to qemu's snapshot file).
disk_size=6G
packages=systemd,systemd-sysv,udev,util-linux,mount,e2fsprogs,iproute2,iptables,kmod,initramfs-tools,procps,dbus,docker-registry,busybox-static

# The key: everything that goes into the image (this script, the guest's
# runner and its unit, the variant).
key=$({ cat "${BASH_SOURCE[0]}" "$here/ncsi-guest" "$here/ncsi-guest.service"; echo "$suite $kernel_suite $packages $disk_size"; } | sha256sum | cut -c1-16)
dir=$cache/vm-$kernel_suite-$key

if [ -s "$dir/disk.img" ] && [ -s "$dir/vmlinuz" ] && [ -s "$dir/initrd.img" ]; then
	echo "guest image up to date: $dir" >&2
	echo "$dir"
	exit 0
fi

[ "$(id -u)" = 0 ] || { echo "building the guest image needs root (debootstrap)" >&2; exit 1; }
for cmd in debootstrap mkfs.ext4; do
	command -v "$cmd" >/dev/null || { echo "$cmd is missing: run make vm-deps" >&2; exit 1; }
done

# mirror prints the Debian archive the host's apt uses for its main suite
# (deb822 .sources files or one-line sources.list), or Debian's redirector.
mirror() {
	local f uri
	for f in /etc/apt/sources.list.d/*.sources; do
		[ -f "$f" ] || continue
		uri=$(awk '
			/^[[:space:]]*$/ { if (u != "" && s ~ /(^|[[:space:]])'"$suite"'([[:space:]]|$)/) { print u; exit } u = ""; s = ""; next }
			/^URIs:/ { u = $2 }
			/^Suites:/ { $1 = ""; s = $0 }
			END { if (u != "" && s ~ /(^|[[:space:]])'"$suite"'([[:space:]]|$)/) print u }' "$f" | head -1)
		[ -z "$uri" ] || { echo "$uri"; return; }
	done
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[ -f "$f" ] || continue
		uri=$(awk '$1 == "deb" { i = 2; if ($2 ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } if ($(i+1) == "'"$suite"'") { print $i; exit } }' "$f")
		[ -z "$uri" ] || { echo "$uri"; return; }
	done
	echo http://deb.debian.org/debian
}
url=${VM_MIRROR:-$(mirror)}

mkdir -p "$cache"
exec 9>"$cache/vm-image.lock"
flock 9
# Another run may have built it while this one waited.
if [ -s "$dir/disk.img" ] && [ -s "$dir/vmlinuz" ] && [ -s "$dir/initrd.img" ]; then
	echo "$dir"
	exit 0
fi

work=$(mktemp -d "$cache/.vm-build-XXXXXX")
rootfs=$work/rootfs
cleanup() {
	local m
	# Whatever is still mounted in the chroot, deepest first.
	for m in $(awk -v r="$rootfs" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log=$work/build.log
start=$(date +%s)
say() { echo "==> $* ($(($(date +%s) - start))s)" | tee -a "$log" >&2; }

say "debootstrap $suite from $url into $rootfs (a few minutes, once per image)"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$url" >>"$log" 2>&1; then
	tail -20 "$log" >&2
	exit 1
fi

say "installing the $kernel_suite kernel"
mount -t proc proc "$rootfs/proc"
mount -t sysfs sysfs "$rootfs/sys"
mount --bind /dev "$rootfs/dev"
if [ "$kernel_suite" != "$suite" ]; then
	echo "deb $url $kernel_suite main" >"$rootfs/etc/apt/sources.list.d/kernel.list"
fi
in_chroot() { chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive LC_ALL=C PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }
if ! {
	in_chroot apt-get -o Acquire::Check-Valid-Until=false -qq update &&
		in_chroot apt-get -o Acquire::Check-Valid-Until=false -y -qq --no-install-recommends install "linux-image-amd64/$kernel_suite"
} >>"$log" 2>&1; then
	tail -20 "$log" >&2
	exit 1
fi
rm -f "$rootfs/etc/apt/sources.list.d/kernel.list"
in_chroot apt-get clean >>"$log" 2>&1
umount "$rootfs/dev" "$rootfs/sys" "$rootfs/proc"

say "configuring the guest"
echo ncsi-vm >"$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 ncsi-vm\n::1 localhost ip6-localhost ip6-loopback\n' >"$rootfs/etc/hosts"
echo '/dev/vda / ext4 rw,errors=remount-ro 0 1' >"$rootfs/etc/fstab"
mkdir -p "$rootfs/etc/systemd/journald.conf.d"
printf '[Journal]\nStorage=volatile\n' >"$rootfs/etc/systemd/journald.conf.d/volatile.conf"
# No logins, no timers and no registry of its own (the image tests start
# theirs, docker-registry is installed for them): the guest runs one unit
# and powers off.
for u in getty@tty1.service serial-getty@ttyS0.service apt-daily.timer apt-daily-upgrade.timer \
	e2scrub_all.timer fstrim.timer systemd-tmpfiles-clean.timer docker-registry.service; do
	ln -sf /dev/null "$rootfs/etc/systemd/system/$u"
done
install -m 0755 "$here/ncsi-guest" "$rootfs/usr/local/sbin/ncsi-guest"
install -m 0644 "$here/ncsi-guest.service" "$rootfs/etc/systemd/system/ncsi-guest.service"
mkdir -p "$rootfs/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/ncsi-guest.service "$rootfs/etc/systemd/system/multi-user.target.wants/ncsi-guest.service"

release=$(basename "$(ls -d "$rootfs"/lib/modules/* | sort -V | tail -1)")
cp "$rootfs/boot/vmlinuz-$release" "$work/vmlinuz"
cp "$rootfs/boot/initrd.img-$release" "$work/initrd.img"
echo "$release" >"$work/kernel"

say "making the disk ($disk_size, ext4) from the root file system"
truncate -s "$disk_size" "$work/disk.img"
mkfs.ext4 -q -F -L ncsi-root -d "$rootfs" "$work/disk.img" >>"$log" 2>&1
rm -rf "$rootfs"
say "guest image built: kernel $release"
cp "$log" "$work/build.log.keep"
mkdir -p "$dir.tmp"
mv "$work/disk.img" "$work/vmlinuz" "$work/initrd.img" "$work/kernel" "$dir.tmp/"
mv "$work/build.log.keep" "$dir.tmp/build.log"
rm -rf "$dir"
mv "$dir.tmp" "$dir"
# Images of this variant made from other inputs are stale (a guest that
# still runs one keeps its open files).
for old in "$cache"/vm-"$kernel_suite"-*; do
	[ "$old" = "$dir" ] || rm -rf "$old"
done
echo "$dir"
