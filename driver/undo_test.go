package driver

import (
	"testing"

	"github.com/shoenig/test/must"
)

func TestUndo(t *testing.T) {
	cases := []struct {
		name    string
		steps   int
		release bool
		want    []int
	}{
		{name: "nothing pushed", steps: 0, want: nil},
		{name: "failure runs every step, last first", steps: 3, want: []int{2, 1, 0}},
		{name: "success keeps everything", steps: 3, release: true, want: nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var ran []int
			func() {
				var u undo
				defer u.run()
				for i := range tc.steps {
					u.push(func() { ran = append(ran, i) })
				}
				if tc.release {
					u.release()
				}
			}()
			must.Eq(t, tc.want, ran)
		})
	}
}

// A second run (a deferred one after an explicit one) does not undo twice.
func TestUndo_RunsOnce(t *testing.T) {
	var n int
	var u undo
	u.push(func() { n++ })
	u.run()
	u.run()
	must.Eq(t, 1, n)
}
