# A batch task in a group with bridge networking and a dns block: it prints
# the network devices its /sys shows, its network namespace, its eth0
# address and its /etc/resolv.conf.
job "{{.JobID}}" {
  type = "batch"

  group "g" {
    network {
      mode = "bridge"
      dns {
        servers  = ["192.0.2.53"]
        searches = ["ncsi.example"]
      }
    }

    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      attempts  = 0
      unlimited = false
    }

    task "t" {
      driver = "{{.Vars.Driver}}"

      config {
        command = "/bin/sh"
        args = ["-c", <<-EOT
          echo "devices=$(ls /sys/class/net | tr '\n' ' ')"
          echo "netns=$(readlink /proc/self/ns/net)"
          echo "eth0=$(ip -4 -o addr show dev eth0 | awk '{print $4}')"
          echo "resolv=$(grep -v '^#' /etc/resolv.conf | tr '\n' ';')"
          EOT
        ]
      }

      resources {
        cpu    = 50
        memory = 64
      }
    }
  }
}
