package driver

// tailBuffer is an io.Writer that keeps the last n bytes written to it and
// drops the rest: the output ExecTask hands Nomad (a script check's) is
// bounded whatever the command writes, as Nomad's own executor bounds it
// (drivers.CheckBufSize, the end kept). It is used by one goroutine.
type tailBuffer struct {
	buf  []byte
	n    int
	full bool
	at   int // where the next byte goes, once full
}

func newTailBuffer(n int) *tailBuffer { return &tailBuffer{buf: make([]byte, 0, n), n: n} }

func (b *tailBuffer) Write(p []byte) (int, error) {
	written := len(p)
	if len(p) >= b.n {
		b.buf = append(b.buf[:0], p[len(p)-b.n:]...)
		b.full, b.at = true, 0
		return written, nil
	}
	if !b.full {
		room := b.n - len(b.buf)
		if len(p) <= room {
			b.buf = append(b.buf, p...)
			b.full = len(b.buf) == b.n
			return written, nil
		}
		b.buf = append(b.buf, p[:room]...)
		p = p[room:]
		b.full = true
	}
	for len(p) > 0 {
		c := copy(b.buf[b.at:], p)
		p = p[c:]
		b.at = (b.at + c) % b.n
	}
	return written, nil
}

// Bytes returns what is kept, oldest first.
func (b *tailBuffer) Bytes() []byte {
	if !b.full || b.at == 0 {
		return b.buf
	}
	out := make([]byte, 0, b.n)
	return append(append(out, b.buf[b.at:]...), b.buf[:b.at]...)
}
