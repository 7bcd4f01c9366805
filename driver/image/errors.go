package image

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"syscall"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// What a pull can fail with, for errors.Is. The errors a pull returns are
// one sentence each, naming the reference and what would fix it.
var (
	ErrNotFound       = errors.New("image not found")
	ErrUnauthorized   = errors.New("registry refused the credentials")
	ErrDigestMismatch = errors.New("content does not match its digest")
	ErrPlatform       = errors.New("no image for this node's platform")
	ErrUnreachable    = errors.New("registry unreachable")
	ErrUntrusted      = errors.New("registry certificate not trusted")
	ErrTooLarge       = errors.New("image exceeds the store's bounds")
	ErrNotAllowed     = errors.New("image source not allowed")
	ErrInvalid        = errors.New("invalid image")
	ErrInUse          = errors.New("image in use")
	ErrStoreFull      = errors.New("image store full")
)

// Error is a failed pull or store operation: Kind says which (one of the
// Err values above), the message says it to a person.
type Error struct {
	Kind error
	msg  string
	// cause is what the message is about, when errors.Is should find it
	// too (ENOSPC); its text is in the message.
	cause error
}

func (e *Error) Error() string { return e.msg }

func (e *Error) Unwrap() error { return e.cause }

func (e *Error) Is(target error) bool { return target == e.Kind }

func errorf(kind error, format string, args ...any) error {
	return &Error{Kind: kind, msg: fmt.Sprintf(format, args...)}
}

// kindOf says which kind err is (nil when none).
func kindOf(err error) error {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return nil
}

// Refused reports whether err, a pull's error, is a registry's answer
// that refuses the request itself: any 4xx status but 408 and 429. Of
// these, 401, 403 and 404 get kinds of their own (classify); the rest the
// store counts as unreachable all the same (an earlier pull of the tag is
// served from the store, see fallback), but asking again later gets the
// same answer.
func Refused(err error) bool {
	var se *statusError
	return errors.As(err, &se) && se.code >= 400 && se.code < 500 &&
		se.code != http.StatusRequestTimeout && se.code != http.StatusTooManyRequests
}

// statusError is a registry's answer that is not what was asked for.
type statusError struct {
	code int
	// codes are the registry's error codes (MANIFEST_UNKNOWN, ...), never
	// its messages: those are the registry's text.
	codes []string
}

func (e *statusError) Error() string {
	s := fmt.Sprintf("%d %s", e.code, http.StatusText(e.code))
	for _, c := range e.codes {
		s += " " + c
	}
	return s
}

func newStatusError(err *transport.Error) *statusError {
	se := &statusError{code: err.StatusCode}
	for _, d := range err.Errors {
		if len(se.codes) < 4 && len(d.Code) < 64 {
			se.codes = append(se.codes, string(d.Code))
		}
	}
	return se
}

// transient says whether a failed registry call may succeed if tried again:
// the network, a timeout, a registry that is busy or restarting.
func transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	var se *statusError
	if errors.As(err, &se) {
		switch se.code {
		case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusInternalServerError,
			http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			return true
		}
		return false
	}
	var ra *refusedAddrError
	if kindOf(err) != nil || certError(err) || errors.As(err, &ra) {
		return false
	}
	// The network's errors only: a syscall.Errno is a net.Error too, and
	// a full disk is not tried again.
	var (
		oe  *net.OpError
		dns *net.DNSError
		ne  net.Error
		en  syscall.Errno
	)
	if errors.As(err, &oe) || errors.As(err, &dns) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	return errors.As(err, &ne) && ne.Timeout() && !errors.As(err, &en)
}

func certError(err error) bool { return certCause(err) != nil }

// certCause is the TLS error in err (nil when none): the certificate's
// verification, or a server that does not speak TLS.
func certCause(err error) error {
	var (
		tv  *tls.CertificateVerificationError
		ua  x509.UnknownAuthorityError
		hn  x509.HostnameError
		ci  x509.CertificateInvalidError
		rec tls.RecordHeaderError
	)
	switch {
	case errors.As(err, &tv):
		return tv
	case errors.As(err, &ua):
		return ua
	case errors.As(err, &hn):
		return hn
	case errors.As(err, &ci):
		return ci
	case errors.As(err, &rec):
		return rec
	}
	return nil
}

// classify turns a registry call's error into the sentence a user reads.
func classify(ref Reference, what string, err error) error {
	if kindOf(err) != nil {
		return err
	}
	if ref.Local() {
		if errors.Is(err, context.DeadlineExceeded) {
			return errorf(ErrUnreachable, "failed to read image %q: it did not finish within image_pull_timeout; raise image_pull_timeout", ref.Raw)
		}
		return errorf(ErrInvalid, "failed to read image %q while reading %s: %v", ref.Raw, what, err)
	}
	reg := ref.Registry()
	var se *statusError
	if errors.As(err, &se) {
		switch se.code {
		case http.StatusUnauthorized:
			return errorf(ErrUnauthorized, "failed to pull image %q: registry %s refused the credentials (401 Unauthorized); check the task's auth block, or the plugin's auth config or helper for %s", ref.Raw, reg, reg)
		case http.StatusForbidden:
			return errorf(ErrUnauthorized, "failed to pull image %q: registry %s denied access to %s (403 Forbidden); use credentials that may pull it in the task's auth block or the plugin's auth config", ref.Raw, reg, what)
		case http.StatusNotFound:
			return errorf(ErrNotFound, "image %q not found: registry %s has no such repository, tag or digest; check the reference", ref.Raw, reg)
		}
		// The status goes along (Refused): not its text, which the
		// message has.
		return &Error{Kind: ErrUnreachable, cause: se,
			msg: fmt.Sprintf("failed to pull image %q: registry %s unreachable: it answered %s for %s; retry later or ask its operator", ref.Raw, reg, se, what)}
	}
	var ra *refusedAddrError
	if errors.As(err, &ra) {
		return errorf(ErrNotAllowed, "failed to pull image %q while fetching %s from registry %s: %v; a pull never reaches a link-local address, nor a loopback or private one unless the registry it names is on one", ref.Raw, what, reg, ra)
	}
	if certError(err) {
		return errorf(ErrUntrusted, "failed to pull image %q: the TLS certificate of registry %s is not trusted (%v); add its CA to the plugin option registry_ca_file, or list the registry in insecure_registries if it speaks plain HTTP", ref.Raw, reg, certCause(err))
	}
	var oe *net.OpError
	isNet := errors.As(err, &oe)
	if errors.Is(err, errPlainHTTP) && !isNet {
		return errorf(ErrNotAllowed, "failed to pull image %q: registry %s would be reached over plain HTTP; list it in the plugin option insecure_registries to allow that, or serve it over TLS", ref.Raw, reg)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return errorf(ErrUnreachable, "failed to pull image %q: the pull did not finish within image_pull_timeout while fetching %s from %s; raise image_pull_timeout or check the registry", ref.Raw, what, reg)
	}
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("pull of image %q canceled", ref.Raw)
	}
	if isNet {
		// The network's error, not the plain-HTTP attempt
		// go-containerregistry makes beside it for a local address.
		err = oe
	}
	return errorf(ErrUnreachable, "failed to pull image %q: registry %s unreachable while fetching %s (%v); check that it runs and that this node reaches it", ref.Raw, reg, what, err)
}
