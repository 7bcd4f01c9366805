package main

import (
	"testing"

	"github.com/shoenig/test/must"
)

// --no-node-info makes a plugin the CSI spec allows only without
// PUBLISH_UNPUBLISH_VOLUME: the pair is refused.
func TestParseFlags_noNodeInfoNeedsNoControllerPublish(t *testing.T) {
	_, err := parseFlags([]string{"--endpoint", "unix:///x.sock", "--node-id", "n", "--no-node-info", "--controller-publish"})
	must.ErrorContains(t, err, "no-node-info cannot be used with controller-publish")
	cfg, err := parseFlags([]string{"--endpoint", "unix:///x.sock", "--node-id", "n", "--no-node-info", "--offline-expansion", "--no-publish-readonly"})
	must.NoError(t, err)
	must.True(t, cfg.noNodeInfo && cfg.offlineExpansion && cfg.noPublishReadonly)
}
