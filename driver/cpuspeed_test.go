package driver

import (
	"os"
	"testing"
	"testing/fstest"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/helper/pluginutils/hclutils"
	"github.com/shoenig/test/must"
)

func file(s string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(s)} }

// x86 /proc/cpuinfo of two cores, as a VM without cpufreq shows it.
const cpuinfoTwoCores = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2445.412\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu MHz\t\t: 2445.500\n\n"

func TestMeasureCPU(t *testing.T) {
	cases := []struct {
		name    string
		fs      fstest.MapFS
		want    cpuSpeed
		wantErr error
	}{
		{
			name: "intel_pstate base frequency wins over max",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online":                        file("0-1\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/scaling_driver":   file("intel_pstate\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/base_frequency":   file("2100000\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": file("3500000\n"),
				"sys/devices/system/cpu/cpu1/cpufreq/scaling_driver":   file("intel_pstate\n"),
				"sys/devices/system/cpu/cpu1/cpufreq/base_frequency":   file("2100000\n"),
				"sys/devices/system/cpu/cpu1/cpufreq/cpuinfo_max_freq": file("3500000\n"),
				"proc/cpuinfo": file(cpuinfoTwoCores),
			},
			want: cpuSpeed{Cores: 2, TotalMHz: 4200, Source: "cpufreq/base_frequency"},
		},
		{
			name: "acpi-cpufreq nominal frequency",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online":                        file("0\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/scaling_driver":   file("acpi-cpufreq\n"),
				"sys/devices/system/cpu/cpu0/acpi_cppc/nominal_freq":   file("2450\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/base_frequency":   file("9999999\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": file("3500000\n"),
			},
			want: cpuSpeed{Cores: 1, TotalMHz: 2450, Source: "acpi_cppc/nominal_freq"},
		},
		{
			name: "acpi-cpufreq without cppc falls back to max",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online":                        file("0\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/scaling_driver":   file("acpi-cpufreq\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": file("3000000\n"),
			},
			want: cpuSpeed{Cores: 1, TotalMHz: 3000, Source: "cpufreq/cpuinfo_max_freq"},
		},
		{
			name: "no cpufreq: /proc/cpuinfo per core",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online": file("0-1\n"),
				"proc/cpuinfo":                  file(cpuinfoTwoCores),
			},
			want: cpuSpeed{Cores: 2, TotalMHz: 2445.412 + 2445.5, Source: "/proc/cpuinfo"},
		},
		{
			name: "offline cores are not counted",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online": file("0,2-3\n"),
				"proc/cpuinfo":                  file("processor : 0\ncpu MHz : 1000\n\nprocessor : 2\ncpu MHz : 1000\n\nprocessor : 3\ncpu MHz : 1000\n"),
			},
			want: cpuSpeed{Cores: 3, TotalMHz: 3000, Source: "/proc/cpuinfo"},
		},
		{
			name: "mixed: cpufreq on one core, cpuinfo for the other",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online":                        file("0-1\n"),
				"sys/devices/system/cpu/cpu1/cpufreq/cpuinfo_max_freq": file("2000000\n"),
				"proc/cpuinfo": file("processor : 0\ncpu MHz : 1500\n\nprocessor : 1\n"),
			},
			want: cpuSpeed{Cores: 2, TotalMHz: 3500, Source: "/proc/cpuinfo"},
		},
		{
			name: "no sysfs list: cores from /proc/cpuinfo",
			fs:   fstest.MapFS{"proc/cpuinfo": file(cpuinfoTwoCores)},
			want: cpuSpeed{Cores: 2, TotalMHz: 2445.412 + 2445.5, Source: "/proc/cpuinfo"},
		},
		{
			name: "arm64 without cpufreq: cores but no speed",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online": file("0-3\n"),
				"proc/cpuinfo":                  file("processor\t: 0\nBogoMIPS\t: 50.00\n\nprocessor\t: 1\nBogoMIPS\t: 50.00\n"),
			},
			want:    cpuSpeed{Cores: 4},
			wantErr: errNoCPUSpeed,
		},
		{
			name: "garbage in sysfs is no speed",
			fs: fstest.MapFS{
				"sys/devices/system/cpu/online":                        file("0\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/base_frequency":   file("<unsupported>\n"),
				"sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": file("-5\n"),
			},
			want:    cpuSpeed{Cores: 1},
			wantErr: errNoCPUSpeed,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := measureCPU(tc.fs)
			if tc.wantErr != nil {
				must.ErrorIs(t, err, tc.wantErr)
			} else {
				must.NoError(t, err)
			}
			must.Eq(t, tc.want.Cores, got.Cores)
			must.Eq(t, tc.want.Source, got.Source)
			must.InDelta(t, tc.want.TotalMHz, got.TotalMHz, 1e-9)
		})
	}
}

