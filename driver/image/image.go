// Package image pulls OCI images into a content-addressed store under the
// driver's root_dir and hands out what a task needs to use one as its root:
// the unpacked layers, lowest first, and the image's run configuration.
//
// The task root (driver/executor) knows images only through Image: an
// overlay of Layers (read-only) with a writable layer of the task's own,
// and Config as the defaults of command, arguments, environment, working
// directory and user.
package image

// Image is a pulled, verified and unpacked image, ready to be a task's root.
type Image struct {
	// Ref is the reference as the job wrote it ("registry.example/csi:1.2",
	// "oci-archive:/srv/images/csi.tar").
	Ref string
	// Digest is the digest of the image's manifest for the node's platform
	// ("sha256:..."): what privileged_grant's image matches.
	Digest string
	// IndexDigest is the digest of the multi-platform index Digest was
	// picked from ("" when the reference named a single manifest): what an
	// operator who pinned the index matches.
	IndexDigest string
	// Layers are the absolute host paths of the image's unpacked layers,
	// lowest (the base) first. Each is a directory the store owns and
	// shares with every image that has the layer; nothing may write in it.
	Layers []string
	// Config is the image's run configuration.
	Config Config
}

// Config is the part of an OCI image configuration that says how to run
// the image (the image-spec's config.Entrypoint, Cmd, Env, WorkingDir,
// User and StopSignal, as written in the image).
type Config struct {
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	User       string
	// StopSignal is the signal the image asks to be stopped with
	// (Dockerfile's STOPSIGNAL: "SIGTERM", "TERM" or "15"), "" for none.
	StopSignal string `json:",omitempty"`
}
