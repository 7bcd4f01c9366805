// Command docscheck checks the project's documentation (README.md,
// CHANGELOG.md and docs/*.md): every relative link resolves to a file of the
// repository and, with a #fragment, to a heading of that file; and every
// HCL example a page of README.md or docs/ shows is a verbatim excerpt of a
// file under examples/, which the end-to-end tests validate. It prints one
// line per problem and exits 1 when there is any. Run from anywhere inside
// the repository: go run ./tools/docscheck [-root DIR].
package main

import (
	"flag"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"unicode"
)

func main() {
	root := flag.String("root", ".", "the repository's root directory")
	flag.Parse()
	problems, err := Check(os.DirFS(*root))
	if err != nil {
		fmt.Fprintln(os.Stderr, "docscheck:", err)
		os.Exit(2)
	}
	for _, p := range problems {
		fmt.Println(p)
	}
	if len(problems) > 0 {
		fmt.Printf("docscheck: %d problem(s) in the documentation\n", len(problems))
		os.Exit(1)
	}
}

// Problem is one broken link or example, at a line of a page.
type Problem struct {
	File string
	Line int
	Msg  string
}

func (p Problem) String() string { return fmt.Sprintf("%s:%d: %s", p.File, p.Line, p.Msg) }

// examplesDir holds the files a page's HCL examples must come from.
const examplesDir = "examples"

// Check checks the pages of the repository rooted at repo.
func Check(repo fs.FS) ([]Problem, error) {
	pages, err := fs.Glob(repo, "docs/*.md")
	if err != nil {
		return nil, err
	}
	pages = append([]string{"README.md", "CHANGELOG.md"}, pages...)
	examples, err := exampleFiles(repo)
	if err != nil {
		return nil, err
	}
	c := &checker{repo: repo, anchors: map[string]map[string]bool{}}
	var out []Problem
	for _, page := range pages {
		src, err := fs.ReadFile(repo, page)
		if err != nil {
			if page == "CHANGELOG.md" && os.IsNotExist(err) {
				continue
			}
			return nil, err
		}
		doc := parse(string(src))
		for _, l := range doc.links {
			if msg := c.checkLink(page, l.target); msg != "" {
				out = append(out, Problem{File: page, Line: l.line, Msg: msg})
			}
		}
		if page == "CHANGELOG.md" {
			continue
		}
		for _, b := range doc.blocks {
			if b.lang != "hcl" {
				continue
			}
			if !excerptOfAny(b.lines, examples) {
				out = append(out, Problem{File: page, Line: b.line,
					Msg: "this hcl example is not an excerpt of any file under examples/ (copy its lines verbatim from the file the tests validate)"})
			}
		}
	}
	return out, nil
}

// exampleFiles reads every HCL file under examples/, split into lines.
func exampleFiles(repo fs.FS) (map[string][]string, error) {
	out := map[string][]string{}
	err := fs.WalkDir(repo, examplesDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || !strings.HasSuffix(p, ".hcl") {
			return nil
		}
		b, err := fs.ReadFile(repo, p)
		if err != nil {
			return err
		}
		out[p] = splitLines(string(b))
		return nil
	})
	return out, err
}

func splitLines(s string) []string {
	lines := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, " \t\r")
	}
	return lines
}

// excerptOfAny says whether block is a run of consecutive lines of one of
// the files.
func excerptOfAny(block []string, files map[string][]string) bool {
	if len(block) == 0 {
		return false
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		lines := files[n]
	next:
		for i := 0; i+len(block) <= len(lines); i++ {
			for j, l := range block {
				if lines[i+j] != l {
					continue next
				}
			}
			return true
		}
	}
	return false
}

type link struct {
	target string
	line   int
}

type block struct {
	lang  string
	lines []string
	line  int
}

type document struct {
	links    []link
	blocks   []block
	headings []string
	ids      []string
}

