package image

import (
	"context"
	"crypto/hmac"
	crand "crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/hashicorp/go-hclog"
	"golang.org/x/sync/semaphore"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
)

// The store lives in <root_dir>/images:
//
//	store.lock            shared by pulls and leases, exclusive for GC and removal
//	meta.lock             serialises changes to records and leases
//	manifests/<hex>.json  one record per image (manifest digest): refs, config, layers
//	layers/<hex>/fs       a layer unpacked (hex of its diff id), an overlay lower dir
//	layers/<hex>/layer.json
//	configs/<hex>.json    image configurations, verified, by digest
//	configs/<hex>.for-<k> marks: fetched from its source for credentials k
//	uses/<key>.json       a task's lease on an image
//	tmp/                  layers being unpacked, and their lock files
//
// A layer directory is complete once it has its name under layers/: it is
// unpacked under tmp/, its digests verified, the file system synced, and
// only then renamed. An image is complete once its record is written, after
// its layers. Nothing under tmp/ is ever used: a killed pull leaves only
// that, and the next pull of the layer (or GC) removes it.

// Options configure a store (the plugin options of the same names).
type Options struct {
	// RegistryCAFile adds CA certificates (PEM) to the system's roots.
	RegistryCAFile string
	// InsecureRegistries are host[:port] spoken to over plain HTTP.
	InsecureRegistries []string
	// AuthConfigFile is a docker-style config.json; AuthHelper names a
	// docker-credential-<helper> program (the plugin's auth block).
	AuthConfigFile string
	AuthHelper     string
	// LocalDirs are the directories local references may name files in.
	LocalDirs []string
	// MaxLayers and MaxSize bound one image: its layer count, and the
	// bytes of its layers, as served and as unpacked.
	MaxLayers int
	MaxSize   int64
	// Platform is the node's (runtime's when zero).
	Platform v1.Platform
	Logger   hclog.Logger
}

// Defaults of the bounds.
const (
	DefaultMaxLayers = 128
	DefaultMaxSize   = 20 << 30
)

// Use is a task's lease on an image: while it is held the image and its
// layers stay.
type Use struct {
	TaskID    string    `json:"task_id"`
	AllocID   string    `json:"alloc_id,omitempty"`
	TaskName  string    `json:"task_name,omitempty"`
	Namespace string    `json:"namespace,omitempty"`
	JobID     string    `json:"job_id,omitempty"`
	Digest    string    `json:"digest"`
	Since     time.Time `json:"since"`
}

// PullRequest is what a pull takes beside the reference.
type PullRequest struct {
	// Auth is the task's auth block (nil: the plugin's, or none).
	Auth *Credentials
	// Progress hears how far the download is, a few times a second at
	// most; Notify hears what a user should read (retries, fallbacks).
	Progress func(Progress)
	Notify   func(string)
	// Use, when set, is the lease taken on the image before the pull lets
	// go of the store, so that GC cannot take it in between.
	Use *Use
	// ForcePull asks the registry what a tag names even when the store
	// has the image an earlier pull of the tag found (see Pull).
	ForcePull bool
}

// Progress is a pull's download so far.
type Progress struct {
	Ref string
	// Done and Total are bytes of the layers to download (those the store
	// lacks).
	Done, Total int64
	// Present says the image was in the store: nothing to download.
	Present bool
}

// Store is the content-addressed image store of one root_dir.
type Store struct {
	dir    string
	opts   Options
	logger hclog.Logger
	// transport is the template of each pull's own (pullTransport).
	transport *http.Transport

	mu      sync.Mutex
	flights map[string]*flight

	// retryBase and attempts shape the backoff of registry calls; now is
	// the clock. Tests change them.
	retryBase time.Duration
	attempts  int
	now       func() time.Time
	// maxEntries bounds the entries of one image (MaxEntries).
	maxEntries int64
	// secret keys the hashes of credentials in records (authKey).
	secret []byte
	// zstdWindows is what zstd decoders with windows over
	// zstdFreeWindow may take together (zstdWindowBudget).
	zstdWindows *semaphore.Weighted
}

// Dir is the store's directory under a root_dir.
func Dir(rootDir string) string { return filepath.Join(rootDir, "images") }

