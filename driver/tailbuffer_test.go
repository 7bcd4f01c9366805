package driver

import (
	"bytes"
	"math/rand/v2"
	"testing"

	"github.com/shoenig/test/must"
)

// Whatever the sizes of the writes, a tailBuffer holds the end of the
// stream, at most its size.
func TestTailBuffer(t *testing.T) {
	for _, size := range []int{1, 7, 64} {
		for _, chunks := range [][]int{nil, {3}, {7}, {64}, {1, 2, 3, 4, 5, 6}, {100}, {5, 70, 2}, {63, 1, 1, 63}} {
			b := newTailBuffer(size)
			var all []byte
			for _, c := range chunks {
				p := make([]byte, c)
				for i := range p {
					p[i] = byte(rand.IntN(256))
				}
				n, err := b.Write(p)
				must.NoError(t, err)
				must.Eq(t, c, n)
				all = append(all, p...)
			}
			want := all
			if len(want) > size {
				want = want[len(want)-size:]
			}
			must.True(t, bytes.Equal(want, b.Bytes()), must.Sprintf("size %d chunks %v", size, chunks))
			must.LessEq(t, size, cap(b.buf))
		}
	}
}
