package driver

import "path/filepath"

// Where the driver keeps things under a root_dir, for tools that look at a
// node from outside (the operator CLI).

// PluginSocketPath is the host path of the socket of the plugin task with
// the csi_plugin id id.
func PluginSocketPath(rootDir, id string) string {
	return (&Config{RootDir: rootDir}).pluginSocket(id)
}

// JournalDir is the volume journal's directory.
func JournalDir(rootDir string) string { return filepath.Join(rootDir, "journal") }

// StageRoot is the directory every volume is staged and published under.
func StageRoot(rootDir string) string { return (&Config{RootDir: rootDir}).stageRoot() }

// TaskStateDir is the directory a task's state lives in while the task
// exists (a task of this driver, or one a restarted driver is to recover).
func TaskStateDir(rootDir, taskID string) string {
	return (&Config{RootDir: rootDir}).taskStateDir(taskID)
}