// Open opens (creating it when needed) the store under rootDir.
func Open(rootDir string, opts Options) (*Store, error) {
	if opts.MaxLayers <= 0 {
		opts.MaxLayers = DefaultMaxLayers
	}
	if opts.MaxSize <= 0 {
		opts.MaxSize = DefaultMaxSize
	}
	if opts.Platform.OS == "" {
		opts.Platform = NodePlatform()
	}
	if opts.Logger == nil {
		opts.Logger = hclog.NewNullLogger()
	}
	t, err := newBaseTransport(opts)
	if err != nil {
		return nil, err
	}
	s := &Store{dir: Dir(rootDir), opts: opts, logger: opts.Logger, transport: t, flights: map[string]*flight{},
		retryBase: time.Second, attempts: 5, now: time.Now, maxEntries: MaxEntries,
		zstdWindows: semaphore.NewWeighted(zstdWindowBudget)}
	if err := os.MkdirAll(rootDir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create the image store in %q: %w", s.dir, err)
	}
	// images/ is root's alone: setuid files and device nodes of layers
	// must not be reachable by anyone else on the host.
	if err := os.Mkdir(s.dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("failed to create the image store in %q: %w", s.dir, err)
	}
	if err := os.Chmod(s.dir, 0o700); err != nil {
		return nil, err
	}
	for _, d := range []string{"manifests", "layers", "configs", "uses", "tmp"} {
		if err := os.MkdirAll(filepath.Join(s.dir, d), 0o700); err != nil {
			return nil, fmt.Errorf("failed to create the image store in %q: %w", s.dir, err)
		}
	}
	if s.secret, err = loadSecret(s.dir); err != nil {
		return nil, fmt.Errorf("failed to open the image store in %q: %w", s.dir, err)
	}
	return s, nil
}

// Path is the store's directory.
func (s *Store) Path() string { return s.dir }

// record is an image in the store: manifests/<hex>.json.
type record struct {
	Digest       string   `json:"digest"`
	IndexDigest  string   `json:"index_digest,omitempty"`
	ConfigDigest string   `json:"config_digest,omitempty"`
	Refs         []string `json:"refs"`
	Config       Config   `json:"config"`
	// StopSignalKnown says Config.StopSignal is the configuration's (""
	// for none). A record written before stop signals were kept lacks it:
	// the configuration kept beside it is read once, under meta.lock, and
	// the record written back with it (see knowConfig).
	StopSignalKnown bool   `json:"stop_signal_known,omitempty"`
	Platform        string `json:"platform,omitempty"`
	// PlatformKnown says Platform is the configuration's ("" for one
	// that names none). A record an earlier build wrote without it, and
	// without a platform, learns it as it learns its stop signal.
	PlatformKnown bool          `json:"platform_known,omitempty"`
	Layers        []layerRecord `json:"layers"`
	PulledAt      time.Time     `json:"pulled_at"`
	LastUsed      time.Time     `json:"last_used"`
	// AuthKeys are the credentials its registry served it to (authKey:
	// "" for none of the task's): the store serves it without asking the
	// registry (by digest, by a tag it resolved to, or while the registry
	// is unreachable) to those alone.
	AuthKeys []string `json:"auth_keys,omitempty"`
	// Resolved is when each of Refs last resolved to this image at its
	// source: a tag names the image it resolved to last, among those its
	// credentials may be served.
	Resolved map[string]time.Time `json:"resolved,omitempty"`
}

// maxRefs bounds the references a record keeps: tags first, newest first,
// then references by digest (which the store finds without them), so that
// a job naming one image by many digests cannot push its tags out.
const maxRefs = 16

// addRef puts ref first in r's references.
func (r *record) addRef(ref string) {
	r.Refs = append([]string{ref}, slices.DeleteFunc(r.Refs, func(x string) bool { return x == ref })...)
}

// trimRefs keeps maxRefs references, tags before digests (each in their
// order), and the resolution times of those kept.
func (r *record) trimRefs() {
	if len(r.Refs) > maxRefs {
		var tags, digests []string
		for _, ref := range r.Refs {
			if strings.Contains(ref, "@") {
				digests = append(digests, ref)
			} else {
				tags = append(tags, ref)
			}
		}
		r.Refs = append(tags, digests...)[:maxRefs]
	}
	for ref := range r.Resolved {
		if !slices.Contains(r.Refs, ref) {
			delete(r.Resolved, ref)
		}
	}
}

// noteResolved records that ref resolved to r at at, unless a later
// resolution is recorded.
func (r *record) noteResolved(ref string, at time.Time) {
	if !at.After(r.Resolved[ref]) {
		return
	}
	if r.Resolved == nil {
		r.Resolved = map[string]time.Time{}
	}
	r.Resolved[ref] = at
}

// resolvedAt is when ref last resolved to r (zero: before the store kept
// it, or never).
func (r *record) resolvedAt(ref string) time.Time { return r.Resolved[ref] }

// maxAuthKeys bounds the credentials a record remembers, newest first.
const maxAuthKeys = 32

// allows says whether the store may serve r, without its registry, to a
// pull with credentials key.
func (r *record) allows(key string) bool { return slices.Contains(r.AuthKeys, key) }

func (r *record) addAuthKey(key string) {
	r.AuthKeys = append([]string{key}, slices.DeleteFunc(r.AuthKeys, func(k string) bool { return k == key })...)
	if len(r.AuthKeys) > maxAuthKeys {
		r.AuthKeys = r.AuthKeys[:maxAuthKeys]
	}
}

