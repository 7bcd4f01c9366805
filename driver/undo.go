package driver

// undo collects the clean-ups of a multi-step operation, such as a task's
// start: each step that leaves something behind pushes what takes it back,
// and a failure further on runs them all, the last step's first. Once the
// operation has succeeded, release keeps what it made.
//
//	var u undo
//	defer u.run()
//	... u.push(func() { ... }) after each step ...
//	u.release()
type undo struct{ steps []func() }

// push adds the clean-up of a step that succeeded.
func (u *undo) push(f func()) { u.steps = append(u.steps, f) }

// run runs the clean-ups in reverse order, each once; after release it
// does nothing.
func (u *undo) run() {
	steps := u.steps
	u.steps = nil
	for i := len(steps) - 1; i >= 0; i-- {
		steps[i]()
	}
}

// release keeps what the steps made: a later run does nothing.
func (u *undo) release() { u.steps = nil }
