# A parameterized batch job (e2e/e2e_test.go, TestDispatchedChildGrant):
# each dispatch runs a child whose task "t" names volume_id "v" of plugin
# "nowhere". The agent's volume_grant does not grant it: the child is
# refused at its start, before any CSI call, and nothing else happens.
job "{{.JobID}}" {
  type = "batch"

  parameterized {}

  group "g" {
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "t" {
      driver = "csi"

      config {
        command = "/bin/true"

        volume "data" {
          plugin_id   = "nowhere"
          volume_id   = "v"
          destination = "/data"
          access_mode = "single-node-writer"
        }
      }

      resources {
        cpu    = 20
        memory = 32
      }
    }
  }
}