type layerRecord struct {
	DiffID string `json:"diff_id"`
	Digest string `json:"digest"`
	// Size is the bytes of its files unpacked; Compressed as served.
	Size       int64 `json:"size"`
	Compressed int64 `json:"compressed"`
}

func (r *record) size() int64 {
	var n int64
	for _, l := range r.Layers {
		n += l.Size
	}
	return n
}

func hexOf(digest string) string {
	_, h, _ := strings.Cut(digest, ":")
	return h
}

func (s *Store) recordPath(digest string) string {
	return filepath.Join(s.dir, "manifests", hexOf(digest)+".json")
}

// storedConfig is the configuration the store keeps under digest
// (configs/<hex>.json), nil when it keeps none that matches the digest. A
// copy that does not (damaged on disk, or over maxConfigSize, of which no
// more is read) is taken away, once, and said: it is a cache, which no
// task uses, and the next pull that asks the image's source fetches it
// again, rather than every pull reading it in vain.
func (s *Store) storedConfig(digest string) []byte {
	p := s.configPath(digest)
	f, err := os.Open(p)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxConfigSize+1))
	if err != nil {
		return nil
	}
	if len(b) <= maxConfigSize && digestOf(b) == digest {
		return b
	}
	// Only the copy read: one a pull has put there since stays.
	if read, err := f.Stat(); err == nil {
		if now, err := os.Lstat(p); err == nil && os.SameFile(read, now) && os.Remove(p) == nil {
			s.logger.Warn("removed a damaged image configuration from the store; the next pull of its image fetches it again",
				"digest", digest, "path", p)
		}
	}
	return nil
}

// storedConfigFile is the configuration the store keeps under digest,
// decoded; nil when it keeps none, or none that matches its digest and
// decodes (storedConfig takes a damaged copy away).
func (s *Store) storedConfigFile(digest string) *v1.ConfigFile {
	b := s.storedConfig(digest)
	if b == nil {
		return nil
	}
	var cfg v1.ConfigFile
	if json.Unmarshal(b, &cfg) != nil {
		return nil
	}
	return &cfg
}

// knowConfig fills in what r lacks of the configuration kept beside it,
// when an earlier build wrote it: its stop signal (before they were kept)
// and its platform (one without), and says whether it did: the caller,
// holding meta.lock, writes r back, so the configuration (up to
// maxConfigSize) is read once, not at every pull or lookup. A
// configuration the store lacks or that fails its digest (storedConfig
// takes it away) leaves r as it is: its stop signal stays unknown, and
// the image stops with its task's kill_signal or SIGINT, until a pull
// that asks its source fetches the configuration again (pull); its
// platform stays unknown, and the image runs, as that build served it.
func (s *Store) knowConfig(r *record) bool {
	if r.StopSignalKnown && (r.PlatformKnown || r.Platform != "") || r.ConfigDigest == "" {
		return false
	}
	cfg := s.storedConfigFile(r.ConfigDigest)
	if cfg == nil {
		return false
	}
	if !r.StopSignalKnown {
		r.Config.StopSignal, r.StopSignalKnown = cfg.Config.StopSignal, true
	}
	if !r.PlatformKnown && r.Platform == "" {
		r.Platform, r.PlatformKnown = platformString(configPlatform(cfg, s.opts.Platform)), true
	}
	return true
}

func (s *Store) configPath(digest string) string {
	return filepath.Join(s.dir, "configs", hexOf(digest)+".json")
}

func (s *Store) layerDir(diffID string) string { return filepath.Join(s.dir, "layers", hexOf(diffID)) }

// LayerPath is the unpacked tree of a layer, an overlay lower directory.
func (s *Store) LayerPath(diffID string) string { return filepath.Join(s.layerDir(diffID), "fs") }

func (s *Store) image(r *record, ref string) *Image {
	img := &Image{Ref: ref, Digest: r.Digest, IndexDigest: r.IndexDigest, Config: r.Config}
	for _, l := range r.Layers {
		img.Layers = append(img.Layers, s.LayerPath(l.DiffID))
	}
	return img
}

func (s *Store) readRecord(digest string) (*record, error) {
	b, err := os.ReadFile(s.recordPath(digest))
	if err != nil {
		return nil, err
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("image record %s is damaged: %w", digest, err)
	}
	return &r, nil
}

func (s *Store) records() ([]*record, error) {
	entries, err := os.ReadDir(filepath.Join(s.dir, "manifests"))
	if err != nil {
		return nil, err
	}
	var out []*record
	for _, e := range entries {
		h, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !digestRE.MatchString("sha256:"+h) {
			continue
		}
		r, err := s.readRecord("sha256:" + h)
		if err != nil {
			s.logger.Warn("skipping a damaged image record", "digest", "sha256:"+h, "error", err)
			continue
		}
		out = append(out, r)
	}
	return out, nil
}

