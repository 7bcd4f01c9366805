# A long-running task that stops cleanly on its kill_signal.
job "ticker" {
  type = "service"

  group "ticker" {
    task "ticker" {
      driver       = "csi"
      kill_signal  = "SIGTERM"
      kill_timeout = "10s"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          trap 'echo "got SIGTERM, exiting"; exit 0' TERM
          while true; do date; sleep 5 & wait $!; done
        EOT
        ]
      }

      resources {
        cpu    = 100
        memory = 32
      }
    }
  }
}
