// Package metrics is the driver's opt-in Prometheus endpoint: CSI call
// counts and latencies by plugin, method and gRPC code (heard through
// csiclient.Policy.Observe), retries, volumes staged, refused and published, plugin
// health, and the last sampled usage and condition of each volume (the
// csihook stats loop). It uses a registry of its own, never Prometheus's
// global one, so nothing else in the process adds to what it serves.
//
// Label values and what a job controls: plugin_id is bounded by the
// plugins that run on the node (a call is only made to a plugin the
// fingerprint found, and the driver validates plugin task ids); method
// and code come from fixed sets. volume_id is chosen by jobs, so the
// per-volume series are bounded three ways: they exist only for volumes
// published on this node now (each a real mount of a running task; they
// go when it is unpublished, being computed at scrape time), at most
// MaxVolumeSeries volumes are exported (the rest are counted in
// nomad_driver_csi_volume_series_dropped), and a volume id longer than
// MaxLabelBytes or holding anything but printable ASCII is exported as
// "h-" and a hash of it. Condition messages, which plugins write, are
// never labels (they reach users as task events).
package metrics

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/nomad-driver-csi/nomad-driver-csi/csihook"
	"github.com/nomad-driver-csi/nomad-driver-csi/fingerprint/csiclient"
)

const (
	namespace = "nomad_driver_csi"
	// MaxVolumeSeries bounds the volumes whose usage is exported.
	MaxVolumeSeries = 1000
	// MaxLabelBytes bounds a label value taken from a job or a plugin.
	MaxLabelBytes = 128
)

// PluginHealth is one plugin's health as the fingerprint knows it.
type PluginHealth struct {
	ID      string
	Healthy bool
}

// Source is what the collector reads at each scrape. Any func may be nil.
type Source struct {
	// Volumes returns the last stats of each sampled volume.
	Volumes func() []csihook.VolumeStats
	// Counts returns the volumes staged, those whose stage the plugin
	// refused, and the task volumes published.
	Counts func() csihook.VolumeCounts
	// Plugins returns every plugin's health.
	Plugins func() []PluginHealth
}

// Metrics holds the registry and the call metrics.
type Metrics struct {
	reg     *prometheus.Registry
	calls   *prometheus.CounterVec
	latency *prometheus.HistogramVec
	retries *prometheus.CounterVec
}

// New returns Metrics whose registry serves the call metrics and what src
// gives at each scrape.
func New(src Source) *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "csi_calls_total",
			Help: "CSI calls made to plugins (each attempt), by plugin, method and gRPC code.",
		}, []string{"plugin_id", "method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "csi_call_duration_seconds",
			Help:    "Duration of CSI calls to plugins (each attempt), by plugin, method and gRPC code.",
			Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"plugin_id", "method", "code"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "csi_call_retries_total",
			Help: "CSI call attempts that were retries of a failed one, by plugin and method.",
		}, []string{"plugin_id", "method"}),
	}
	m.reg.MustRegister(m.calls, m.latency, m.retries, &collector{src: src})
	return m
}

// Registry is the private registry (for tests and Handler).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// ObserveCall counts one finished attempt of a CSI call to a plugin.
func (m *Metrics) ObserveCall(pluginID string, o csiclient.Observation) {
	p := Label(pluginID)
	code := o.Code.String()
	m.calls.WithLabelValues(p, o.Method, code).Inc()
	m.latency.WithLabelValues(p, o.Method, code).Observe(o.Duration.Seconds())
	if o.N > 1 {
		m.retries.WithLabelValues(p, o.Method).Inc()
	}
}

// Handler serves the registry in Prometheus's text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Label returns s as a label value when it is at most MaxLabelBytes of
// printable ASCII, else "h-" and a hash of it: stable, short and safe.
func Label(s string) string {
	if len(s) <= MaxLabelBytes {
		ok := true
		for i := 0; i < len(s); i++ {
			if s[i] < 0x21 || s[i] > 0x7e {
				ok = false
				break
			}
		}
		if ok {
			return s
		}
	}
	return "h-" + csihook.ShortHash(s)
}

var (
	descStaged = prometheus.NewDesc(namespace+"_volumes_staged",
		"Volumes staged on this node.", nil, nil)
	descRefused = prometheus.NewDesc(namespace+"_volumes_refused",
		"Volumes whose last NodeStageVolume the plugin refused: not staged until a task, a repair or a driver restart stages them again.", nil, nil)
	descPublished = prometheus.NewDesc(namespace+"_volumes_published",
		"Task volumes published on this node.", nil, nil)
	descPlugin = prometheus.NewDesc(namespace+"_plugin_healthy",
		"1 when the CSI plugin is healthy, 0 when not.", []string{"plugin_id"}, nil)
	volLabels  = []string{"plugin_id", "volume_id"}
	descBytes  = prometheus.NewDesc(namespace+"_volume_bytes", "Bytes of a published volume by state (used, available, total), as last sampled.", append(volLabels, "state"), nil)
	descInodes = prometheus.NewDesc(namespace+"_volume_inodes", "Inodes of a published volume by state (used, available, total), as last sampled.", append(volLabels, "state"), nil)
	descAbn    = prometheus.NewDesc(namespace+"_volume_abnormal",
		"1 when the plugin said the volume's condition is abnormal, 0 when normal (VOLUME_CONDITION only).", volLabels, nil)
	descSampled = prometheus.NewDesc(namespace+"_volume_stats_timestamp_seconds",
		"When the volume was last sampled, in seconds since the epoch.", volLabels, nil)
	descErr = prometheus.NewDesc(namespace+"_volume_stats_failing",
		"1 when the last NodeGetVolumeStats of the volume failed.", volLabels, nil)
	descDropped = prometheus.NewDesc(namespace+"_volume_series_dropped",
		"Sampled volumes not exported because more than the limit are published.", nil, nil)
)

