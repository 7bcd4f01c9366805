package image

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Info describes an image in the store.
type Info struct {
	Digest      string    `json:"digest"`
	IndexDigest string    `json:"index_digest,omitempty"`
	Refs        []string  `json:"refs"`
	Platform    string    `json:"platform,omitempty"`
	Layers      int       `json:"layers"`
	Size        int64     `json:"size"`
	PulledAt    time.Time `json:"pulled_at"`
	LastUsed    time.Time `json:"last_used"`
	// InUseBy are the leases of tasks that still exist.
	InUseBy []Use `json:"in_use_by"`
}

// Live says whether the task of a lease still exists (its lease holds).
type Live func(Use) bool

// List describes every image in the store, sorted by reference. It takes
// no lock: records and leases are written whole.
func (s *Store) List(live Live) ([]Info, error) {
	recs, err := s.records()
	if err != nil {
		return nil, err
	}
	uses, err := s.uses()
	if err != nil {
		return nil, err
	}
	out := make([]Info, 0, len(recs))
	for _, r := range recs {
		if !s.complete(r) {
			continue
		}
		out = append(out, s.info(r, uses, live))
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := firstRef(out[i]), firstRef(out[j])
		if a != b {
			return a < b
		}
		return out[i].Digest < out[j].Digest
	})
	return out, nil
}

func firstRef(i Info) string {
	if len(i.Refs) == 0 {
		return ""
	}
	return i.Refs[0]
}

func (s *Store) info(r *record, uses []Use, live Live) Info {
	i := Info{Digest: r.Digest, IndexDigest: r.IndexDigest, Refs: r.Refs, Platform: r.Platform, Layers: len(r.Layers),
		Size: r.size(), PulledAt: r.PulledAt, LastUsed: r.LastUsed, InUseBy: []Use{}}
	for _, u := range uses {
		if u.Digest == r.Digest && (live == nil || live(u)) {
			i.InUseBy = append(i.InUseBy, u)
		}
	}
	return i
}

// find picks the image a reference or digest names: a full digest (of the
// manifest or its index), a prefix of at least 12 hex digits, or a
// reference it was pulled by.
func (s *Store) find(recs []*record, what string) (*record, error) {
	h := strings.TrimPrefix(what, "sha256:")
	var hits []*record
	for _, r := range recs {
		switch {
		case slices.Contains(r.Refs, what),
			r.Digest == what || r.IndexDigest == what,
			len(h) >= 12 && isHex(h) && (strings.HasPrefix(hexOf(r.Digest), h)):
			hits = append(hits, r)
		}
	}
	switch len(hits) {
	case 0:
		return nil, errorf(ErrNotFound, "no image %q in the store; `images` lists them", what)
	case 1:
		return hits[0], nil
	}
	return nil, errorf(ErrInvalid, "%q names %d images; give the digest of one", what, len(hits))
}

func isHex(s string) bool {
	_, err := hex.DecodeString(s[:len(s)&^1])
	return err == nil
}

// Remove removes the image what names (see find), unless a task that still
// exists uses it, and the layers no other image has.
func (s *Store) Remove(ctx context.Context, what string, live Live) (Info, error) {
	unlock, err := s.lockStore(ctx, unix.LOCK_EX)
	if err != nil {
		return Info{}, fmt.Errorf("failed to lock the image store (a pull may be running): %w", err)
	}
	defer unlock()
	unlockMeta, err := s.lockMeta(ctx)
	if err != nil {
		return Info{}, err
	}
	defer unlockMeta()
	recs, err := s.records()
	if err != nil {
		return Info{}, err
	}
	r, err := s.find(recs, what)
	if err != nil {
		return Info{}, err
	}
	uses, err := s.uses()
	if err != nil {
		return Info{}, err
	}
	info := s.info(r, uses, live)
	if n := len(info.InUseBy); n > 0 {
		var ids []string
		for _, u := range info.InUseBy[:min(n, 3)] {
			ids = append(ids, u.TaskID)
		}
		return info, errorf(ErrInUse, "image %s is in use by %d task(s) (%s); stop them first", shortDigest(r.Digest), n, strings.Join(ids, ", "))
	}
	kept := slices.DeleteFunc(slices.Clone(recs), func(o *record) bool { return o.Digest == r.Digest })
	if err := s.removeImages([]*record{r}, kept); err != nil {
		return info, err
	}
	s.removeConfigs(kept)
	return info, nil
}

