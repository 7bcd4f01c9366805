// Package wal is the file side of the volume journal: one append-only log
// file of checksummed frames in a locked directory. It knows bytes and
// frames, not what they hold: the caller (csihook's journal) encodes its
// batches of records as payloads, gives them to Append, takes them back
// from Replay at Open, and hands a snapshot of its live records to each
// compaction.
//
// The log is journal.log in the directory. Each append writes one frame
// holding a batch and, unless lazy, makes it durable with fdatasync
// before it returns:
//
//	magic "\xffCSJ" | length uint32 LE | CRC-32C uint32 LE | payload
//
// The CRC covers the magic, the length and the payload, so a frame is
// whole or it is not a frame: a batch is replayed entirely or not at all.
// The caller's payloads must never hold the byte 0xff (JSON never does),
// so the magic cannot occur inside a payload and a scan for it finds
// frame starts only.
//
// The file is kept longer than the log, zero-filled: an append then
// overwrites zeros, and its fdatasync has no file size to write, which on
// ext4 saves a journal commit. Zeros are where the log ends; a frame never
// starts with one.
package wal

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
)

const (
	// Name is the log's file name in its directory.
	Name = "journal.log"
	// Magic starts every frame.
	Magic = "\xffCSJ"
	// HeaderSize is the length of a frame's header: magic, length, CRC.
	HeaderSize = 12
	// MaxFrame bounds a frame's payload, so a damaged length field is
	// recognised as damage rather than read as a huge frame.
	MaxFrame = 64 << 20
	// DefaultCompactMin is the log size below which the log is never
	// compacted; above it, it is compacted once it is twice the size of
	// the live records.
	DefaultCompactMin = 1 << 20
	// preallocate is the step in which the file grows ahead of the log.
	preallocate = 256 << 10
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// EncodeFrame frames payload, at most MaxFrame bytes.
func EncodeFrame(payload []byte) ([]byte, error) {
	if len(payload) > MaxFrame {
		return nil, fmt.Errorf("journal batch of %d bytes is larger than the limit of %d", len(payload), MaxFrame)
	}
	return AppendFrame(make([]byte, 0, HeaderSize+len(payload)), payload), nil
}

// AppendFrame appends the frame of payload, at most MaxFrame bytes, to
// buf.
func AppendFrame(buf, payload []byte) []byte {
	start := len(buf)
	buf = append(buf, Magic...)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(payload)))
	sum := crc32.Update(crc32.Checksum(buf[start:start+8], castagnoli), castagnoli, payload)
	buf = binary.LittleEndian.AppendUint32(buf, sum)
	return append(buf, payload...)
}

// ReadFrame returns the payload of the frame at off and the offset after
// it, or ok false when no whole, intact frame starts at off.
func ReadFrame(data []byte, off int) (payload []byte, next int, ok bool) {
	if len(data)-off < HeaderSize || string(data[off:off+4]) != Magic {
		return nil, 0, false
	}
	n := binary.LittleEndian.Uint32(data[off+4:])
	if n > MaxFrame || uint64(n) > uint64(len(data)-off-HeaderSize) {
		return nil, 0, false
	}
	next = off + HeaderSize + int(n)
	payload = data[off+HeaderSize : next]
	sum := crc32.Update(crc32.Checksum(data[off:off+8], castagnoli), castagnoli, payload)
	if sum != binary.LittleEndian.Uint32(data[off+8:]) {
		return nil, 0, false
	}
	return payload, next, true
}

// nextFrame returns the offset of the first intact frame at or after
// off, or -1.
func nextFrame(data []byte, off int) int {
	for off < len(data) {
		i := bytes.Index(data[off:], []byte(Magic))
		if i < 0 {
			return -1
		}
		if _, _, ok := ReadFrame(data, off+i); ok {
			return off + i
		}
		off += i + 1
	}
	return -1
}

// Scan is what reading a log gave, besides its payloads.
type Scan struct {
	// End is the offset after the last intact frame.
	End int
	// Torn is how many bytes after End hold no intact frame: a batch a
	// crash interrupted (or damage at the very end, which cannot be told
	// apart from one).
	Torn int
	// Damaged counts bytes between intact frames that are not frames.
	Damaged int
}

// ScanFrames gives fn the payload and offset of each intact frame of
// data, in order. The log ends where only zeros follow. A damaged frame
// followed by intact ones is skipped and counted, not taken for the end
// of the log: the frames after it are newer. (A crash during one write of
// several batches can leave that too; those batches were never
// acknowledged, so keeping the intact ones is safe.)
func ScanFrames(data []byte, fn func(payload []byte, off int)) Scan {
	var s Scan
	off := 0
	for off < len(data) {
		payload, next, ok := ReadFrame(data, off)
		if !ok {
			if allZero(data[off:]) {
				break
			}
			resume := nextFrame(data, off+1)
			if resume < 0 {
				s.Torn = len(data) - off
				for s.Torn > 0 && data[off+s.Torn-1] == 0 {
					s.Torn--
				}
				break
			}
			s.Damaged += resume - off
			off = resume
			continue
		}
		start := off
		off, s.End = next, next
		fn(payload, start)
	}
	return s
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}
