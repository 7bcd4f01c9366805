package main

import (
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/nomad/plugins"
	"golang.org/x/sys/unix"
	_ "github.com/creack/pty"
	_ "github.com/shoenig/test/must"
)

var _ = unix.Getpid

func main() { plugins.Serve(func(l hclog.Logger) interface{} { return nil }) }
