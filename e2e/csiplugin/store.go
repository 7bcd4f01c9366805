package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

const (
	typeDir  = "dir"
	typeExt4 = "ext4"
)

// volume is what the fixture remembers about one volume. It is written to
// <state-dir>/meta/<id>.json after every change, so a restarted fixture
// knows what it staged and published.
type volume struct {
	ID       string `json:"id"`
	Name     string `json:"name"`
	Type     string `json:"type"`
	Capacity int64  `json:"capacity_bytes"`
	// Published maps a node ID to the readonly flag it was
	// ControllerPublished with.
	Published map[string]bool `json:"published,omitempty"`
	// Staged and Targets are keyed by staging and target path.
	Staged  map[string]mountRecord `json:"staged,omitempty"`
	Targets map[string]mountRecord `json:"targets,omitempty"`
	// Loop is the loop device an ext4 volume is attached to while staged.
	Loop string `json:"loop,omitempty"`
}

// mountRecord says how a volume was staged or published at one path.
type mountRecord struct {
	Block    bool     `json:"block,omitempty"`
	ReadOnly bool     `json:"read_only,omitempty"`
	Flags    []string `json:"flags,omitempty"`
	Mode     string   `json:"access_mode,omitempty"`
	Staging  string   `json:"staging,omitempty"`
}

// bits returns the MS_* flags and filesystem data to mount with.
func (a mountRecord) bits() (uintptr, []string) {
	bits, data := parseMountFlags(a.Flags)
	if a.ReadOnly {
		bits |= unix.MS_RDONLY
	}
	return bits, data
}

func (a mountRecord) same(b mountRecord) bool {
	return a.Block == b.Block && a.ReadOnly == b.ReadOnly && a.Mode == b.Mode &&
		a.Staging == b.Staging && strings.Join(a.Flags, ",") == strings.Join(b.Flags, ",")
}

// store keeps the volumes in memory and on disk. Callers serialise work on
// one volume with lock(id); get returns a copy that they change and save.
type store struct {
	dir string

	mu    sync.Mutex
	vols  map[string]*volume
	locks map[string]*sync.Mutex
}

func openStore(dir string) (*store, error) {
	s := &store{dir: dir, vols: map[string]*volume{}, locks: map[string]*sync.Mutex{}}
	for _, d := range []string{s.metaDir(), s.dataDir()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("failed to create state directory %q: %w", d, err)
		}
	}
	files, err := filepath.Glob(filepath.Join(s.metaDir(), "*.json"))
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("failed to read volume record %q: %w", f, err)
		}
		var v volume
		if err := json.Unmarshal(b, &v); err != nil {
			return nil, fmt.Errorf("failed to decode volume record %q: %w", f, err)
		}
		s.vols[v.ID] = &v
	}
	return s, nil
}

func (s *store) metaDir() string { return filepath.Join(s.dir, "meta") }
func (s *store) dataDir() string { return filepath.Join(s.dir, "volumes") }

// dataPath is the volume's directory (dir) or image file (ext4).
func (s *store) dataPath(v *volume) string {
	if v.Type == typeExt4 {
		return filepath.Join(s.dataDir(), v.ID+".img")
	}
	return filepath.Join(s.dataDir(), v.ID)
}

// lock serialises operations on one key (a volume ID, or "name/"+name for
// CreateVolume); operations on other volumes go on.
func (s *store) lock(key string) func() {
	s.mu.Lock()
	l, ok := s.locks[key]
	if !ok {
		l = &sync.Mutex{}
		s.locks[key] = l
	}
	s.mu.Unlock()
	l.Lock()
	return l.Unlock
}

func (s *store) get(id string) (*volume, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.vols[id]
	if !ok {
		return nil, false
	}
	return clone(v), true
}

func (s *store) byName(name string) (*volume, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.vols {
		if v.Name == name {
			return clone(v), true
		}
	}
	return nil, false
}

// list returns copies of all volumes, sorted by ID.
func (s *store) list() []*volume {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*volume, 0, len(s.vols))
	for _, v := range s.vols {
		out = append(out, clone(v))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// save writes the record atomically (temp file, fsync, rename) and then
// makes it the in-memory truth.
func (s *store) save(v *volume) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	final := filepath.Join(s.metaDir(), v.ID+".json")
	tmp, err := os.CreateTemp(s.metaDir(), v.ID+".*.tmp")
	if err != nil {
		return fmt.Errorf("failed to save volume %q: %w", v.ID, err)
	}
	defer os.Remove(tmp.Name())
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), final)
	}
	if err != nil {
		return fmt.Errorf("failed to save volume %q: %w", v.ID, err)
	}
	s.mu.Lock()
	s.vols[v.ID] = clone(v)
	s.mu.Unlock()
	return nil
}

func (s *store) remove(id string) error {
	err := os.Remove(filepath.Join(s.metaDir(), id+".json"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("failed to remove the record of volume %q: %w", id, err)
	}
	s.mu.Lock()
	delete(s.vols, id)
	s.mu.Unlock()
	return nil
}

func clone(v *volume) *volume {
	b, _ := json.Marshal(v)
	var c volume
	_ = json.Unmarshal(b, &c)
	if c.Published == nil {
		c.Published = map[string]bool{}
	}
	if c.Staged == nil {
		c.Staged = map[string]mountRecord{}
	}
	if c.Targets == nil {
		c.Targets = map[string]mountRecord{}
	}
	return &c
}

func newVolumeID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "vol-" + hex.EncodeToString(b)
}