// runsHere says whether r's image is built for the node's platform as it
// is now: a node's x86-64 level can drop under a store pulled before (a
// virtual machine moved to an older host, a kernel that no longer saves
// AVX registers), and an image of a higher level would die of SIGILL. A
// record that names no platform runs, unless the configuration kept
// beside it names one the node does not run: an earlier build recorded no
// platform for a configuration with an architecture or level but no os,
// which it did not check. One whose platform is not as the store writes it
// (damaged, or written by hand) does not: its image is fetched again, and
// its record rewritten.
func (s *Store) runsHere(r *record) bool { return s.fit(r) >= 0 }

// fit is how well r's image fits the node (platformRank), -1 when it does
// not run here (runsHere); one that names no platform and runs fits as
// well as the node's own.
func (s *Store) fit(r *record) int {
	if r.Platform == "" {
		if r.PlatformKnown || s.configRunsHere(r.ConfigDigest) {
			return 10
		}
		return -1
	}
	p, ok := parseRecordPlatform(r.Platform)
	if !ok {
		return -1
	}
	return platformRank(&p, s.opts.Platform)
}

// configRunsHere says whether the image of the configuration the store
// keeps under digest runs on the node, as fetchConfig checks it; true when
// the store keeps none that matches its digest and decodes (nothing is
// known against it, as an earlier build served it).
func (s *Store) configRunsHere(digest string) bool {
	if digest == "" {
		return true
	}
	cfg := s.storedConfigFile(digest)
	if cfg == nil {
		return true
	}
	p := configPlatform(cfg, s.opts.Platform)
	return p == nil || platformMatches(p, s.opts.Platform)
}

// parseRecordPlatform reads a record's platform as platformString wrote
// it, normalised: os/architecture[/variant], each part of lower-case
// letters, digits, '.', '_' or '-'. go-containerregistry's ParsePlatform
// is not used: it reads "linux:10/amd64" as an os version, which the
// store never writes.
func parseRecordPlatform(s string) (v1.Platform, bool) {
	parts := strings.Split(s, "/")
	if len(parts) < 2 || len(parts) > 3 {
		return v1.Platform{}, false
	}
	for _, part := range parts {
		if part == "" || strings.Trim(part, "abcdefghijklmnopqrstuvwxyz0123456789._-") != "" {
			return v1.Platform{}, false
		}
	}
	p := v1.Platform{OS: parts[0], Architecture: parts[1]}
	if len(parts) == 3 {
		p.Variant = parts[2]
	}
	n := normalPlatform(p)
	return p, platformString(&n) == s
}

// servable says whether the store may give r to a pull without fetching
// it: every lookup that finds an image to run asks this (or servableFit),
// never complete alone, so that none forgets the platform. complete alone
// is for what does not run the image (GC, the image list) or was just
// found servable.
func (s *Store) servable(r *record) bool { return s.servableFit(r) >= 0 }

// servableFit is how well r fits the node (fit) when it is servable, -1
// when it is not.
func (s *Store) servableFit(r *record) int {
	if !s.complete(r) {
		return -1
	}
	return s.fit(r)
}

// complete says whether every layer of r is in the store.
func (s *Store) complete(r *record) bool {
	for _, l := range r.Layers {
		if _, err := os.Stat(filepath.Join(s.layerDir(l.DiffID), "layer.json")); err != nil {
			return false
		}
	}
	return true
}