// removeConfigs removes the cached configurations no kept image has.
func (s *Store) removeConfigs(kept []*record) {
	keep := map[string]bool{}
	for _, r := range kept {
		keep[hexOf(r.ConfigDigest)] = true
	}
	entries, _ := os.ReadDir(filepath.Join(s.dir, "configs"))
	for _, e := range entries {
		// <hex>.json and its marks, <hex>.for-<key>.
		hex, _, _ := strings.Cut(e.Name(), ".")
		if !keep[hex] {
			_ = os.Remove(filepath.Join(s.dir, "configs", e.Name()))
		}
	}
}

// GC removes the images that no task has used for delay, and then the
// layers that no remaining image has. Leases of tasks that no longer
// exist are let go first (their images count as used until now). A pull
// or removal in progress makes it skip this round. It returns the digests
// removed.
func (s *Store) GC(delay time.Duration, live Live) ([]string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	unlock, err := s.lockStore(ctx, unix.LOCK_EX)
	if err != nil {
		return nil, nil
	}
	defer unlock()
	unlockMeta, err := s.lockMeta(context.Background())
	if err != nil {
		return nil, err
	}
	defer unlockMeta()
	// No pull runs: what tmp/ holds is what a killed one left.
	s.clearTmp()
	uses, err := s.uses()
	if err != nil {
		return nil, err
	}
	held := map[string]bool{}
	for _, u := range uses {
		if live != nil && !live(u) {
			if err := s.release(u.TaskID); err != nil {
				return nil, err
			}
			continue
		}
		held[u.Digest] = true
	}
	recs, err := s.records()
	if err != nil {
		return nil, err
	}
	now := s.now()
	var kept, victims []*record
	for _, r := range recs {
		if held[r.Digest] || now.Sub(r.LastUsed) < delay {
			kept = append(kept, r)
		} else {
			victims = append(victims, r)
		}
	}
	if err := s.removeImages(victims, kept); err != nil {
		return nil, err
	}
	// Layers no image names: a pull killed before it wrote its record
	// left them; the next pull may still use them, for delay.
	s.removeConfigs(kept)
	refd := referenced(kept)
	entries, _ := os.ReadDir(filepath.Join(s.dir, "layers"))
	for _, e := range entries {
		d := "sha256:" + e.Name()
		if refd[d] || !digestRE.MatchString(d) {
			continue
		}
		if fi, err := os.Stat(filepath.Join(s.dir, "layers", e.Name(), "layer.json")); err == nil && now.Sub(fi.ModTime()) < delay {
			continue
		}
		if err := s.removeLayer(d); err != nil {
			return nil, err
		}
	}
	var removed []string
	for _, v := range victims {
		removed = append(removed, v.Digest)
	}
	return removed, nil
}

func referenced(recs []*record) map[string]bool {
	m := map[string]bool{}
	for _, r := range recs {
		for _, l := range r.Layers {
			m[l.DiffID] = true
		}
	}
	return m
}

// removeImages removes the records of victims, then their layers that no
// kept image has. The caller holds store.lock exclusively.
func (s *Store) removeImages(victims, kept []*record) error {
	for _, v := range victims {
		if err := os.Remove(s.recordPath(v.Digest)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	if len(victims) == 0 {
		return nil
	}
	if err := syncDir(filepath.Join(s.dir, "manifests")); err != nil {
		return err
	}
	refd := referenced(kept)
	for _, v := range victims {
		for _, l := range v.Layers {
			if refd[l.DiffID] {
				continue
			}
			if err := s.removeLayer(l.DiffID); err != nil {
				return err
			}
			refd[l.DiffID] = true // removed once
		}
	}
	return nil
}

// removeLayer takes the layer's name away first (a rename), so that a
// removal cut short leaves nothing under layers/ that looks complete.
func (s *Store) removeLayer(diffID string) error {
	var b [8]byte
	_, _ = rand.Read(b[:])
	gone := filepath.Join(s.dir, "tmp", "gone-"+hex.EncodeToString(b[:]))
	if err := os.Rename(s.layerDir(diffID), gone); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("failed to remove layer %s: %w", shortDigest(diffID), err)
	}
	return os.RemoveAll(gone)
}

// clearTmp removes what pulls left in tmp/; the caller holds store.lock
// exclusively.
func (s *Store) clearTmp() {
	entries, _ := os.ReadDir(filepath.Join(s.dir, "tmp"))
	for _, e := range entries {
		_ = os.RemoveAll(filepath.Join(s.dir, "tmp", e.Name()))
	}
}
