package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/nomad-driver-csi/nomad-driver-csi/driver"
	"github.com/nomad-driver-csi/nomad-driver-csi/driver/image"
)

// The image store's commands: images lists, images rm removes one no task
// uses, images pull pre-pulls as the driver would. rm and pull take the
// store's locks, so they are safe while the driver runs.

// imagesView is what `images -json` prints.
type imagesView struct {
	Images []image.Info `json:"images"`
}

// imagePullFlags are images pull's flags: by default the options the
// driver wrote (images/options.json).
type imagePullFlags struct {
	timeout       time.Duration
	username      string
	passwordStdin bool
	caFile        string
	insecure      string
	localDirs     string
	authConfig    string
	authHelper    string
}

func (f *imagePullFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.timeout, "timeout", 30*time.Minute, "give up the pull after this long")
	fs.StringVar(&f.username, "username", "", "the registry user (with -password-stdin); default: the plugin's auth config or helper")
	fs.BoolVar(&f.passwordStdin, "password-stdin", false, "read the registry password from stdin")
	fs.StringVar(&f.caFile, "registry-ca-file", "", "CA certificates (PEM) of the registry; default: the driver's registry_ca_file")
	fs.StringVar(&f.insecure, "insecure-registries", "", "comma-separated registries spoken to over plain HTTP; default: the driver's")
	fs.StringVar(&f.localDirs, "local-image-dirs", "", "comma-separated directories local references may name; default: the driver's")
	fs.StringVar(&f.authConfig, "auth-config", "", "a docker-style config.json; default: the driver's auth config")
	fs.StringVar(&f.authHelper, "auth-helper", "", "a credential helper (docker-credential-<name>); default: the driver's")
}

// storeOptions are the driver's image options with the flags over them.
func (f *imagePullFlags) storeOptions(rootDir string) (image.Options, error) {
	var o driver.ImageOptions
	b, err := os.ReadFile(driver.ImageOptionsFile(rootDir))
	switch {
	case err == nil:
		if err := json.Unmarshal(b, &o); err != nil {
			return image.Options{}, fmt.Errorf("the driver's image options %s are damaged: %w", driver.ImageOptionsFile(rootDir), err)
		}
	case !errors.Is(err, os.ErrNotExist):
		return image.Options{}, err
	}
	opts := o.StoreOptions()
	list := func(s string) []string {
		var out []string
		for _, p := range strings.Split(s, ",") {
			if p = strings.TrimSpace(p); p != "" {
				out = append(out, p)
			}
		}
		return out
	}
	if f.caFile != "" {
		opts.RegistryCAFile = f.caFile
	}
	if f.insecure != "" {
		opts.InsecureRegistries = list(f.insecure)
	}
	if f.localDirs != "" {
		opts.LocalDirs = list(f.localDirs)
	}
	if f.authConfig != "" {
		opts.AuthConfigFile = f.authConfig
	}
	if f.authHelper != "" {
		opts.AuthHelper = f.authHelper
	}
	return opts, nil
}

// imageLive says which tasks' leases hold: those with state under the
// root_dir, and those taken in the last startGrace (a task's lease is taken
// as its image is pulled, before its state exists).
func imageLive(rootDir string) image.Live {
	return func(u image.Use) bool {
		return driver.TaskExists(rootDir, u.TaskID) || time.Since(u.Since) < startGrace
	}
}

// startGrace is how long a lease counts as a task still starting.
const startGrace = 10 * time.Minute

// openImageStore opens the store of rootDir, or says there is none.
func openImageStore(rootDir string, opts image.Options) (*image.Store, error) {
	if _, err := os.Stat(image.Dir(rootDir)); err != nil {
		return nil, err
	}
	return image.Open(rootDir, opts)
}

func runImages(e *env, args []string) error {
	s, err := openImageStore(e.rootDir, image.Options{})
	var list []image.Info
	switch {
	case errors.Is(err, os.ErrNotExist):
		list = []image.Info{}
	case err != nil:
		return err
	default:
		if list, err = s.List(imageLive(e.rootDir)); err != nil {
			return err
		}
	}
	if e.json {
		return e.writeJSON(imagesView{Images: list})
	}
	p := Printable
	if len(list) == 0 {
		fmt.Fprintf(e.out, "No images in the store under %s.\n", p(e.rootDir))
		return nil
	}
	tw := tabwriter.NewWriter(e.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "REFERENCE\tDIGEST\tSIZE\tLAST USED\tIN USE BY")
	now := time.Now()
	for _, i := range list {
		ref := "-"
		if len(i.Refs) > 0 {
			ref = strings.Join(i.Refs, ", ")
		}
		used := "in use"
		if len(i.InUseBy) == 0 {
			used = humanize.RelTime(i.LastUsed, now, "ago", "from now")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", p(ref), p(shortDigest(i.Digest)), humanize.IBytes(uint64(i.Size)), used, p(usersOf(i.InUseBy)))
	}
	return tw.Flush()
}

func shortDigest(d string) string {
	if len(d) > 19 {
		return d[:19]
	}
	return d
}

// usersOf names the tasks of leases: alloc id (first 8) / task name.
func usersOf(uses []image.Use) string {
	if len(uses) == 0 {
		return "-"
	}
	var out []string
	for _, u := range uses {
		if u.AllocID != "" && u.TaskName != "" {
			alloc := u.AllocID
			if len(alloc) > 8 {
				alloc = alloc[:8]
			}
			out = append(out, alloc+"/"+u.TaskName)
		} else {
			out = append(out, u.TaskID)
		}
	}
	return strings.Join(out, ", ")
}

func runImagesRm(e *env, args []string) error {
	s, err := openImageStore(e.rootDir, image.Options{})
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("no image %q: there is no image store under %s", args[0], e.rootDir)
	}
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	info, err := s.Remove(ctx, args[0], imageLive(e.rootDir))
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(info)
	}
	fmt.Fprintf(e.out, "Removed image %s (%s)\n", Printable(strings.Join(info.Refs, ", ")), info.Digest)
	return nil
}

func runImagesPull(e *env, args []string, f *imagePullFlags, stdin io.Reader) error {
	opts, err := f.storeOptions(e.rootDir)
	if err != nil {
		return err
	}
	s, err := image.Open(e.rootDir, opts)
	if err != nil {
		return err
	}
	// As docker pull: a tag is asked of its registry even when the store
	// has what it named, which is how an operator moves a node to a tag
	// pushed again.
	req := image.PullRequest{ForcePull: true}
	if f.passwordStdin || f.username != "" {
		if !f.passwordStdin {
			return usagef("images pull: -username needs -password-stdin")
		}
		line, err := bufio.NewReader(stdin).ReadString('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("failed to read the password from stdin: %w", err)
		}
		req.Auth = &image.Credentials{Username: f.username, Password: strings.TrimRight(line, "\r\n")}
	}
	var last time.Time
	if !e.json {
		req.Progress = func(pr image.Progress) {
			if pr.Present || time.Since(last) < 2*time.Second {
				return
			}
			last = time.Now()
			fmt.Fprintf(e.out, "Downloading %s: %s of %s\n", Printable(pr.Ref), humanize.IBytes(uint64(pr.Done)), humanize.IBytes(uint64(pr.Total)))
		}
		req.Notify = func(msg string) { fmt.Fprintln(e.out, Printable(msg)) }
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.timeout)
	defer cancel()
	img, err := s.Pull(ctx, args[0], req)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(img)
	}
	fmt.Fprintf(e.out, "Pulled %s (%s, %d layers)\n", Printable(img.Ref), img.Digest, len(img.Layers))
	return nil
}
