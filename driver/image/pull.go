package image

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/cpu"
	"golang.org/x/sys/unix"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver/atomicfile"
)

// NodePlatform is the platform images are picked for on this node. An
// amd64 node's variant is its CPU's x86-64 level ("v1" to "v4", see
// amd64Level): an image built for a higher level dies of SIGILL here.
func NodePlatform() v1.Platform {
	p := v1.Platform{OS: "linux", Architecture: runtime.GOARCH}
	switch runtime.GOARCH {
	case "arm64":
		p.Variant = "v8"
	case "arm":
		p.Variant = "v7"
	case "amd64":
		p.Variant = fmt.Sprintf("v%d", amd64Level(x86Features{
			CX16: cpu.X86.HasCX16, LAHF: cpu.X86.HasLAHF, POPCNT: cpu.X86.HasPOPCNT, SSE3: cpu.X86.HasSSE3,
			SSE41: cpu.X86.HasSSE41, SSE42: cpu.X86.HasSSE42, SSSE3: cpu.X86.HasSSSE3,
			AVX: cpu.X86.HasAVX, AVX2: cpu.X86.HasAVX2, BMI1: cpu.X86.HasBMI1, BMI2: cpu.X86.HasBMI2,
			F16C: cpu.X86.HasF16C, FMA: cpu.X86.HasFMA, LZCNT: cpu.X86.HasLZCNT, MOVBE: cpu.X86.HasMOVBE,
			OSXSAVE: cpu.X86.HasOSXSAVE, AVX512F: cpu.X86.HasAVX512F, AVX512BW: cpu.X86.HasAVX512BW,
			AVX512CD: cpu.X86.HasAVX512CD, AVX512DQ: cpu.X86.HasAVX512DQ, AVX512VL: cpu.X86.HasAVX512VL,
		}))
	}
	return p
}

// x86Features are the CPU features that make up the x86-64 levels, as
// CPUID reports them (AVX and AVX-512 only when the kernel saves their
// registers).
type x86Features struct {
	CX16, LAHF, POPCNT, SSE3, SSE41, SSE42, SSSE3           bool
	AVX, AVX2, BMI1, BMI2, F16C, FMA, LZCNT, MOVBE, OSXSAVE bool
	AVX512F, AVX512BW, AVX512CD, AVX512DQ, AVX512VL         bool
}

// amd64Level is the x86-64 level (1 to 4) a CPU with f runs code of, as
// the x86-64 psABI defines the levels (and Go's GOAMD64, or a compiler's
// -march=x86-64-v3, builds for them): each needs the one below.
func amd64Level(f x86Features) int {
	if !(f.CX16 && f.LAHF && f.POPCNT && f.SSE3 && f.SSE41 && f.SSE42 && f.SSSE3) {
		return 1
	}
	if !(f.AVX && f.AVX2 && f.BMI1 && f.BMI2 && f.F16C && f.FMA && f.LZCNT && f.MOVBE && f.OSXSAVE) {
		return 2
	}
	if !(f.AVX512F && f.AVX512BW && f.AVX512CD && f.AVX512DQ && f.AVX512VL) {
		return 3
	}
	return 4
}

