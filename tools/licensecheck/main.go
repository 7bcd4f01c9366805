// Command licensecheck fails when a package the driver's binaries link
// carries a licence the project does not ship.
//
// For each platform and main package it asks `go list -deps` what the
// build links, exactly as that build sees it (GOOS, GOARCH, CGO_ENABLED and
// build tags), and reads the files that go into it: each package's Go,
// cgo, C, assembly and header files and the files it embeds, not the rest
// of its directory. A file fails when its header (the comments before the
// package clause of a Go file, the first lines of any other file) has an
// SPDX-License-Identifier outside the allowed list or names the Business
// Source License, the SSPL, the Elastic License or the Commons Clause. Each
// module that provides a linked package is classified by its licence file
// at the module root; a module with a forbidden licence, or none that the
// check recognises, fails too, and so does a module named in -deny-modules
// (one the tests use that the binaries must not link).
//
// Usage (from the module root):
//
//	go run ./tools/licensecheck [-platforms "linux/amd64 linux/arm64"] [-table] [-modules] [main packages...]
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
)

// allowedSPDX are the licences a linked file may carry: MPL-2.0 and the
// permissive licences it can be combined with in one binary.
var allowedSPDX = map[string]bool{
	"MPL-2.0": true, "Apache-2.0": true, "MIT": true, "BSD-2-Clause": true, "BSD-3-Clause": true,
	"ISC": true, "0BSD": true, "Unlicense": true, "CC0-1.0": true, "Zlib": true,
}

// forbiddenText are licences named in prose (no SPDX line) that fail a
// file or a module: source-available licences that are not open source.
var forbiddenText = []struct{ phrase, name string }{
	{"business source license", "BUSL"},
	{"server side public license", "SSPL"},
	{"elastic license", "Elastic License"},
	{"commons clause", "Commons Clause"},
}

// headerBytes bounds how much of a file that is not Go is read for its
// header.
const headerBytes = 4096

type pkg struct {
	ImportPath string
	Dir        string
	Standard   bool
	Module     *module
	GoFiles    []string
	CgoFiles   []string
	CFiles     []string
	CXXFiles   []string
	HFiles     []string
	SFiles     []string
	EmbedFiles []string
}

type module struct {
	Path    string
	Version string
	Dir     string
	Replace *module
}

// finding is one reason the check fails.
type finding struct {
	what, where, why string
}

func main() {
	platforms := flag.String("platforms", "linux/amd64 linux/arm64", "GOOS/GOARCH pairs to check, separated by spaces or commas")
	tags := flag.String("tags", "", "build tags the binaries are built with")
	cgo := flag.String("cgo", "0", "CGO_ENABLED of the builds")
	table := flag.Bool("table", false, "print each licence with the number of modules linked under it")
	list := flag.Bool("modules", false, "print each linked module with its licence")
	deny := flag.String("deny-modules", "", "modules the binaries must not link at all, separated by spaces or commas (test-only dependencies)")
	flag.Parse()
	denied := strings.FieldsFunc(*deny, func(r rune) bool { return r == ',' || r == ' ' })
	mains := flag.Args()
	if len(mains) == 0 {
		mains = []string{"."}
	}

	var findings []finding
	modules := map[string]string{} // module path -> licence
	packages := map[string]bool{}
	files := 0
	for _, platform := range strings.FieldsFunc(*platforms, func(r rune) bool { return r == ',' || r == ' ' }) {
		goos, goarch, ok := strings.Cut(platform, "/")
		if !ok {
			fatalf("platform %q must be GOOS/GOARCH", platform)
		}
		pkgs, err := listDeps(goos, goarch, *cgo, *tags, mains)
		if err != nil {
			fatalf("%v", err)
		}
		for _, p := range pkgs {
			packages[p.ImportPath] = true
			if p.Module != nil && slices.Contains(denied, p.Module.Path) {
				findings = append(findings, finding{p.ImportPath + " (" + platform + ")", p.Module.Path,
					"this module is for the tests only and must not be linked into the binaries"})
			}
			modPath, modDir := moduleOf(p)
			if _, seen := modules[modPath]; !seen {
				lic, err := moduleLicence(modDir)
				modules[modPath] = lic
				if err != nil {
					findings = append(findings, finding{modPath, modDir, err.Error()})
				}
			}
			for _, name := range buildFiles(p) {
				files++
				path := filepath.Join(p.Dir, name)
				why, err := checkFile(path)
				if err != nil {
					findings = append(findings, finding{p.ImportPath, path, err.Error()})
				} else if why != "" {
					findings = append(findings, finding{p.ImportPath + " (" + platform + ")", relToModule(path, modDir, modPath), why})
				}
			}
		}
	}

	if *list {
		var paths []string
		for path := range modules {
			paths = append(paths, path)
		}
		sort.Strings(paths)
		for _, path := range paths {
			fmt.Printf("%s\t%s\n", path, modules[path])
		}
	}
	if *table {
		printTable(modules)
	}
	if len(findings) > 0 {
		findings = dedupe(findings)
		fmt.Fprintf(os.Stderr, "licence check failed: %d finding(s) in what %s links:\n", len(findings), strings.Join(mains, " "))
		for _, f := range findings {
			fmt.Fprintf(os.Stderr, "  %s: %s: %s\n", f.what, f.where, f.why)
		}
		fmt.Fprintln(os.Stderr, "The binaries ship under MPL-2.0: a linked package must be MPL-2.0 or a permissive licence (tools/licensecheck).")
		os.Exit(1)
	}
	fmt.Printf("licence check: %d packages, %d files, %d modules linked by %s on %s: no forbidden licence\n",
		len(packages), files, len(modules), strings.Join(mains, " "), *platforms)
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "licensecheck: "+format+"\n", args...)
	os.Exit(2)
}