// writeRecord writes r, merging the refs of a record already there; the
// caller holds meta.lock.
func (s *Store) writeRecord(r *record) error {
	if old, err := s.readRecord(r.Digest); err == nil {
		for _, ref := range old.Refs {
			if !slices.Contains(r.Refs, ref) {
				r.Refs = append(r.Refs, ref)
			}
		}
		if !old.PulledAt.IsZero() && old.PulledAt.Before(r.PulledAt) {
			r.PulledAt = old.PulledAt
		}
		for _, k := range old.AuthKeys {
			if !slices.Contains(r.AuthKeys, k) && len(r.AuthKeys) < maxAuthKeys {
				r.AuthKeys = append(r.AuthKeys, k)
			}
		}
		for ref, at := range old.Resolved {
			r.noteResolved(ref, at)
		}
	}
	r.trimRefs()
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.Write(s.recordPath(r.Digest), b, 0o600, true); err != nil {
		return err
	}
	return syncDir(filepath.Join(s.dir, "manifests"))
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// lockFile takes a flock on path (created if needed): shared or exclusive,
// waiting until ctx is done. flock(2) locks belong to the open file, so two
// goroutines of one process exclude each other as two processes do.
func lockFile(ctx context.Context, path string, how int) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	for {
		err := unix.Flock(int(f.Fd()), how|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("failed to lock %q: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (s *Store) lockMeta(ctx context.Context) (func(), error) {
	return lockFile(ctx, filepath.Join(s.dir, "meta.lock"), unix.LOCK_EX)
}

func (s *Store) lockStore(ctx context.Context, how int) (func(), error) {
	return lockFile(ctx, filepath.Join(s.dir, "store.lock"), how)
}

// flight is one pull that every concurrent Pull of the same reference
// (with the same credentials) waits for.
type flight struct {
	// ctx is the pull's; it is canceled when every waiter has left.
	ctx    context.Context
	done   chan struct{}
	cancel context.CancelFunc
	img    *record
	err    error

	mu      sync.Mutex
	waiters []*PullRequest
	leased  map[*PullRequest]bool
}

func (f *flight) each(fn func(*PullRequest)) {
	f.mu.Lock()
	ws := slices.Clone(f.waiters)
	f.mu.Unlock()
	for _, w := range ws {
		fn(w)
	}
}

func (f *flight) notify(msg string) {
	f.each(func(w *PullRequest) {
		if w.Notify != nil {
			w.Notify(msg)
		}
	})
}

func (f *flight) progress(p Progress) {
	f.each(func(w *PullRequest) {
		if w.Progress != nil {
			w.Progress(p)
		}
	})
}

func (f *flight) leave(req *PullRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.waiters = slices.DeleteFunc(f.waiters, func(w *PullRequest) bool { return w == req })
	if len(f.waiters) == 0 {
		f.cancel()
	}
}

// Pull makes the image ref names present in the store and returns it. A
// reference by digest that the store has is not fetched again, nor is a
// registry's tag other than "latest" that an earlier pull found (the image
// it named then, as Nomad's docker driver and the kubelet's default do),
// unless req.ForcePull; other tags and local sources are resolved again
// (with the task's credentials), and only the layers the store lacks are
// downloaded. Concurrent pulls of one reference with the same credentials
// share one download.
func (s *Store) Pull(ctx context.Context, raw string, req PullRequest) (*Image, error) {
	ref, err := ParseReference(raw, s.opts.InsecureRegistries)
	if err != nil {
		return nil, errorf(ErrInvalid, "%s", err.Error())
	}
	key := ref.Raw + "\x00" + req.Auth.key()
	if req.ForcePull {
		key += "\x00force"
	}
	s.mu.Lock()
	f := s.flights[key]
	if f != nil {
		f.mu.Lock()
		if f.ctx.Err() != nil {
			// Every waiter left it: it is ending, canceled, and
			// would fail this pull too. A new one starts.
			f.mu.Unlock()
			f = nil
		} else {
			f.waiters = append(f.waiters, &req)
			f.mu.Unlock()
		}
	}
	var run func()
	if f == nil {
		fctx, cancel := context.WithCancel(context.Background())
		nf := &flight{ctx: fctx, done: make(chan struct{}), cancel: cancel, leased: map[*PullRequest]bool{}, waiters: []*PullRequest{&req}}
		s.flights[key] = nf
		run = func() {
			nf.img, nf.err = s.pull(fctx, ref, req.Auth, req.ForcePull, nf)
			s.mu.Lock()
			if s.flights[key] == nf {
				delete(s.flights, key)
			}
			s.mu.Unlock()
			cancel()
			close(nf.done)
		}
		f = nf
	}
	s.mu.Unlock()
	if run != nil {
		go run()
	}
	defer f.leave(&req)
	select {
	case <-f.done:
	case <-ctx.Done():
		return nil, classify(ref, "the image", ctx.Err())
	}
	if f.err != nil {
		return nil, f.err
	}
	if req.Use != nil {
		f.mu.Lock()
		leased := f.leased[&req]
		f.mu.Unlock()
		if !leased {
			if err := s.Acquire(ctx, *req.Use, f.img.Digest); err != nil {
				return nil, err
			}
		}
	}
	return s.image(f.img, ref.Raw), nil
}

// authKey identifies the task's credentials in the store's records ("" for
// none: the operator's, or anonymous, which every job on the node has): a
// keyed hash with the store's own secret (images/auth.key), never the
// credentials. A local source needs none.
func (s *Store) authKey(ref Reference, c *Credentials) string {
	if ref.Local() || c.empty() {
		return ""
	}
	m := hmac.New(sha256.New, s.secret)
	m.Write([]byte(ref.Registry() + "\x00" + c.Username + "\x00" + c.Password))
	return hex.EncodeToString(m.Sum(nil))
}

// loadSecret reads the store's secret, making it the first time (two
// processes may: the first link wins).
func loadSecret(dir string) ([]byte, error) {
	p := filepath.Join(dir, "auth.key")
	if b, err := os.ReadFile(p); err == nil && len(b) == 32 {
		return b, nil
	}
	b := make([]byte, 32)
	if _, err := crand.Read(b); err != nil {
		return nil, err
	}
	tmp := filepath.Join(dir, "tmp", fmt.Sprintf("auth.key.%d.%d", os.Getpid(), time.Now().UnixNano()))
	if err := atomicfile.Write(tmp, b, 0o600, true); err != nil {
		return nil, err
	}
	defer os.Remove(tmp)
	if err := os.Link(tmp, p); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, err
	}
	got, err := os.ReadFile(p)
	if err != nil || len(got) != 32 {
		return nil, fmt.Errorf("the image store's secret %s is damaged: remove it (images pulled with a task's credentials are then asked of their registry again)", p)
	}
	return got, nil
}

// key identifies credentials without keeping them: a flight is shared only
// by pulls with the same ones.
func (c *Credentials) key() string {
	if c.empty() {
		return ""
	}
	sum := sha256.Sum256([]byte(c.Username + "\x00" + c.Password))
	return hex.EncodeToString(sum[:])
}

// source is where an image is read from: a registry or a local layout or
// archive.
type source interface {
	// top is the manifest or index the reference names.
	top(ctx context.Context) ([]byte, types.MediaType, error)
	// manifest is a manifest of an index, by digest.
	manifest(ctx context.Context, d v1.Hash) ([]byte, types.MediaType, error)
	blob(ctx context.Context, d v1.Descriptor) (io.ReadCloser, error)
	close() error
}

func (s *Store) openSource(ctx context.Context, ref Reference, auth *Credentials, f *flight) (source, error) {
	if ref.Local() {
		return s.openLocal(ref)
	}
	return s.openRemote(ctx, ref, auth, f.notify)
}

// pull runs one flight: it holds store.lock shared throughout, so GC and
// removal wait.
func (s *Store) pull(ctx context.Context, ref Reference, auth *Credentials, force bool, f *flight) (*record, error) {
	unlock, err := s.lockStore(ctx, unix.LOCK_SH)
	if err != nil {
		return nil, classify(ref, "the store's lock", err)
	}
	defer unlock()
	key := s.authKey(ref, auth)
	// An image the store has is served by digest without its registry
	// only to credentials it was served to; other ones ask the registry,
	// which may refuse them.
	if ref.Digest != "" && !ref.Local() {
		if r := s.findDigest(ref.Digest); r != nil && r.allows(key) {
			return s.present(ctx, r, ref, key, false, f)
		}
	}
	if !force && ref.pinnedTag() {
		if r, sure := s.findRef(ref.Raw, key); r != nil && sure {
			return s.present(ctx, r, ref, key, false, f)
		}
	}
	src, err := s.openSource(ctx, ref, auth, f)
	if err != nil {
		return s.fallback(ctx, ref, key, f, err)
	}
	defer src.close()
	res, err := s.resolve(ctx, ref, src, f)
	if err != nil {
		return s.fallback(ctx, ref, key, f, err)
	}
	if r, err := s.readRecord(res.digest); err == nil && s.servable(r) {
		// Its configuration goes to credentials it was not served to
		// only if this source serves it: a registry that serves the
		// manifest of another's private image does not get its
		// configuration by that. A record whose stop signal is unknown
		// (written before they were kept) lacks its configuration if
		// it is still unknown here (knowConfig found none, or a
		// damaged one): its source serves it again, and commit reads it;
		// a source that no longer does fails no start of an image the
		// store has whole: its stop signal stays unknown.
		if !r.allows(key) {
			if _, err := s.configBlob(ctx, ref, src, res.manifest.Config, key, f); err != nil {
				return nil, err
			}
		} else if !r.StopSignalKnown && r.ConfigDigest != "" && s.storedConfig(r.ConfigDigest) == nil {
			if _, err := s.configBlob(ctx, ref, src, res.manifest.Config, key, f); err != nil {
				s.logger.Warn("failed to fetch an image's configuration again; its stop signal stays unknown",
					"image", ref.Raw, "digest", r.ConfigDigest, "error", err)
			}
		}
		return s.present(ctx, r, ref, key, true, f)
	}
	cfg, err := s.fetchConfig(ctx, ref, src, res, key, f)
	if err != nil {
		return nil, err
	}
	rec := &record{Digest: res.digest, IndexDigest: res.indexDigest, ConfigDigest: res.manifest.Config.Digest.String(), Config: configOf(cfg),
		StopSignalKnown: true, Platform: platformString(configPlatform(cfg, s.opts.Platform)), PlatformKnown: true, PulledAt: s.now().UTC()}
	var created []string
	for attempt := 1; ; attempt++ {
		var (
			layers []layerRecord
			made   []string
		)
		layers, made, err = s.fetchLayers(ctx, ref, src, res.manifest.Layers, cfg.RootFS.DiffIDs, f)
		created = append(created, made...)
		if err == nil {
			rec.Layers = layers
			_, err = s.commit(ctx, rec, true, ref.Raw, key, true, f)
		}
		// A layer that was there when this pull looked, and that a
		// failed pull (of another image, another source) took away
		// since, is fetched again.
		if err == nil || !errors.Is(err, errLostLayer) || attempt == 3 {
			break
		}
	}
	if err != nil {
		// A failed pull leaves nothing: the layers it unpacked and the
		// configuration go unless an image has them meanwhile.
		s.discard(created, rec.ConfigDigest)
		return nil, err
	}
	return rec, nil
}

// errLostLayer is an image whose layer went while it was pulled.
var errLostLayer = errors.New("a layer of the image was removed while it was pulled")

// discard removes the layers and the configuration a failed pull left,
// those no image record names.
func (s *Store) discard(diffIDs []string, config string) {
	unlock, err := s.lockMeta(context.Background())
	if err != nil {
		return
	}
	defer unlock()
	recs, _ := s.records()
	configUsed := false
	for _, r := range recs {
		configUsed = configUsed || r.ConfigDigest == config
	}
	if !configUsed {
		_ = os.Remove(s.configPath(config))
		marks, _ := filepath.Glob(filepath.Join(s.dir, "configs", hexOf(config)+".for-*"))
		for _, m := range marks {
			_ = os.Remove(m)
		}
	}
	refd := referenced(recs)
	for _, d := range diffIDs {
		if !refd[d] {
			if err := s.removeLayer(d); err != nil {
				s.logger.Warn("failed to remove a layer of a failed pull", "diff_id", d, "error", err)
			}
		}
	}
}

// commit records, under meta.lock, that ref names rec for credentials key
// (resolved: its source said so just now) and writes the leases of the
// pull's waiters. A new record (fresh) is written whole; one the store has
// is read again under the lock and only this pull's part added, so a copy
// read before the lock never undoes another pull's. A record this pull
// changes nothing of is not written when every waiter takes a lease: the
// lease keeps the image from GC, and its release stamps the last use.
func (s *Store) commit(ctx context.Context, rec *record, fresh bool, ref, key string, resolved bool, f *flight) (*record, error) {
	unlock, err := s.lockMeta(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if !fresh {
		if cur, err := s.readRecord(rec.Digest); err == nil {
			rec = cur
		}
	}
	// A layer another pull's failure took away since it was found here:
	// the image is not complete, and the next pull fetches it again.
	if !s.complete(rec) {
		return nil, &Error{Kind: ErrUnreachable, cause: errLostLayer,
			msg: fmt.Sprintf("image %s lost a layer to a failed pull while it was pulled; start it again", shortDigest(rec.Digest))}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	// A resolution changes the record only when ref named another image
	// since (or never had a time here).
	moved := resolved && (rec.resolvedAt(ref).IsZero() || s.resolvedElsewhere(ref, rec.Digest, rec.resolvedAt(ref)))
	changed := fresh || moved || !rec.allows(key) || !slices.Contains(rec.Refs, ref)
	changed = s.knowConfig(rec) || changed
	for _, w := range f.waiters {
		changed = changed || w.Use == nil
	}
	if changed {
		now := s.now().UTC()
		rec.addRef(ref)
		rec.addAuthKey(key)
		if resolved {
			rec.noteResolved(ref, now)
		}
		rec.LastUsed = now
		if err := s.writeRecord(rec); err != nil {
			return nil, fmt.Errorf("failed to record image %s in the store: %w", rec.Digest, err)
		}
	}
	for _, w := range f.waiters {
		if w.Use == nil {
			continue
		}
		if err := s.writeUse(*w.Use, rec.Digest); err != nil {
			return nil, err
		}
		f.leased[w] = true
	}
	return rec, nil
}

// resolvedElsewhere says whether ref resolved to an image other than
// digest after at.
func (s *Store) resolvedElsewhere(ref, digest string, at time.Time) bool {
	recs, _ := s.records()
	for _, r := range recs {
		if r.Digest != digest && r.resolvedAt(ref).After(at) {
			return true
		}
	}
	return false
}

// present is an image the store has, found by ref for credentials key
// (resolved: by asking its source just now).
func (s *Store) present(ctx context.Context, r *record, ref Reference, key string, resolved bool, f *flight) (*record, error) {
	f.progress(Progress{Ref: ref.Raw, Present: true})
	return s.commit(ctx, r, false, ref.Raw, key, resolved, f)
}

// findRef is the complete image that ref resolved to last among those the
// credentials key may be served; sure is false when that is a guess: more
// than one has ref and the one picked has no resolution time for it (a
// store written before they were kept), or none has.
func (s *Store) findRef(ref, key string) (found *record, sure bool) {
	recs, _ := s.records()
	n := 0
	for _, r := range recs {
		if !slices.Contains(r.Refs, ref) || !r.allows(key) || !s.servable(r) {
			continue
		}
		n++
		if found == nil || r.resolvedAt(ref).After(found.resolvedAt(ref)) ||
			r.resolvedAt(ref).Equal(found.resolvedAt(ref)) && r.PulledAt.After(found.PulledAt) {
			found = r
		}
	}
	return found, found != nil && (n == 1 || !found.resolvedAt(ref).IsZero())
}

// fallback serves a tag the registry cannot be asked about from the store,
// when an earlier pull of the same reference left it there: a node plugin
// must restart while its registry is down.
func (s *Store) fallback(ctx context.Context, ref Reference, key string, f *flight, err error) (*record, error) {
	if ref.Local() || !errors.Is(err, ErrUnreachable) {
		return nil, err
	}
	found, _ := s.findRef(ref.Raw, key)
	if found == nil {
		return nil, err
	}
	f.notify(fmt.Sprintf("Registry %s unreachable: using image %s (%s) pulled %s", ref.Registry(), ref.Raw, shortDigest(found.Digest), found.PulledAt.Format(time.RFC3339)))
	return s.present(ctx, found, ref, key, false, f)
}

func (s *Store) findDigest(digest string) *record {
	if r, err := s.readRecord(digest); err == nil && s.servable(r) {
		return r
	}
	// Of the images of an index the store has (pulled while the node ran
	// another x86-64 level), the one closest to the node's platform.
	var (
		best     *record
		bestRank int
	)
	recs, _ := s.records()
	for _, r := range recs {
		if r.IndexDigest != digest {
			continue
		}
		rank := s.servableFit(r)
		if rank < 0 {
			continue
		}
		if best == nil || rank > bestRank {
			best, bestRank = r, rank
		}
	}
	return best
}

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return d
}

// retry runs fn until it succeeds, fails for good, or the attempts are
// spent, waiting a capped, jittered, doubling delay between tries, and
// says so.
func (s *Store) retry(ctx context.Context, ref Reference, what string, notify func(string), fn func() error) error {
	delay := s.retryBase
	for attempt := 1; ; attempt++ {
		err := fn()
		if err == nil || !transient(err) || attempt >= s.attempts || ctx.Err() != nil {
			return err
		}
		wait := delay/2 + rand.N(delay/2+1)
		if notify != nil {
			notify(fmt.Sprintf("Registry %s unreachable while fetching %s (%s): retrying in %s (attempt %d of %d)",
				ref.Registry(), what, shortError(err), wait.Round(100*time.Millisecond), attempt+1, s.attempts))
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
		delay = min(delay*2, 30*time.Second)
	}
}

// shortError is an error's last part ("connection refused"), for events.
func shortError(err error) string {
	var oe *net.OpError
	if errors.As(err, &oe) {
		err = oe
	}
	msg := err.Error()
	if i := strings.LastIndex(msg, ": "); i >= 0 && i+2 < len(msg) {
		msg = msg[i+2:]
	}
	if len(msg) > 120 {
		msg = msg[:120]
	}
	return msg
}

// Acquire records that task u.TaskID uses the image digest, which must be
// in the store; it is idempotent.
func (s *Store) Acquire(ctx context.Context, u Use, digest string) error {
	unlockStore, err := s.lockStore(ctx, unix.LOCK_SH)
	if err != nil {
		return err
	}
	defer unlockStore()
	unlock, err := s.lockMeta(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	r, err := s.readRecord(digest)
	if err != nil || !s.complete(r) {
		return errorf(ErrNotFound, "image %s is not in the store", digest)
	}
	if err := s.writeUse(u, digest); err != nil {
		return err
	}
	r.LastUsed = s.now().UTC()
	return s.writeRecord(r)
}

func (s *Store) usePath(taskID string) string {
	sum := sha256.Sum256([]byte(taskID))
	return filepath.Join(s.dir, "uses", hex.EncodeToString(sum[:16])+".json")
}

func (s *Store) writeUse(u Use, digest string) error {
	u.Digest = digest
	if u.Since.IsZero() {
		u.Since = s.now().UTC()
	}
	b, err := json.Marshal(u)
	if err != nil {
		return err
	}
	// Not synced: a lease must outlive the driver's process, which the
	// page cache does, not the machine: a task does not outlive a crash of
	// the machine, and its restart takes a lease again. A lease lost or
	// torn by one (uses skips it) leaves the image to GC once image_gc
	// has passed since its last stamped use; the restart then pulls it.
	if err := atomicfile.Write(s.usePath(u.TaskID), b, 0o600, false); err != nil {
		return fmt.Errorf("failed to record the use of image %s: %w", digest, err)
	}
	return nil
}

// Release lets go of task taskID's lease (none is fine): its image counts
// as used until now.
func (s *Store) Release(ctx context.Context, taskID string) error {
	unlock, err := s.lockMeta(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	return s.release(taskID)
}

func (s *Store) release(taskID string) error {
	p := s.usePath(taskID)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var u Use
	if json.Unmarshal(b, &u) == nil {
		if r, err := s.readRecord(u.Digest); err == nil {
			r.LastUsed = s.now().UTC()
			if err := s.writeRecord(r); err != nil {
				return err
			}
		}
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

func (s *Store) uses() ([]Use, error) {
	entries, err := os.ReadDir(filepath.Join(s.dir, "uses"))
	if err != nil {
		return nil, err
	}
	var out []Use
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.dir, "uses", e.Name()))
		if err != nil {
			continue
		}
		var u Use
		if json.Unmarshal(b, &u) == nil && u.TaskID != "" {
			out = append(out, u)
		}
	}
	return out, nil
}
