package driver

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"
)

// The MHz of one core turn a task's CPU share into the "ticks" (MHz) Nomad
// shows in `nomad alloc status -stats`. Nomad 1.7 and later send the node's
// CPU topology with the plugin's configuration; the plugin SDK this driver
// is built against (v1.6, the last one under MPL-2.0) does not receive it,
// so the driver reads what the kernel says itself, as the Nomad client's
// own CPU fingerprint does, in the same order for each online core:
//
//  1. the core's base (nominal) frequency: acpi_cppc/nominal_freq where the
//     cpufreq driver is acpi-cpufreq, cpufreq/base_frequency otherwise
//     (intel_pstate writes it);
//  2. cpufreq/cpuinfo_max_freq, the highest frequency cpufreq allows;
//  3. the "cpu MHz" line of /proc/cpuinfo.
//
// Where this can be wrong, and cpu_total_compute (the agent's option of the
// same name, in the same unit) should say what the agent says:
//   - cpuinfo_max_freq is the boost frequency where there is no base
//     frequency: above what a core sustains under load.
//   - Without cpufreq (most virtual machines), "cpu MHz" is what the kernel
//     measured or the hypervisor reports, which may be the host's nominal
//     speed, a momentary frequency, or neither; it is not the share of a
//     host core a virtual CPU gets.
//   - arm64 kernels print no "cpu MHz": without cpufreq nothing is known,
//     and CPU ticks stay 0 until cpu_total_compute is set.
//   - Cores of different speeds (performance and efficiency cores) are
//     averaged, as Nomad averages its total compute over all cores.
//   - An agent with cpu_total_compute set reports that figure, which the
//     driver only knows when its own cpu_total_compute repeats it.

// cpuSpeed is what measureCPU found.
type cpuSpeed struct {
	// Cores is the number of online logical cores.
	Cores int
	// TotalMHz is the sum of the cores' speeds; 0 when no source had one.
	TotalMHz float64
	// Source says where the first core's speed came from (for the log).
	Source string
}

// mhzPerCore is the speed of an average core, given the operator's
// cpu_total_compute (0: the measured speeds).
func (s cpuSpeed) mhzPerCore(totalCompute int) float64 {
	if s.Cores <= 0 {
		return 0
	}
	if totalCompute > 0 {
		return float64(totalCompute) / float64(s.Cores)
	}
	return s.TotalMHz / float64(s.Cores)
}

const (
	sysCPUDir   = "sys/devices/system/cpu"
	procCPUInfo = "proc/cpuinfo"
)

// errNoCPUSpeed is measureCPU's error when no source gave any speed.
var errNoCPUSpeed = errors.New("neither cpufreq in sysfs nor /proc/cpuinfo gives the CPU speed")

// measureCPU reads the online cores and their speeds from root, a tree
// laid out as "/" (os.DirFS("/") in production, a fake in tests). It
// counts the cores even when it finds no speed, and then returns
// errNoCPUSpeed.
func measureCPU(root fs.FS) (cpuSpeed, error) {
	info := readCPUInfo(root)
	cores, err := onlineCores(root)
	if err != nil {
		if len(info.ids) == 0 {
			return cpuSpeed{}, fmt.Errorf("failed to count the CPU cores: %w", err)
		}
		cores = info.ids
	}
	out := cpuSpeed{Cores: len(cores)}
	for _, core := range cores {
		mhz, source := coreMHz(root, core, info)
		if mhz <= 0 {
			continue
		}
		out.TotalMHz += mhz
		if out.Source == "" {
			out.Source = source
		}
	}
	if out.TotalMHz <= 0 {
		return out, errNoCPUSpeed
	}
	return out, nil
}

// coreMHz is one core's speed and where it came from (0 when unknown).
func coreMHz(root fs.FS, core int, info cpuInfo) (float64, string) {
	dir := fmt.Sprintf("%s/cpu%d", sysCPUDir, core)
	if readTrimmed(root, dir+"/cpufreq/scaling_driver") == "acpi-cpufreq" {
		if mhz := readNumber(root, dir+"/acpi_cppc/nominal_freq"); mhz > 0 {
			return mhz, "acpi_cppc/nominal_freq"
		}
	} else if khz := readNumber(root, dir+"/cpufreq/base_frequency"); khz > 0 {
		return khz / 1000, "cpufreq/base_frequency"
	}
	if khz := readNumber(root, dir+"/cpufreq/cpuinfo_max_freq"); khz > 0 {
		return khz / 1000, "cpufreq/cpuinfo_max_freq"
	}
	if mhz, ok := info.mhz[core]; ok && mhz > 0 {
		return mhz, "/proc/cpuinfo"
	}
	// A core /proc/cpuinfo lists without a speed of its own: the first
	// speed it gives, as the cores of one package run alike.
	if info.first > 0 {
		return info.first, "/proc/cpuinfo"
	}
	return 0, ""
}

// onlineCores parses sysfs's list of online cores ("0-3,6,8-9").
func onlineCores(root fs.FS) ([]int, error) {
	data, err := fs.ReadFile(root, sysCPUDir+"/online")
	if err != nil {
		return nil, err
	}
	return parseCPUList(strings.TrimSpace(string(data)))
}

func parseCPUList(s string) ([]int, error) {
	var out []int
	for _, part := range strings.Split(s, ",") {
		if part == "" {
			continue
		}
		lo, hi, isRange := strings.Cut(part, "-")
		first, err := strconv.Atoi(lo)
		if err != nil || first < 0 {
			return nil, fmt.Errorf("cpu list %q: %q is not a core number", s, lo)
		}
		last := first
		if isRange {
			if last, err = strconv.Atoi(hi); err != nil || last < first {
				return nil, fmt.Errorf("cpu list %q: %q is not a range of cores", s, part)
			}
		}
		for c := first; c <= last; c++ {
			out = append(out, c)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("cpu list %q names no core", s)
	}
	return out, nil
}

// cpuInfo is what /proc/cpuinfo says of the cores: their ids, and the
// speed of those that have a "cpu MHz" line.
type cpuInfo struct {
	ids   []int
	mhz   map[int]float64
	first float64
}

func readCPUInfo(root fs.FS) cpuInfo {
	info := cpuInfo{mhz: map[int]float64{}}
	data, err := fs.ReadFile(root, procCPUInfo)
	if err != nil {
		return info
	}
	core := -1
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		key, value, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		key, value = strings.TrimSpace(key), strings.TrimSpace(value)
		switch key {
		case "processor":
			if n, err := strconv.Atoi(value); err == nil && n >= 0 {
				core = n
				info.ids = append(info.ids, n)
			}
		case "cpu MHz":
			mhz, err := strconv.ParseFloat(value, 64)
			if err != nil || mhz <= 0 {
				continue
			}
			if info.first == 0 {
				info.first = mhz
			}
			if core >= 0 {
				info.mhz[core] = mhz
			}
		}
	}
	return info
}

func readTrimmed(root fs.FS, name string) string {
	data, err := fs.ReadFile(root, name)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(data))
}

// readNumber is a sysfs file's whole number, 0 when it is missing or not a
// number.
func readNumber(root fs.FS, name string) float64 {
	n, err := strconv.ParseUint(readTrimmed(root, name), 10, 64)
	if err != nil {
		return 0
	}
	return float64(n)
}