// listDeps is `go list -deps -json` of the main packages as one build of
// them sees it.
func listDeps(goos, goarch, cgo, tags string, mains []string) ([]pkg, error) {
	args := []string{"list", "-deps", "-json"}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	cmd := exec.Command("go", append(args, mains...)...)
	cmd.Env = append(os.Environ(), "GOOS="+goos, "GOARCH="+goarch, "CGO_ENABLED="+cgo, "GOFLAGS=-mod=readonly")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list -deps for %s/%s failed: %w: %s", goos, goarch, err, stderr.String())
	}
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, fmt.Errorf("failed to read go list's output: %w", err)
		}
		pkgs = append(pkgs, p)
	}
	return pkgs, nil
}

// moduleOf is the module a package comes from: the standard library is
// GOROOT, a replaced module is its replacement.
func moduleOf(p pkg) (path, dir string) {
	switch {
	case p.Standard:
		return "std", goroot()
	case p.Module == nil:
		return p.ImportPath, p.Dir
	case p.Module.Replace != nil:
		return p.Module.Path + " => " + p.Module.Replace.Path + " " + p.Module.Replace.Version, p.Module.Replace.Dir
	}
	return strings.TrimSpace(p.Module.Path + " " + p.Module.Version), p.Module.Dir
}

// goroot is the standard library's root as the go command sees it.
var goroot = sync.OnceValue(func() string {
	out, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		fatalf("go env GOROOT failed: %v", err)
	}
	return strings.TrimSpace(string(out))
})

func buildFiles(p pkg) []string {
	var out []string
	for _, list := range [][]string{p.GoFiles, p.CgoFiles, p.CFiles, p.CXXFiles, p.HFiles, p.SFiles, p.EmbedFiles} {
		out = append(out, list...)
	}
	return out
}

func relToModule(path, modDir, modPath string) string {
	if rel, err := filepath.Rel(modDir, path); err == nil && !strings.HasPrefix(rel, "..") {
		return modPath + ": " + rel
	}
	return path
}

var spdxLine = regexp.MustCompile(`SPDX-License-Identifier:\s*([^*\n]+)`)

// checkFile says why a file's header forbids it ("" when it does not).
func checkFile(path string) (string, error) {
	header, err := readHeader(path)
	if err != nil {
		return "", err
	}
	for _, m := range spdxLine.FindAllSubmatch(header, -1) {
		expr := strings.TrimSpace(string(m[1]))
		for _, id := range spdxIDs(expr) {
			if !allowedSPDX[id] {
				return fmt.Sprintf("SPDX-License-Identifier: %s (%s is not a licence the binary may link)", expr, id), nil
			}
		}
	}
	lower := bytes.ToLower(header)
	for _, f := range forbiddenText {
		if bytes.Contains(lower, []byte(f.phrase)) {
			return fmt.Sprintf("its header names the %s", f.name), nil
		}
	}
	return "", nil
}

// spdxIDs are the licence ids of an SPDX expression ("MIT OR Apache-2.0").
func spdxIDs(expr string) []string {
	var out []string
	exception := false
	for _, f := range strings.FieldsFunc(expr, func(r rune) bool { return r == ' ' || r == '(' || r == ')' }) {
		switch strings.ToUpper(f) {
		case "AND", "OR":
			continue
		case "WITH":
			// An exception only grants more.
			exception = true
			continue
		}
		if exception {
			exception = false
			continue
		}
		out = append(out, f)
	}
	return out
}