func platformString(p *v1.Platform) string {
	if p == nil || p.OS == "" {
		return ""
	}
	s := p.OS + "/" + p.Architecture
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

// normalPlatform is p spelled as the store compares and records it, as
// containerd's matcher normalises it: lower case without surrounding
// space; x86_64 and x86-64 are amd64, aarch64 is arm64, i386 is 386,
// armhf and armel are arm (v7 and v6 unless they name a variant); an
// arm64 variant "8" or "v8.0" is v8, an arm one "5" to "8" is v5 to v8.
// Each spelling names the level it is read as, never a higher one; any
// other variant stays as written, and the matcher refuses what it does
// not know. OSVersion and OSFeatures are kept.
func normalPlatform(p v1.Platform) v1.Platform {
	norm := func(s string) string { return strings.ToLower(strings.TrimSpace(s)) }
	p.OS, p.Architecture, p.Variant = norm(p.OS), norm(p.Architecture), norm(p.Variant)
	switch p.Architecture {
	case "x86_64", "x86-64":
		p.Architecture = "amd64"
	case "aarch64":
		p.Architecture = "arm64"
	case "i386":
		p.Architecture = "386"
	case "armhf", "armel":
		if p.Variant == "" {
			p.Variant = map[string]string{"armhf": "v7", "armel": "v6"}[p.Architecture]
		}
		p.Architecture = "arm"
	}
	switch {
	case p.Architecture == "arm64" && (p.Variant == "8" || p.Variant == "v8.0"):
		p.Variant = "v8"
	case p.Architecture == "arm" && len(p.Variant) == 1 && p.Variant >= "5" && p.Variant <= "8":
		p.Variant = "v" + p.Variant
	}
	return p
}

// platformMatches says whether an image built for p runs on node.
func platformMatches(p *v1.Platform, node v1.Platform) bool {
	return platformRank(p, node) >= 0
}

// platformRank says how well an image built for p fits node: -1 when it
// does not run there, more the closer it is. As containerd's matcher: an
// arm node takes its own variant first, then each older one (a v7 node
// runs v6 and v5 code; an arm image without a variant is a v7 one); an
// amd64 node its CPU's level first, then each lower one (an amd64 image
// without a variant is a v1 one), never a higher one; an arm64 image
// without a variant is a v8 one. An arm64 node takes no 32-bit arm image:
// whether its kernel runs them (AArch32) is not known here.
func platformRank(image *v1.Platform, node v1.Platform) int {
	if image == nil {
		return -1
	}
	p, node := normalPlatform(*image), normalPlatform(node)
	if p.OS != node.OS || p.Architecture != node.Architecture {
		return -1
	}
	if level := armVariant; node.Architecture == "arm" || node.Architecture == "amd64" {
		if node.Architecture == "amd64" {
			level = amd64Variant
		}
		have, want := level(p.Variant), level(node.Variant)
		if have == 0 || want == 0 || have > want {
			return -1
		}
		return 10 - (want - have)
	}
	if p.Variant == "" || p.Variant == node.Variant {
		return 10
	}
	if node.Architecture == "arm64" && p.Variant == "v8" && node.Variant == "" {
		return 10
	}
	return -1
}

// platformAdvice is the platform an error tells the operator to build
// for: node's, but for an amd64 node plain amd64, which runs on every one,
// or a level up to the node's (its own level alone would send the
// operator to build images that lower nodes cannot run).
func platformAdvice(node v1.Platform) string {
	if node.Architecture != "amd64" {
		return platformString(&node)
	}
	plain := v1.Platform{OS: node.OS, Architecture: node.Architecture}
	if amd64Variant(node.Variant) < 2 {
		return platformString(&plain)
	}
	return fmt.Sprintf("%s (or for an x86-64 level up to %s)", platformString(&plain), platformString(&node))
}

// amd64Variant is the x86-64 level an amd64 variant names ("v3": 3, ""
// and "v1": 1), 0 for one that is not v1 to v4.
func amd64Variant(v string) int {
	switch v {
	case "v1", "v2", "v3", "v4":
		return int(v[1] - '0')
	case "":
		return 1
	}
	return 0
}

// armVariant is the number of an arm variant ("v7": 7, "": 7 as
// containerd normalises it), 0 for one that is not v5 to v8.
func armVariant(v string) int {
	switch v {
	case "v5", "v6", "v7", "v8":
		return int(v[1] - '0')
	case "":
		return 7
	}
	return 0
}

type resolved struct {
	digest      string
	indexDigest string
	manifest    *v1.Manifest
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// sniff finds a manifest's media type where the source did not say it.
func sniff(raw []byte, mt types.MediaType) types.MediaType {
	if mt.IsIndex() || mt.IsImage() || mt.IsSchema1() {
		return mt
	}
	var probe struct {
		MediaType types.MediaType `json:"mediaType"`
		Manifests json.RawMessage `json:"manifests"`
		Layers    json.RawMessage `json:"layers"`
		FSLayers  json.RawMessage `json:"fsLayers"`
	}
	if json.Unmarshal(raw, &probe) != nil {
		return mt
	}
	switch {
	case probe.MediaType != "":
		return probe.MediaType
	case probe.Manifests != nil:
		return types.OCIImageIndex
	case probe.FSLayers != nil:
		return types.DockerManifestSchema1
	case probe.Layers != nil:
		return types.OCIManifestSchema1
	}
	return mt
}

// resolve fetches the manifest for this node's platform.
func (s *Store) resolve(ctx context.Context, ref Reference, src source, f *flight) (*resolved, error) {
	var (
		raw []byte
		mt  types.MediaType
	)
	err := s.retry(ctx, ref, "the manifest", f.notify, func() (err error) {
		raw, mt, err = src.top(ctx)
		return err
	})
	if err != nil {
		return nil, classify(ref, "the manifest", err)
	}
	d := digestOf(raw)
	if ref.Digest != "" && d != ref.Digest {
		return nil, errorf(ErrDigestMismatch, "image %q: the manifest served for it has digest %s; the registry or its storage is damaged or tampered with, nothing was kept", ref.Raw, shortDigest(d))
	}
	res := &resolved{}
	mt = sniff(raw, mt)
	if mt.IsIndex() {
		res.indexDigest = d
		var idx v1.IndexManifest
		if json.Unmarshal(raw, &idx) != nil {
			return nil, errorf(ErrInvalid, "image %q: its index is not valid JSON", ref.Raw)
		}
		child, err := pickPlatform(ref, &idx, s.opts.Platform)
		if err != nil {
			return nil, err
		}
		err = s.retry(ctx, ref, "the manifest", f.notify, func() (err error) {
			raw, mt, err = src.manifest(ctx, child.Digest)
			return err
		})
		if err != nil {
			return nil, classify(ref, "the manifest for "+shownPlatform(child.Platform), err)
		}
		if d = digestOf(raw); d != child.Digest.String() {
			return nil, errorf(ErrDigestMismatch, "image %q: the manifest for %s does not match its digest %s; the registry or its storage is damaged or tampered with, nothing was kept", ref.Raw, shownPlatform(child.Platform), shortDigest(child.Digest.String()))
		}
		if mt == "" {
			mt = child.MediaType
		}
		if mt = sniff(raw, mt); mt.IsIndex() {
			return nil, errorf(ErrInvalid, "image %q: its index for %s names another index; only one level is supported", ref.Raw, shownPlatform(child.Platform))
		}
	}
	if mt.IsSchema1() {
		return nil, errorf(ErrInvalid, "image %q uses Docker's deprecated schema 1 manifest; push it again with a current client", ref.Raw)
	}
	var m v1.Manifest
	if json.Unmarshal(raw, &m) != nil || m.SchemaVersion != 2 {
		return nil, errorf(ErrInvalid, "image %q: its manifest is not an OCI or Docker schema 2 image manifest", ref.Raw)
	}
	res.digest, res.manifest = d, &m
	return res, nil
}

func pickPlatform(ref Reference, idx *v1.IndexManifest, node v1.Platform) (*v1.Descriptor, error) {
	var (
		best     *v1.Descriptor
		bestRank int
		have     []string
	)
	for i := range idx.Manifests {
		m := &idx.Manifests[i]
		if m.Platform == nil || !(m.MediaType == "" || m.MediaType.IsImage()) {
			continue
		}
		if ps := shownPlatform(m.Platform); ps != "unknown/unknown" && len(have) < 12 {
			have = append(have, ps)
		}
		// The closest variant; of two as close, the one that names it.
		r := platformRank(m.Platform, node)
		if r >= 0 && (best == nil || r > bestRank || r == bestRank && normalPlatform(*best.Platform).Variant == "" && normalPlatform(*m.Platform).Variant != "") {
			best, bestRank = m, r
		}
	}
	if best == nil {
		return nil, errorf(ErrPlatform, "image %q has no image for this node's platform %s (it has %s); use an image built for %s",
			ref.Raw, platformString(&node), orNone(have), platformAdvice(node))
	}
	return best, nil
}

// configPlatform is the platform an image configuration says it is built
// for, normalised, nil when it names none (no os, architecture nor
// variant: it runs anywhere, as the index that led to it says). One that
// names an architecture or variant without an os is taken for node's os:
// its level is still checked, so that an index that lists a v4 image as
// plain amd64 does not get it onto a v2 node by a configuration without
// "os".
func configPlatform(cfg *v1.ConfigFile, node v1.Platform) *v1.Platform {
	named := cfg.Platform()
	if named == nil {
		return nil
	}
	p := normalPlatform(*named)
	if p.OS == "" && p.Architecture == "" && p.Variant == "" {
		return nil
	}
	if p.OS == "" {
		p.OS = normalPlatform(node).OS
	}
	return &p
}

// shownPlatform is p for a message: a hostile index or configuration
// may name platforms megabytes long, which no event should carry.
func shownPlatform(p *v1.Platform) string {
	s := platformString(p)
	if len(s) > 64 {
		s = s[:64] + "..."
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}

// checkBounds refuses an image over image_max_layers or image_max_size
// before anything is downloaded (the manifest's sizes; the download and the
// unpacking are bounded again as they run).
func (s *Store) checkBounds(ref Reference, m *v1.Manifest) error {
	if n := len(m.Layers); n > s.opts.MaxLayers {
		return errorf(ErrTooLarge, "image %q has %d layers, over this node's image_max_layers = %d; use an image with fewer layers or ask the operator to raise it", ref.Raw, n, s.opts.MaxLayers)
	}
	var total int64
	for _, l := range m.Layers {
		if l.Size < 0 || l.Size > s.opts.MaxSize {
			total = s.opts.MaxSize + 1
			break
		}
		total += l.Size
	}
	if total > s.opts.MaxSize {
		return errorf(ErrTooLarge, "image %q is larger than this node's image_max_size = %s; use a smaller image or ask the operator to raise it", ref.Raw, humanBytes(s.opts.MaxSize))
	}
	for _, l := range m.Layers {
		switch l.MediaType {
		case types.OCILayer, types.OCILayerZStd, types.OCIUncompressedLayer, types.DockerLayer, types.DockerUncompressedLayer, "":
		case types.DockerForeignLayer, types.OCIRestrictedLayer, types.OCIUncompressedRestrictedLayer:
			return errorf(ErrInvalid, "image %q has a foreign (non-distributable) layer %s, which registries do not serve; rebuild it without", ref.Raw, shortDigest(l.Digest.String()))
		default:
			return errorf(ErrInvalid, "image %q has a layer of media type %q, which is not a filesystem layer; is it a container image?", ref.Raw, l.MediaType)
		}
	}
	return nil
}

// fetchConfig reads and verifies the image's configuration.
func (s *Store) fetchConfig(ctx context.Context, ref Reference, src source, res *resolved, key string, f *flight) (*v1.ConfigFile, error) {
	m := res.manifest
	if err := s.checkBounds(ref, m); err != nil {
		return nil, err
	}
	switch m.Config.MediaType {
	case types.OCIConfigJSON, types.DockerConfigJSON, "":
	default:
		return nil, errorf(ErrInvalid, "image %q: its configuration has media type %q; it is not a container image", ref.Raw, m.Config.MediaType)
	}
	if m.Config.Size > maxConfigSize {
		return nil, errorf(ErrTooLarge, "image %q: its configuration is over %d MiB", ref.Raw, maxConfigSize>>20)
	}
	raw, err := s.configBlob(ctx, ref, src, m.Config, key, f)
	if err != nil {
		return nil, err
	}
	cfg, err := v1.ParseConfigFile(bytes.NewReader(raw))
	if err != nil {
		return nil, errorf(ErrInvalid, "image %q: its configuration is not valid JSON", ref.Raw)
	}
	if p := configPlatform(cfg, s.opts.Platform); p != nil && !platformMatches(p, s.opts.Platform) {
		return nil, errorf(ErrPlatform, "image %q is built for %s, not this node's platform %s; use an image built for %s",
			ref.Raw, shownPlatform(cfg.Platform()), platformString(&s.opts.Platform), platformAdvice(s.opts.Platform))
	}
	if len(cfg.RootFS.DiffIDs) != len(m.Layers) {
		return nil, errorf(ErrInvalid, "image %q: its manifest has %d layers and its configuration %d", ref.Raw, len(m.Layers), len(cfg.RootFS.DiffIDs))
	}
	for _, d := range cfg.RootFS.DiffIDs {
		if !digestRE.MatchString(d.String()) {
			return nil, errorf(ErrInvalid, "image %q: its configuration names a layer by %q, not a sha256 digest", ref.Raw, d.String())
		}
	}
	return cfg, nil
}

// configBlob reads an image's configuration from the store's cache
// (configs/<hex>.json), or fetches, verifies and caches it under the
// blob's lock, so that concurrent pulls (in other processes too) fetch it
// once. The cache serves it only to credentials key that an image with it
// was served to: for other ones the source must serve it, so that a job
// that knows the digest of another's private configuration (its env) gets
// nothing from a registry of its own whose manifest names it.
func (s *Store) configBlob(ctx context.Context, ref Reference, src source, desc v1.Descriptor, key string, f *flight) ([]byte, error) {
	want := desc.Digest.String()
	cache := s.configPath(want)
	cached := func() []byte {
		if _, err := os.Stat(s.configFetchedPath(want, key)); err != nil && !s.configServed(want, key) {
			return nil
		}
		return s.storedConfig(want)
	}
	if b := cached(); b != nil {
		return b, nil
	}
	unlock, err := lockFile(ctx, s.tmpPath(want, ref)+".lock", unix.LOCK_EX)
	if err != nil {
		return nil, classify(ref, "the configuration", err)
	}
	defer unlock()
	if b := cached(); b != nil {
		return b, nil
	}
	var raw []byte
	err = s.retry(ctx, ref, "the configuration", f.notify, func() error {
		rc, err := src.blob(ctx, desc)
		if err != nil {
			return err
		}
		defer rc.Close()
		raw, err = io.ReadAll(io.LimitReader(rc, maxConfigSize+1))
		return err
	})
	if err != nil {
		return nil, classify(ref, "the configuration", err)
	}
	if digestOf(raw) != want {
		return nil, errorf(ErrDigestMismatch, "image %q: its configuration does not match the digest %s its manifest names; the source is damaged or tampered with, nothing was kept", ref.Raw, shortDigest(want))
	}
	if err := atomicfile.Write(cache, raw, 0o600, true); err != nil {
		return nil, s.diskError(ref, err)
	}
	// Concurrent pulls with the same credentials (other processes too)
	// find it cached before any of them has written the image's record.
	if err := atomicfile.Write(s.configFetchedPath(want, key), nil, 0o600, false); err != nil {
		return nil, s.diskError(ref, err)
	}
	return raw, nil
}

// configFetchedPath marks a cached configuration as fetched from its
// source for credentials key, as an image's record does once it is
// written: configs/<hex>.for-<key> ("none" for no credentials of the
// task's).
func (s *Store) configFetchedPath(digest, key string) string {
	if key == "" {
		key = "none"
	}
	return filepath.Join(s.dir, "configs", hexOf(digest)+".for-"+key)
}

// configServed says whether an image the store has with the configuration
// digest was served to credentials key.
func (s *Store) configServed(digest, key string) bool {
	recs, _ := s.records()
	for _, r := range recs {
		if r.ConfigDigest == digest && r.allows(key) {
			return true
		}
	}
	return false
}

func configOf(cfg *v1.ConfigFile) Config {
	c := cfg.Config
	return Config{Entrypoint: c.Entrypoint, Cmd: c.Cmd, Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, StopSignal: c.StopSignal}
}

// layerMeta is layers/<hex>/layer.json.
type layerMeta = layerRecord

func (s *Store) readLayerMeta(diffID string) (layerMeta, bool) {
	b, err := os.ReadFile(filepath.Join(s.layerDir(diffID), "layer.json"))
	if err != nil {
		return layerMeta{}, false
	}
	var m layerMeta
	if json.Unmarshal(b, &m) != nil || m.DiffID != diffID {
		return layerMeta{}, false
	}
	return m, true
}

// progress adds up a pull's downloaded bytes and tells the flight, a few
// times a second at most.
type progress struct {
	f     *flight
	ref   string
	total int64
	mu    sync.Mutex
	done  []int64
	last  time.Time
}

func (p *progress) set(i int, n int64) {
	p.mu.Lock()
	p.done[i] = n
	var sum int64
	for _, d := range p.done {
		sum += d
	}
	now := time.Now()
	emit := now.Sub(p.last) >= 250*time.Millisecond
	if emit {
		p.last = now
	}
	p.mu.Unlock()
	if emit {
		p.f.progress(Progress{Ref: p.ref, Done: min(sum, p.total), Total: p.total})
	}
}

// fetchLayers makes every layer present; it returns their records and the
// diff ids of the layers it unpacked itself (also on error, for the caller
// to take away).
func (s *Store) fetchLayers(ctx context.Context, ref Reference, src source, descs []v1.Descriptor, diffIDs []v1.Hash, f *flight) ([]layerRecord, []string, error) {
	p := &progress{f: f, ref: ref.Raw, done: make([]int64, len(descs))}
	for i, d := range descs {
		if _, ok := s.readLayerMeta(diffIDs[i].String()); !ok {
			p.total += d.Size
		}
	}
	b := &bounds{}
	b.size.Store(s.opts.MaxSize)
	b.entries.Store(s.maxEntries)
	out := make([]layerRecord, len(descs))
	made := make([]bool, len(descs))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(3)
	for i := range descs {
		g.Go(func() error {
			m, fresh, err := s.ensureLayer(gctx, ref, src, descs[i], diffIDs[i].String(), b, func(n int64) { p.set(i, n) }, f)
			out[i], made[i] = m, fresh
			return err
		})
	}
	err := g.Wait()
	var created []string
	for i, m := range made {
		if m {
			created = append(created, diffIDs[i].String())
		}
	}
	if err != nil {
		return nil, created, err
	}
	f.progress(Progress{Ref: ref.Raw, Done: p.total, Total: p.total})
	return out, created, nil
}

// ensureLayer makes the layer present, unpacking it unless the store (or
// another process, which holds the layer's lock meanwhile) already has it.
func (s *Store) ensureLayer(ctx context.Context, ref Reference, src source, desc v1.Descriptor, diffID string, b *bounds, onRead func(int64), f *flight) (layerRecord, bool, error) {
	if m, ok := s.readLayerMeta(diffID); ok {
		b.size.Add(-m.Size)
		return m, false, nil
	}
	unlock, err := lockFile(ctx, s.tmpPath(diffID, ref)+".lock", unix.LOCK_EX)
	if err != nil {
		return layerRecord{}, false, classify(ref, "layer "+shortDigest(desc.Digest.String()), err)
	}
	defer unlock()
	if m, ok := s.readLayerMeta(diffID); ok {
		b.size.Add(-m.Size)
		return m, false, nil
	}
	var (
		m    layerRecord
		made bool
	)
	what := "layer " + shortDigest(desc.Digest.String())
	err = s.retry(ctx, ref, what, f.notify, func() (err error) {
		m, made, err = s.fetchLayer(ctx, ref, src, desc, diffID, b, onRead)
		return err
	})
	if err != nil {
		return layerRecord{}, false, classify(ref, what, err)
	}
	return m, made, nil
}

// tmpPath is where a pull from ref's source unpacks the layer (or fetches
// the configuration) digest names, under tmp/; with ".lock", the lock that
// pulls from that source take for it. A lock is per source (registry and
// repository, or host path): pulls of one source share one download, but
// a source that stalls (a hostile registry, slow for ever) holds no other
// source's pull of the same content, which unpacks beside it.
func (s *Store) tmpPath(digest string, ref Reference) string {
	src := ref.Kind + ":" + ref.Path
	if !ref.Local() {
		src = ref.Remote.Context().Name()
	}
	sum := sha256.Sum256([]byte(src))
	return filepath.Join(s.dir, "tmp", hexOf(digest)+"."+hex.EncodeToString(sum[:8]))
}

// countingReader tells how many bytes went through it.
type countingReader struct {
	r      io.Reader
	n      int64
	onRead func(int64)
	// err is the first error the source returned (io.EOF at its end).
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && c.err == nil {
		c.err = err
	}
	if n > 0 && c.onRead != nil {
		c.onRead(c.n)
	}
	return n, err
}

// fetchLayer downloads and unpacks one layer under tmp/, verifying its
// digest (as served) and its diff id (unpacked) on the way, and renames it
// into layers/ only when both match and it is on disk. made is false when
// a pull from another source put the layer there first: that one is kept,
// this one goes.
func (s *Store) fetchLayer(ctx context.Context, ref Reference, src source, desc v1.Descriptor, diffID string, b *bounds, onRead func(int64)) (_ layerRecord, made bool, _ error) {
	tmp := s.tmpPath(diffID, ref)
	if err := os.RemoveAll(tmp); err != nil {
		return layerRecord{}, false, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(tmp)
		}
	}()
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return layerRecord{}, false, s.diskError(ref, err)
	}
	if err := os.Mkdir(filepath.Join(tmp, "fs"), 0o755); err != nil {
		return layerRecord{}, false, s.diskError(ref, err)
	}
	rc, err := src.blob(ctx, desc)
	if err != nil {
		return layerRecord{}, false, err
	}
	defer rc.Close()
	counted := &countingReader{r: rc, onRead: onRead}
	ch := sha256.New()
	raw := bufio.NewReaderSize(io.TeeReader(io.LimitReader(counted, desc.Size+1), ch), 1<<16)
	charged := new(atomic.Int64)
	size, err := s.unpackStream(ctx, raw, desc.MediaType, filepath.Join(tmp, "fs"), b, charged, diffID)
	// Whatever went wrong, a blob that is not what its digest says is
	// reported as that, its real cause.
	_, _ = io.Copy(io.Discard, raw)
	if counted.n != desc.Size || "sha256:"+hex.EncodeToString(ch.Sum(nil)) != desc.Digest.String() {
		b.size.Add(charged.Load())
		if ctx.Err() != nil {
			return layerRecord{}, false, ctx.Err()
		}
		// A stream cut short by the network is tried again; a blob that
		// ended early, or is longer or other than its digest, is not.
		if counted.err != nil && counted.err != io.EOF && transient(counted.err) {
			return layerRecord{}, false, counted.err
		}
		return layerRecord{}, false, errorf(ErrDigestMismatch, "image %q: layer %s does not match its digest (%d bytes served of %d); the source is damaged or tampered with, nothing was kept",
			ref.Raw, shortDigest(desc.Digest.String()), counted.n, desc.Size)
	}
	if err != nil {
		b.size.Add(charged.Load())
		switch {
		case errors.Is(err, errTooManyEntries):
			return layerRecord{}, false, errorf(ErrTooLarge, "image %q has more than %d files, directories and links; the store takes at most that many of one image", ref.Raw, s.maxEntries)
		case errors.Is(err, errTooLarge):
			return layerRecord{}, false, errorf(ErrTooLarge, "image %q unpacks to more than this node's image_max_size = %s; use a smaller image or ask the operator to raise it", ref.Raw, humanBytes(s.opts.MaxSize))
		case errors.Is(err, ErrUnsafeLayer):
			return layerRecord{}, false, errorf(ErrUnsafeLayer, "image %q: layer %s is refused: %v", ref.Raw, shortDigest(desc.Digest.String()), err)
		case errors.Is(err, errZstdWindow), errors.Is(err, zstd.ErrWindowSizeExceeded):
			return layerRecord{}, false, errorf(ErrInvalid, "image %q: layer %s is zstd-compressed with a window over the %s this node decodes (%v); compress it again with a smaller window (zstd's levels 1 to 19 use 8 MiB or less)",
				ref.Raw, shortDigest(desc.Digest.String()), humanBytes(zstdMaxWindow), err)
		case errors.Is(err, ErrDigestMismatch):
			return layerRecord{}, false, errorf(ErrDigestMismatch, "image %q: layer %s is refused: %v", ref.Raw, shortDigest(desc.Digest.String()), err)
		case errors.As(err, new(*unsupportedCompression)):
			return layerRecord{}, false, errorf(ErrInvalid, "image %q: layer %s (media type %q) is %v, which this node does not read (as containerd does not); push the image again with its layers compressed with gzip or zstd",
				ref.Raw, shortDigest(desc.Digest.String()), desc.MediaType, err)
		case errors.Is(err, unix.ENOSPC), errors.Is(err, unix.EDQUOT):
			return layerRecord{}, false, s.diskError(ref, err)
		}
		return layerRecord{}, false, errorf(ErrInvalid, "image %q: layer %s cannot be unpacked: %v", ref.Raw, shortDigest(desc.Digest.String()), err)
	}
	m := layerRecord{DiffID: diffID, Digest: desc.Digest.String(), Size: size, Compressed: desc.Size}
	meta, _ := json.Marshal(m)
	if err := os.WriteFile(filepath.Join(tmp, "layer.json"), meta, 0o600); err != nil {
		return layerRecord{}, false, s.diskError(ref, err)
	}
	if err := syncFS(tmp); err != nil {
		return layerRecord{}, false, s.diskError(ref, err)
	}
	if err := os.Rename(tmp, s.layerDir(diffID)); err != nil {
		// A layer directory is never replaced: one that is there was
		// made whole by another source's pull.
		if other, there := s.readLayerMeta(diffID); there {
			return other, false, nil
		}
		return layerRecord{}, false, s.diskError(ref, err)
	}
	ok = true
	return m, true, syncDir(filepath.Join(s.dir, "layers"))
}

// A zstd decoder holds its frame's window in memory (the frame says how
// large, up to terabytes) for as long as the layer downloads. Windows up to
// RFC 8878's interoperable 8 MiB (what zstd's levels 1 to 19 write) are
// free; larger ones, up to zstd's own default limit of 128 MiB, are taken
// from one budget of the store, waited for within image_pull_timeout, so
// that many pulls of hostile images at once cannot take the driver's
// memory; larger ones are refused.
const (
	zstdFreeWindow   = 8 << 20
	zstdMaxWindow    = 128 << 20
	zstdWindowBudget = 512 << 20
)

// errZstdWindow is a zstd frame whose window is over zstdMaxWindow.
var errZstdWindow = errors.New("zstd window too large")

// zstdWindow is the window the zstd frame at the start of raw needs (0
// when its header cannot be read: the decoder says why).
func zstdWindow(raw *bufio.Reader) uint64 {
	head, _ := raw.Peek(zstd.HeaderMaxSize)
	var h zstd.Header
	if h.Decode(head) != nil {
		return 0
	}
	if h.SingleSegment {
		return h.FrameContentSize
	}
	return h.WindowSize
}

// unpackStream decompresses raw (gzip, zstd or a plain tar, told by its
// first bytes and, where those could be either, by mt, its media type),
// checks the result against diffID, and unpacks it into dir.
func (s *Store) unpackStream(ctx context.Context, raw *bufio.Reader, mt types.MediaType, dir string, b *bounds, charged *atomic.Int64, diffID string) (int64, error) {
	magic, _ := raw.Peek(512)
	var dec io.Reader = raw
	isGzip := bytes.HasPrefix(magic, []byte{0x1f, 0x8b})
	isZstd := bytes.HasPrefix(magic, []byte{0x28, 0xb5, 0x2f, 0xfd})
	switch {
	case isTarHeader(magic) && !(isGzip && (mt == types.OCILayer || mt == types.DockerLayer) || isZstd && mt == types.OCILayerZStd):
		// A plain tar, whatever its first member's name (its first
		// bytes), a pre-POSIX one without "ustar" too. A gzip or zstd
		// stream can pass the checksum too (gzip's FEXTRA and FNAME, or
		// zstd's raw blocks, put bytes of the writer's choice there):
		// one that says it is compressed, by its media type and its
		// magic, is.
	case isGzip:
		zr, err := gzip.NewReader(raw)
		if err != nil {
			return 0, err
		}
		defer zr.Close()
		dec = zr
	case isZstd:
		// The first frame's window is the decoder's limit: a later
		// frame that wants more fails the layer.
		window := max(zstdWindow(raw), zstdFreeWindow)
		if window > zstdMaxWindow {
			return 0, fmt.Errorf("%w: its first frame wants %s", errZstdWindow, humanBytes(int64(min(window, 1<<62))))
		}
		if window > zstdFreeWindow {
			if err := s.zstdWindows.Acquire(ctx, int64(window)); err != nil {
				return 0, err
			}
			defer s.zstdWindows.Release(int64(window))
		}
		zr, err := zstd.NewReader(raw, zstd.WithDecoderMaxWindow(window), zstd.WithDecoderConcurrency(1))
		if err != nil {
			return 0, err
		}
		defer zr.Close()
		dec = zr
	case len(magic) > 262 && string(magic[257:262]) == "ustar":
		// A plain tar, whatever its first file's name (its first bytes).
	default:
		for _, c := range otherCompressions {
			if bytes.HasPrefix(magic, c.magic) {
				return 0, &unsupportedCompression{name: c.name}
			}
		}
	}
	dh := sha256.New()
	meter := &budgetReader{r: io.TeeReader(dec, dh), budget: &b.size, charged: charged}
	size, err := unpackTar(meter, dir, b, charged)
	if err != nil {
		return 0, err
	}
	// What follows the tar's end is part of the diff id too.
	if _, err := io.Copy(io.Discard, meter); err != nil {
		return 0, err
	}
	if got := "sha256:" + hex.EncodeToString(dh.Sum(nil)); got != diffID {
		return 0, fmt.Errorf("%w: the unpacked layer is %s, not the diff id %s its image names", ErrDigestMismatch, shortDigest(got), shortDigest(diffID))
	}
	return size, nil
}

// isTarHeader says whether b begins with a tar header: 512 bytes whose
// checksum field (octal) is the sum of their bytes, the field counted as
// spaces, unsigned or, as some old tars wrote it, signed. The first member's
// name comes first in a tar and may begin like any compression's magic; a
// compressed stream whose first 512 bytes also pass this check is not one
// a compressor writes.
func isTarHeader(b []byte) bool {
	if len(b) < 512 {
		return false
	}
	field := bytes.Trim(b[148:156], " \x00")
	if len(field) == 0 {
		return false
	}
	var want int64
	for _, c := range field {
		if c < '0' || c > '7' {
			return false
		}
		want = want*8 + int64(c-'0')
	}
	var unsigned, signed int64
	for i, c := range b[:512] {
		if i >= 148 && i < 156 {
			c = ' '
		}
		unsigned += int64(c)
		signed += int64(int8(c))
	}
	return want == unsigned || want == signed
}

// otherCompressions are the compressions a layer may be told by that the
// store does not read: Docker once read xz and bzip2 layers; containerd,
// and so the kubelet, reads gzip, zstd and plain tars only, as the store.
var otherCompressions = []struct {
	name  string
	magic []byte
}{
	{"xz", []byte{0xfd, '7', 'z', 'X', 'Z', 0x00}},
	{"bzip2", []byte("BZh")},
	{"lz4", []byte{0x04, 0x22, 0x4d, 0x18}},
}

// unsupportedCompression is a layer compressed with one of
// otherCompressions.
type unsupportedCompression struct{ name string }

func (e *unsupportedCompression) Error() string { return e.name + "-compressed" }

// bounds are what an image may still take as it is pulled: bytes (as
// served and as unpacked) and entries, shared by its layers.
type bounds struct {
	size, entries atomic.Int64
}

// budgetReader charges what is read to the image's budget.
type budgetReader struct {
	r       io.Reader
	budget  *atomic.Int64
	charged *atomic.Int64
}

func (b *budgetReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.charged.Add(int64(n))
	if b.budget.Add(-int64(n)) < 0 {
		return n, errTooLarge
	}
	return n, err
}

func syncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}

// diskError says the store cannot write, and where.
func (s *Store) diskError(ref Reference, err error) error {
	if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
		return &Error{Kind: ErrStoreFull, cause: err,
			msg: fmt.Sprintf("failed to pull image %q: the image store %s is full (%v); free space there or lower image_gc", ref.Raw, s.dir, unix.ENOSPC)}
	}
	return &Error{Kind: ErrStoreFull, cause: err, msg: fmt.Sprintf("failed to pull image %q: cannot write in the image store %s: %v", ref.Raw, s.dir, err)}
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	s := fmt.Sprintf("%.1f %ciB", v, "KMGTPE"[exp])
	return strings.Replace(s, ".0 ", " ", 1)
}