// collector reads Source at scrape time, so a volume unpublished leaves
// no series behind.
type collector struct{ src Source }

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descStaged, descRefused, descPublished, descPlugin, descBytes, descInodes, descAbn, descSampled, descErr, descDropped} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	if c.src.Counts != nil {
		n := c.src.Counts()
		gauge(descStaged, float64(n.Staged))
		gauge(descRefused, float64(n.Refused))
		gauge(descPublished, float64(n.Published))
	}
	if c.src.Plugins != nil {
		seen := map[string]bool{}
		for _, p := range c.src.Plugins() {
			id := Label(p.ID)
			if p.ID == "" || seen[id] {
				continue
			}
			seen[id] = true
			gauge(descPlugin, b2f(p.Healthy), id)
		}
	}
	if c.src.Volumes == nil {
		return
	}
	vols := c.src.Volumes()
	dropped := 0
	seen := map[[2]string]bool{}
	for _, v := range vols {
		k := [2]string{Label(v.PluginID), Label(v.VolumeID)}
		if seen[k] {
			continue
		}
		if len(seen) >= MaxVolumeSeries {
			dropped++
			continue
		}
		seen[k] = true
		if v.Sampled.IsZero() {
			continue
		}
		for _, u := range []struct {
			d *prometheus.Desc
			u *csihook.Usage
		}{{descBytes, v.Bytes}, {descInodes, v.Inodes}} {
			if u.u == nil {
				continue
			}
			gauge(u.d, float64(u.u.Used), k[0], k[1], "used")
			gauge(u.d, float64(u.u.Available), k[0], k[1], "available")
			gauge(u.d, float64(u.u.Total), k[0], k[1], "total")
		}
		if v.HasCondition {
			gauge(descAbn, b2f(v.Abnormal), k[0], k[1])
		}
		gauge(descSampled, float64(v.Sampled.UnixNano())/1e9, k[0], k[1])
		gauge(descErr, b2f(v.Error != ""), k[0], k[1])
	}
	gauge(descDropped, float64(dropped))
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Listen says where the endpoint listens and who may read it.
type Listen struct {
	// Address is "host:port" (TCP) or "unix:///path" (a unix socket, see
	// listenUnix).
	Address string
	// Token, when set, is the bearer token every request must carry
	// ("Authorization: Bearer <token>"); others get 401.
	Token string
}

// UnixPrefix starts an Address that is a unix socket's path.
const UnixPrefix = "unix://"

// Server is the endpoint listening on one address.
type Server struct {
	listen Listen
	ln     net.Listener
	srv    *http.Server
	done   chan struct{}
	// socket is the unix socket's path, removed on Close if it is still
	// inode socketIno.
	socket    string
	socketIno uint64
}

// Serve listens as l says and serves /metrics until Close.
func (m *Metrics) Serve(l Listen) (*Server, error) {
	var (
		ln     net.Listener
		socket string
		ino    uint64
		err    error
	)
	if path, ok := strings.CutPrefix(l.Address, UnixPrefix); ok {
		socket = path
		ln, ino, err = listenUnix(path)
	} else {
		ln, err = net.Listen("tcp", l.Address)
	}
	if err != nil {
		return nil, fmt.Errorf("failed to listen on metrics_address %q: %w", l.Address, err)
	}
	var h http.Handler = m.Handler()
	if l.Token != "" {
		h = requireToken(l.Token, h)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	s := &Server{listen: l, ln: ln, done: make(chan struct{}), socket: socket, socketIno: ino,
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
			WriteTimeout: 30 * time.Second, MaxHeaderBytes: 16 << 10}}
	go func() {
		defer close(s.done)
		_ = s.srv.Serve(ln)
	}()
	return s, nil
}

// requireToken serves h only to requests that carry the bearer token.
func requireToken(token string, h http.Handler) http.Handler {
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := []byte(r.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="nomad-driver-csi metrics"`)
			http.Error(w, "a bearer token is required (metrics_token_file in the driver's plugin config)", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// Addr is the address the server was asked to listen on; ListenAddr is
// where it listens (with the port chosen for ":0").
func (s *Server) Addr() string { return s.listen.Address }
func (s *Server) ListenAddr() string {
	if s.socket != "" {
		return UnixPrefix + s.socket
	}
	return s.ln.Addr().String()
}

// Close stops listening and waits for the server to end; scrapes in
// flight get a moment to finish.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = s.srv.Close()
	}
	<-s.done
	if s.socket != "" {
		if rerr := removeSocket(s.socket, s.socketIno); rerr != nil && err == nil {
			err = rerr
		}
	}
	return err
}

// Endpoint keeps at most one Server, on the address last asked for.
type Endpoint struct {
	mu  sync.Mutex
	srv *Server
}

// Set makes the endpoint listen as l says: the server already listening
// so is kept (a second SetConfig must not fail with "address in use"),
// another is closed first, and an empty Address closes it.
func (e *Endpoint) Set(m *Metrics, l Listen) (*Server, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.srv != nil && e.srv.listen == l {
		return e.srv, nil
	}
	if e.srv != nil {
		_ = e.srv.Close()
		e.srv = nil
	}
	if l.Address == "" {
		return nil, nil
	}
	s, err := m.Serve(l)
	if err != nil {
		return nil, err
	}
	e.srv = s
	return s, nil
}

// Close closes the server, if any.
func (e *Endpoint) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.srv != nil {
		_ = e.srv.Close()
		e.srv = nil
	}
}
