package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
)

// The exit status file (ExitFile) is reserved when a task starts, and its
// supervisor writes the task's status into it in place when the task
// exits. A task may fill the file system that holds root_dir (its /local
// and /alloc/data are often on the same disk): the exit status must then
// still be recorded, and writing a file in place needs neither a new inode
// nor a new block, where a temporary file renamed over the target (how a
// status was written before, and how an older supervisor still writes it)
// needs both.
//
// The reserved file is ExitSlotSize bytes of spaces. The supervisor writes
// the status as JSON followed by a newline, padded with spaces to the same
// size, and syncs it. A reader sees the spaces (no status yet) or the
// whole status: the status fits in the first ExitRecordMax bytes, one
// sector, which storage writes whole, and the rest of the file does not
// change. JSON allows trailing whitespace, so the file is read as any JSON
// file is, and a status an older supervisor wrote the other way is read
// alike.
const (
	// ExitSlotSize is the size of the reserved exit status file: one
	// page, one block of the usual file systems.
	ExitSlotSize = 4096
	// ExitRecordMax bounds the status, newline included: one sector. A
	// longer Err is cut to fit.
	ExitRecordMax = 512
)

// ReserveExit makes the exit status file at path, ExitSlotSize bytes of
// spaces, mode 0600; an existing file is truncated first. It is written in
// place, not renamed into place: until its last byte it reads as no status
// all the same, and a start that fails to make it fails. It is not synced:
// the file systems the driver runs on (ext4, xfs, tmpfs) count a written
// block against the free space when it is written, not when it reaches the
// disk, so the space is the file's from here on; and a task does not
// outlive a crash of the host.
func ReserveExit(path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("failed to reserve the exit status file: %w", err)
	}
	_, err = f.Write(bytes.Repeat([]byte{' '}, ExitSlotSize))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("failed to reserve the exit status file %q: %w", path, err)
	}
	return nil
}

// WriteExit records st at path: in place, synced, when path is a reserved
// exit status file (ReserveExit); through a temporary file renamed over
// path (atomicfile.Write, synced) when it is not, or when the write in
// place failed (a copy-on-write file system needs new blocks even then).
func WriteExit(path string, st *ExitStatus) error {
	rec, err := encodeExit(st)
	if err != nil {
		return fmt.Errorf("failed to encode the exit status: %w", err)
	}
	werr := writeInPlace(path, rec)
	if werr == nil {
		return nil
	}
	if err := atomicfile.Write(path, rec, 0o600, true); err != nil {
		if errors.Is(werr, errNotReserved) {
			return err
		}
		return errors.Join(fmt.Errorf("failed to write %q in place: %w", path, werr), err)
	}
	return nil
}

// errNotReserved is writeInPlace's answer for a path that is not a
// reserved exit status file.
var errNotReserved = errors.New("not a reserved exit status file")

// writeInPlace writes rec over the reserved file at path, padded with
// spaces to its size, and syncs it.
func writeInPlace(path string, rec []byte) error {
	fd, err := unix.Open(path, unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) {
		return errNotReserved
	}
	if err != nil {
		return err
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != ExitSlotSize {
		return errNotReserved
	}
	buf := bytes.Repeat([]byte{' '}, ExitSlotSize)
	copy(buf, rec)
	if _, err := f.WriteAt(buf, 0); err != nil {
		return err
	}
	return f.Sync()
}

// encodeExit is st as JSON and a newline, at most ExitRecordMax bytes: an
// Err that does not fit is cut (at a rune), as little as it must be, and
// says so.
func encodeExit(st *ExitStatus) ([]byte, error) {
	b, err := encodeLine(st)
	if err != nil || len(b) <= ExitRecordMax {
		return b, err
	}
	const cut = " (cut)"
	c := *st
	msg := st.Err
	// The longest prefix of the message that fits: JSON may spend up to
	// six bytes on one byte of it.
	lo, hi := 0, len(msg)
	var best []byte
	for lo <= hi {
		mid := (lo + hi) / 2
		keep := mid
		for keep > 0 && keep < len(msg) && !utf8.RuneStart(msg[keep]) {
			keep--
		}
		c.Err = msg[:keep] + cut
		b, err := encodeLine(&c)
		if err != nil {
			return nil, err
		}
		if len(b) <= ExitRecordMax {
			best = b
			lo = mid + 1
		} else {
			hi = mid - 1
		}
	}
	if best == nil {
		return nil, fmt.Errorf("the exit status is %d bytes, more than the %d bytes it may take", len(b), ExitRecordMax)
	}
	return best, nil
}

func encodeLine(st *ExitStatus) ([]byte, error) {
	b, err := json.Marshal(st)
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// ReadExit reads the exit status at path. A reserved file that holds no
// status yet is fs.ErrNotExist, as a missing file is: the supervisor did
// not record one.
func ReadExit(path string) (*ExitStatus, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	if len(bytes.Trim(b, " \n\x00")) == 0 {
		return nil, fmt.Errorf("no exit status in %q: %w", path, fs.ErrNotExist)
	}
	// A file a crash of the host cut short may end in NUL bytes.
	b = bytes.TrimRight(b, "\x00")
	var st ExitStatus
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("failed to decode %q: %w", path, err)
	}
	return &st, nil
}
