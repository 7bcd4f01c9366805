# A batch job run by the csi driver: it prints where it runs and exits.
job "hello" {
  type = "batch"

  group "hello" {
    task "hello" {
      driver = "csi"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo \"hello from $NOMAD_TASK_NAME (pid $$) in $(pwd)\"; id -u"]
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
