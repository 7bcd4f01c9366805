package supervisor

import (
	"os"
	"testing"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/executor/wire"
)

// BenchmarkOpenStdioNull is what opening a task's stdio costs a start
// when Nomad's logs are disabled: stdin, stdout and stderr are all
// /dev/null, through a read-only clone of its mount.
//
//	go test -run '^$' -bench OpenStdioNull ./driver/executor/supervisor/
//
// It needs root.
func BenchmarkOpenStdioNull(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root: clones /dev/null's mount")
	}
	spec := &wire.Spec{StdoutPath: os.DevNull, StderrPath: os.DevNull}
	for i := 0; i < b.N; i++ {
		files, err := openStdio(spec)
		if err != nil {
			b.Fatal(err)
		}
		for _, f := range files {
			_ = f.Close()
		}
	}
}
