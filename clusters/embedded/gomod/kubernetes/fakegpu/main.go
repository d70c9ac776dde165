// Command fakegpu is the embedded platform's GPU device plugin: it advertises
// N devices of a resource (default nvidia.com/gpu) to the kubelet of its node
// through the kubelet device-plugin API (v1beta1), and hands each container
// the distinct device ids kubelet allocated to it, as NVIDIA's plugin does:
// in NVIDIA_VISIBLE_DEVICES, and in the annotation rayproof.dev/gpu-devices.
// There is no device behind an id; what is real is the allocation: kubelet's
// accounting, the scheduler's, and the ids a container sees.
//
// It runs in the node's mount namespace (kubelet's device-plugin directory is
// the node's own), registers, and registers again whenever kubelet restarts
// (kubelet removes every plugin socket when it starts).
//
// Written for rayproof (clusters/embedded/nodes/); built with the platform's
// Kubernetes module graph (k8s.io/kubelet, google.golang.org/grpc).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change
	return nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		ids := strings.Join(c.DevicesIds, ",")
		log.Printf("allocate %s", ids)
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs:        map[string]string{"NVIDIA_VISIBLE_DEVICES": ids},
			Annotations: map[string]string{"rayproof.dev/gpu-devices": ids},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func serve(socket string, p *plugin) (*grpc.Server, error) {
	_ = os.Remove(socket)
	lis, err := net.Listen("unix", socket)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	return srv, nil
}

func register(dir, endpoint, resource string) error {
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
		Options: &pluginapi.DevicePluginOptions{},
	})
	return err
}

func main() {
	count := flag.Int("count", 8, "devices to advertise")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	prefix := flag.String("id-prefix", "", "device ids are <prefix>gpu-<n> (make them distinct per node)")
	dir := flag.String("dir", pluginapi.DevicePluginPath, "kubelet's device-plugin directory")
	flag.Parse()

	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("%sgpu-%d", *prefix, i), Health: pluginapi.Healthy})
	}
	endpoint := "rayproof-fakegpu.sock"
	socket := filepath.Join(*dir, endpoint)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)

	var srv *grpc.Server
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		// (Re)start and register whenever our socket is gone: at start, and after kubelet restarted.
		if _, err := os.Stat(socket); err != nil {
			if srv != nil {
				srv.Stop()
			}
			var err error
			if srv, err = serve(socket, p); err != nil {
				log.Printf("serving %s: %v", socket, err)
			} else if err = register(*dir, endpoint, *resource); err != nil {
				log.Printf("registering %s with kubelet: %v (retrying)", *resource, err)
				_ = os.Remove(socket)
			} else {
				log.Printf("registered %d x %s with kubelet", *count, *resource)
			}
		}
		select {
		case <-stop:
			if srv != nil {
				srv.Stop()
			}
			_ = os.Remove(socket)
			return
		case <-tick.C:
		}
	}
}
