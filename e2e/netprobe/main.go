// Command netprobe is the network end-to-end tests' server and client, run
// as a task (the machine has no nc or busybox, and a task's root has no
// interpreter to count on).
//
//	netprobe serve NAME ADDR...  listens on each TCP address and answers
//	                             every connection with "netprobe NAME ADDR"
//	netprobe dial ADDR...        connects to each address and prints one
//	                             line "ADDR=ok NAME" or "ADDR=fail REASON"
//	netprobe get URL [TOKEN]     GETs an http:// URL, or a path over a unix
//	                             socket (unix:///socket/path:/url/path), with
//	                             the bearer token when given, and prints
//	                             "GET status=CODE" or "GET fail REASON", then
//	                             the body
//
// serve prints "listening ADDR" for each address once it listens and runs
// until it is killed; dial always exits 0 once every address is tried.
package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"time"
)

// dialTimeout bounds one connection attempt: an address that drops
// packets reports "timeout" rather than hanging the task.
const dialTimeout = 3 * time.Second

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: netprobe serve NAME ADDR... | netprobe dial ADDR... | netprobe get URL [TOKEN]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		if len(os.Args) < 4 {
			fmt.Fprintln(os.Stderr, "netprobe serve needs a name and at least one address")
			os.Exit(2)
		}
		if err := serve(os.Args[2], os.Args[3:]); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	case "dial":
		for _, addr := range os.Args[2:] {
			fmt.Printf("%s=%s\n", addr, dial(addr))
		}
	case "get":
		token := ""
		if len(os.Args) > 3 {
			token = os.Args[3]
		}
		get(os.Args[2], token)
	default:
		fmt.Fprintf(os.Stderr, "netprobe: unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
}

func serve(name string, addrs []string) error {
	var ls []net.Listener
	for _, addr := range addrs {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("failed to listen on %s: %w", addr, err)
		}
		ls = append(ls, l)
	}
	for i, l := range ls {
		fmt.Printf("listening %s\n", addrs[i])
		go func(addr string, l net.Listener) {
			for {
				c, err := l.Accept()
				if err != nil {
					fmt.Fprintf(os.Stderr, "accept on %s: %v\n", addr, err)
					return
				}
				_, _ = fmt.Fprintf(c, "netprobe %s %s\n", name, addr)
				_ = c.Close()
			}
		}(addrs[i], l)
	}
	select {}
}

// dial says what became of a connection to addr: "ok NAME" with the name
// the server answered, or "fail REASON".
func dial(addr string) string {
	c, err := net.DialTimeout("tcp", addr, dialTimeout)
	if err != nil {
		return "fail " + reason(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(dialTimeout))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "fail read: " + reason(err)
	}
	f := strings.Fields(line)
	if len(f) < 2 || f[0] != "netprobe" {
		return fmt.Sprintf("fail unexpected answer %q", line)
	}
	return "ok " + f[1]
}

// get GETs url (http://HOST/PATH, or unix:///SOCKET:/PATH) and prints the
// status and the body; it always exits 0.
func get(url, token string) {
	tr := &http.Transport{}
	if rest, ok := strings.CutPrefix(url, "unix://"); ok {
		sock, path, _ := strings.Cut(rest, ":")
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		}
		url = "http://unix" + path
	}
	c := http.Client{Timeout: dialTimeout, Transport: tr}
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		fmt.Printf("GET fail %s\n", reason(err))
		return
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		fmt.Printf("GET fail %s\n", reason(err))
		return
	}
	defer resp.Body.Close()
	fmt.Printf("GET status=%d\n", resp.StatusCode)
	_, _ = io.Copy(os.Stdout, io.LimitReader(resp.Body, 1<<20))
	fmt.Println()
}

func reason(err error) string {
	var ne net.Error
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "refused"
	case errors.Is(err, syscall.EACCES):
		return "permission denied"
	case errors.Is(err, syscall.ENOENT):
		return "no such file"
	case errors.Is(err, syscall.ENETUNREACH), errors.Is(err, syscall.EHOSTUNREACH):
		return "unreachable"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	}
	return strings.ReplaceAll(err.Error(), "\n", " ")
}
