// This module pins the csi-test v3.1.1 mock driver for the CSI end-to-end tests;
// e2e/tools/build.sh builds its tools into build/csi/. It is a module of its
// own because the CSI tools' spec and gRPC requirements conflict.
module github.com/nomad-driver-csi/nomad-driver-csi/e2e/tools/mockdriver

go 1.26

require github.com/kubernetes-csi/csi-test/v3 v3.1.1 // indirect

require (
	github.com/container-storage-interface/spec v1.2.0 // indirect
	github.com/golang/mock v1.3.1 // indirect
	github.com/golang/protobuf v1.3.2 // indirect
	github.com/konsorten/go-windows-terminal-sequences v1.0.2 // indirect
	github.com/robertkrimen/otto v0.0.0-20191219234010-c382bd3c16ff // indirect
	github.com/sirupsen/logrus v1.4.2 // indirect
	golang.org/x/net v0.0.0-20191112182307-2180aed22343 // indirect
	golang.org/x/sys v0.0.0-20191113165036-4c7a9d0fe056 // indirect
	golang.org/x/text v0.3.2 // indirect
	google.golang.org/genproto v0.0.0-20191114150713-6bbd007550de // indirect
	google.golang.org/grpc v1.25.1 // indirect
	gopkg.in/sourcemap.v1 v1.0.5 // indirect
	gopkg.in/yaml.v2 v2.2.5 // indirect
)

tool github.com/kubernetes-csi/csi-test/v3/cmd/mock-driver
