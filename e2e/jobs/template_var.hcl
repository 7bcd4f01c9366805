# A service task whose template reads a Nomad variable, for the driver
# restart case: when the variable is gone, a restored task's template hook
# blocks, and Nomad recovers the task only once the hook returns.
job "{{.JobID}}" {
  type = "service"

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    task "t" {
      driver = "{{.Vars.Driver}}"

      template {
        data            = "[[[ with nomadVar \"nomad/jobs/{{.JobID}}\" ]]][[[ .k ]]][[[ end ]]]"
        destination     = "local/k"
        change_mode     = "noop"
        left_delimiter  = "[[["
        right_delimiter = "]]]"
      }

      config {
        command = "/bin/sh"
        args    = ["-c", "echo started; i=0; while :; do i=$((i+1)); echo tick $i; sleep 1; done"]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
