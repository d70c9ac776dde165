// Built by rayproof clusters/embedded/build.py as the module rayproof.local/embedded/pause.
// pause: the PID 1 of a pod sandbox. It holds the sandbox's namespaces
// open and does nothing else: it reaps every child handed to it (orphans of
// a shared PID namespace), exits 0 on SIGINT or SIGTERM, and otherwise
// waits forever. Static (no cgo); the version is stamped at link time.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

var version = "unknown"

func reap() {
	for {
		var status syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "-v" || os.Args[1] == "--version") {
		fmt.Printf("rayproof pause %s\n", version)
		return
	}
	signals := make(chan os.Signal, 16)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	// After Notify: whoever reads this line knows SIGTERM now ends pause with 0.
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "pause: warning: not running as PID 1")
	}
	reap() // children that exited before the handler was in place
	for sig := range signals {
		if sig == syscall.SIGCHLD {
			reap()
			continue
		}
		fmt.Fprintf(os.Stderr, "pause: %v, exiting\n", sig)
		os.Exit(0)
	}
}
