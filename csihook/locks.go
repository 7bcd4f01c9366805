package csihook

import (
	"context"
	"sync"
)

// keyLocks serialises operations per key (one volume on this node) without
// a global lock: waiting on one key never delays another, and a waiter can
// give up when its context ends.
type keyLocks struct {
	mu    sync.Mutex
	locks map[string]*keyLock
}

type keyLock struct {
	ch   chan struct{}
	refs int
}

func newKeyLocks() *keyLocks { return &keyLocks{locks: map[string]*keyLock{}} }

// lock takes key's lock, or returns ctx's error if it ends first.
func (k *keyLocks) lock(ctx context.Context, key string) (func(), error) {
	l := k.ref(key)
	select {
	case l.ch <- struct{}{}:
		return k.unlocker(key, l), nil
	case <-ctx.Done():
		k.release(key, l)
		return nil, ctx.Err()
	}
}

// tryLock takes key's lock if nobody holds it, without waiting.
func (k *keyLocks) tryLock(key string) (func(), bool) {
	l := k.ref(key)
	select {
	case l.ch <- struct{}{}:
		return k.unlocker(key, l), true
	default:
		k.release(key, l)
		return nil, false
	}
}

// ref is key's lock, made if needed, with one more reference; release
// drops it.
func (k *keyLocks) ref(key string) *keyLock {
	k.mu.Lock()
	defer k.mu.Unlock()
	l, ok := k.locks[key]
	if !ok {
		l = &keyLock{ch: make(chan struct{}, 1)}
		k.locks[key] = l
	}
	l.refs++
	return l
}

// unlocker gives back the lock l of key, taken, and drops its reference.
func (k *keyLocks) unlocker(key string, l *keyLock) func() {
	return func() {
		<-l.ch
		k.release(key, l)
	}
}

func (k *keyLocks) release(key string, l *keyLock) {
	k.mu.Lock()
	defer k.mu.Unlock()
	l.refs--
	if l.refs == 0 {
		delete(k.locks, key)
	}
}