var (
	// inlineLink matches [text](target) and ![alt](target), with an
	// optional "title".
	inlineLink = regexp.MustCompile(`!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	// refDef matches a reference definition: [label]: target.
	refDef   = regexp.MustCompile(`^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$`)
	heading  = regexp.MustCompile(`^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$`)
	codeSpan = regexp.MustCompile("`+[^`]*`+")
	htmlID   = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	fence    = regexp.MustCompile("^\\s{0,3}(```+|~~~+)\\s*([A-Za-z0-9_+-]*)")
)

// parse finds a page's links (outside code), fenced blocks and headings.
func parse(src string) document {
	var d document
	lines := strings.Split(src, "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if m := fence.FindStringSubmatch(l); m != nil {
			b := block{lang: strings.ToLower(m[2]), line: i + 1}
			marker := m[1]
			for i++; i < len(lines); i++ {
				if strings.HasPrefix(strings.TrimLeft(lines[i], " "), marker) {
					break
				}
				b.lines = append(b.lines, strings.TrimRight(lines[i], " \t\r"))
			}
			d.blocks = append(d.blocks, b)
			continue
		}
		if m := heading.FindStringSubmatch(l); m != nil {
			d.headings = append(d.headings, m[2])
		}
		for _, m := range htmlID.FindAllStringSubmatch(l, -1) {
			d.ids = append(d.ids, m[1])
		}
		text := codeSpan.ReplaceAllString(l, "")
		for _, m := range inlineLink.FindAllStringSubmatch(text, -1) {
			d.links = append(d.links, link{target: m[1], line: i + 1})
		}
		if m := refDef.FindStringSubmatch(text); m != nil {
			d.links = append(d.links, link{target: m[1], line: i + 1})
		}
	}
	return d
}

type checker struct {
	repo    fs.FS
	anchors map[string]map[string]bool
}

var scheme = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)

// checkLink returns what is wrong with a link of page to target, or "".
func (c *checker) checkLink(page, target string) string {
	if scheme.MatchString(target) {
		return "" // http(s), mailto: not checked here
	}
	file, frag, _ := strings.Cut(target, "#")
	file, err := url.PathUnescape(file)
	if err != nil {
		return fmt.Sprintf("link %q: %v", target, err)
	}
	dest := page
	if file != "" {
		if strings.HasPrefix(file, "/") {
			return fmt.Sprintf("link %q is absolute: write it relative to %s", target, page)
		}
		dest = path.Clean(path.Join(path.Dir(page), file))
		if dest == ".." || strings.HasPrefix(dest, "../") {
			return fmt.Sprintf("link %q leaves the repository", target)
		}
		if _, err := fs.Stat(c.repo, strings.TrimSuffix(dest, "/")); err != nil {
			return fmt.Sprintf("link %q: %s does not exist", target, dest)
		}
	}
	if frag == "" {
		return ""
	}
	if !strings.HasSuffix(dest, ".md") {
		return fmt.Sprintf("link %q has a #fragment but %s is not a markdown page", target, dest)
	}
	anchors, err := c.anchorsOf(dest)
	if err != nil {
		return fmt.Sprintf("link %q: %v", target, err)
	}
	if !anchors[frag] {
		return fmt.Sprintf("link %q: %s has no heading with the anchor #%s", target, dest, frag)
	}
	return ""
}

func (c *checker) anchorsOf(page string) (map[string]bool, error) {
	if a, ok := c.anchors[page]; ok {
		return a, nil
	}
	src, err := fs.ReadFile(c.repo, filepath.ToSlash(page))
	if err != nil {
		return nil, err
	}
	d := parse(string(src))
	a := map[string]bool{}
	seen := map[string]int{}
	for _, h := range d.headings {
		s := Slug(h)
		if n := seen[s]; n > 0 {
			a[fmt.Sprintf("%s-%d", s, n)] = true
		} else {
			a[s] = true
		}
		seen[s]++
	}
	for _, id := range d.ids {
		a[id] = true
	}
	c.anchors[page] = a
	return a, nil
}

var mdLink = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)

// Slug is the anchor GitHub gives a heading: its text without markup,
// lower case, every character but letters, digits, '-', '_' and spaces
// dropped, spaces made '-'.
func Slug(h string) string {
	h = mdLink.ReplaceAllString(h, "$1")
	h = strings.ToLower(h)
	var b strings.Builder
	for _, r := range h {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mn, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