func TestMeasureCPU_nothingToRead(t *testing.T) {
	_, err := measureCPU(fstest.MapFS{})
	must.ErrorContains(t, err, "failed to count the CPU cores")
}

func TestParseCPUList(t *testing.T) {
	got, err := parseCPUList("0-2,5,7-8")
	must.NoError(t, err)
	must.Eq(t, []int{0, 1, 2, 5, 7, 8}, got)
	for _, bad := range []string{"", "x", "3-1", "1-", "-1"} {
		_, err := parseCPUList(bad)
		must.Error(t, err, must.Sprintf("%q", bad))
	}
}

func TestCPUSpeed_mhzPerCore(t *testing.T) {
	s := cpuSpeed{Cores: 4, TotalMHz: 8000}
	must.Eq(t, 2000.0, s.mhzPerCore(0))
	// The operator's figure replaces the measured one, spread over the
	// same cores, as the agent spreads its cpu_total_compute.
	must.Eq(t, 3000.0, s.mhzPerCore(12000))
	must.Eq(t, 0.0, cpuSpeed{}.mhzPerCore(12000))
}

// SetConfig measures the speed once and counts task CPU usage in it; the
// operator's cpu_total_compute wins.
func TestSetConfig_cpuSpeed(t *testing.T) {
	fake := fstest.MapFS{
		"sys/devices/system/cpu/online": file("0-1\n"),
		"proc/cpuinfo":                  file("processor : 0\ncpu MHz : 2500\n\nprocessor : 1\ncpu MHz : 2500\n"),
	}
	for _, tc := range []struct {
		name         string
		totalCompute int
		fs           fstest.MapFS
		want         float64
	}{
		{"measured", 0, fake, 2500},
		{"cpu_total_compute", 7000, fake, 3500},
		{"nothing measured", 0, fstest.MapFS{"sys/devices/system/cpu/online": file("0-1\n")}, 0},
		{"unmeasured, cpu_total_compute", 7000, fstest.MapFS{"sys/devices/system/cpu/online": file("0-1\n")}, 3500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := NewPlugin(hclog.NewNullLogger())
			d.cpuRoot = tc.fs
			t.Cleanup(d.Shutdown)
			must.NoError(t, setConfig(d, Config{Enabled: false, RootDir: shortTempDir(t), CgroupParent: "c", CPUTotalCompute: tc.totalCompute}))
			d.mu.RLock()
			got := d.mhzPerCore
			d.mu.RUnlock()
			must.Eq(t, tc.want, got)
		})
	}
}

// On this machine the measurement finds the cores and, on the kernels the
// project runs on (x86 with or without cpufreq), a speed.
func TestMeasureCPU_thisHost(t *testing.T) {
	got, err := measureCPU(os.DirFS("/"))
	if err != nil {
		t.Skipf("this host gives no CPU speed: %v", err)
	}
	must.Positive(t, got.Cores)
	must.Positive(t, got.TotalMHz)
	t.Logf("cores %d, %.0f MHz in all, from %s", got.Cores, got.TotalMHz, got.Source)
}

func TestConfigSpec_cpuTotalCompute(t *testing.T) {
	var c Config
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {}`, &c)
	must.Eq(t, 0, c.CPUTotalCompute)

	c = Config{}
	hclutils.NewConfigParser(configSpec).ParseHCL(t, `config {
  cpu_total_compute = 9600
}`, &c)
	must.Eq(t, 9600, c.CPUTotalCompute)
}