// readHeader is what precedes a Go file's package clause, or the first
// bytes of any other file.
func readHeader(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if !strings.HasSuffix(path, ".go") {
		buf := make([]byte, headerBytes)
		n, err := io.ReadFull(f, buf)
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			return nil, err
		}
		return buf[:n], nil
	}
	var header bytes.Buffer
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.HasPrefix(bytes.TrimSpace(line), []byte("package ")) {
			return header.Bytes(), nil
		}
		header.Write(line)
		header.WriteByte('\n')
	}
	return header.Bytes(), sc.Err()
}

// licenceFiles are the names a module's licence is found under.
var licenceFile = regexp.MustCompile(`(?i)^(licen[cs]e|copying|unlicense)([.-].*)?$`)

// moduleLicence classifies the licence files at a module's root.
func moduleLicence(dir string) (string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "unknown", fmt.Errorf("cannot read the module's directory: %w", err)
	}
	found := map[string]bool{}
	var forbidden []string
	for _, e := range entries {
		if e.IsDir() || !licenceFile.MatchString(e.Name()) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			return "unknown", err
		}
		for _, lic := range classify(data) {
			found[lic] = true
			if !allowedSPDX[lic] {
				forbidden = append(forbidden, e.Name()+" is "+lic)
			}
		}
	}
	var names []string
	for lic := range found {
		names = append(names, lic)
	}
	sort.Strings(names)
	lic := strings.Join(names, " AND ")
	switch {
	case len(forbidden) > 0:
		return lic, fmt.Errorf("module licence %s", strings.Join(forbidden, ", "))
	case len(names) == 0:
		return "unknown", errors.New("no licence file the check recognises at the module's root (LICENSE, COPYING): classify it by hand and extend tools/licensecheck")
	}
	return lic, nil
}

// classify names the licences a licence file holds, by their texts.
func classify(text []byte) []string {
	t := strings.Join(strings.Fields(strings.ToLower(string(text))), " ")
	var out []string
	has := strings.Contains
	for _, f := range forbiddenText {
		if has(t, f.phrase) {
			out = append(out, f.name)
		}
	}
	mpl := has(t, "mozilla public license version 2.0") || has(t, "mozilla public license, version 2.0")
	switch {
	case mpl:
		// Its text names the GNU licences as "Secondary Licenses".
		out = append(out, "MPL-2.0")
	case has(t, "gnu affero general public license"):
		out = append(out, "AGPL")
	case has(t, "gnu lesser general public license"), has(t, "gnu library general public license"):
		out = append(out, "LGPL")
	case has(t, "gnu general public license"):
		out = append(out, "GPL")
	}
	if has(t, "apache license") && has(t, "version 2.0") {
		out = append(out, "Apache-2.0")
	}
	if has(t, "permission is hereby granted, free of charge, to any person obtaining a copy") {
		out = append(out, "MIT")
	}
	if has(t, "redistribution and use in source and binary forms") {
		if has(t, "neither the name") || has(t, "names of its contributors") || has(t, "name of the copyright holder") {
			out = append(out, "BSD-3-Clause")
		} else {
			out = append(out, "BSD-2-Clause")
		}
	}
	if has(t, "permission to use, copy, modify, and/or distribute this software for any purpose") ||
		has(t, "permission to use, copy, modify, and distribute this software for any purpose") {
		out = append(out, "ISC")
	}
	if has(t, "this is free and unencumbered software released into the public domain") {
		out = append(out, "Unlicense")
	}
	return out
}

func printTable(modules map[string]string) {
	count := map[string]int{}
	for _, lic := range modules {
		count[lic]++
	}
	var lics []string
	for lic := range count {
		lics = append(lics, lic)
	}
	sort.Slice(lics, func(i, j int) bool {
		if count[lics[i]] != count[lics[j]] {
			return count[lics[i]] > count[lics[j]]
		}
		return lics[i] < lics[j]
	})
	fmt.Println("| licence | modules |")
	fmt.Println("| --- | --- |")
	for _, lic := range lics {
		fmt.Printf("| %s | %d |\n", lic, count[lic])
	}
}

func dedupe(in []finding) []finding {
	seen := map[string]bool{}
	var out []finding
	for _, f := range in {
		key := f.where + "\x00" + f.why
		if seen[key] {
			continue
		}
		seen[key] = true
		out = append(out, f)
	}
	return out
}
