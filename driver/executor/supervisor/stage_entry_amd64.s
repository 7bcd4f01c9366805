#include "textflag.h"

// System call numbers of linux/amd64 (arch/x86/entry/syscalls/syscall_64.tbl).
#define SYS_write 1
#define SYS_lseek 8
#define SYS_mmap 9
#define SYS_recvmsg 47
#define SYS_execve 59
#define SYS_chdir 80
#define SYS_capget 125
#define SYS_prctl 157
#define SYS_exit_group 231
#define SYS_dup3 292
#define SYS_close_range 436

#define PR_SET_DUMPABLE 4
#define PR_SET_SECCOMP 22
#define SECCOMP_MODE_FILTER 2
#define CLOSE_RANGE_CLOEXEC 4
#define SEEK_END 2
#define PROT_READ 1
#define PROT_RW 3
#define MAP_PRIVATE 2
#define MAP_PRIVATE_ANON 0x22
#define CAPABILITY_VERSION_3 0x20080522
#define CAP_SYS_ADMIN 21
#define BPF_MAXINSNS 4096
#define MSG_CMSG_CLOEXEC 0x40000000
#define MSG_TRUNCS 0x28 // MSG_CTRUNC | MSG_TRUNC
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define EINVAL 22

// The descriptors of wire.SeccompErrorFD, wire.SeccompEnvFD and
// wire.SeccompGoFD, and wire.SeccompGoMax.
#define ERROR_FD 4
#define ENV_FD 5
#define GO_FD 6
#define GO_MAX 8192

// stageScratch's layout (stage_entry.go): the capget header and data, the
// two filters' struct sock_fprog, the failure message, the go-ahead's
// struct msghdr, its struct iovec and its control buffer (one cmsghdr of
// three descriptors: CMSG_LEN(12) = 28 bytes, CMSG_SPACE(12) = 32).
#define CAP_HDR 0
#define CAP_DATA 8
#define FPROG_TASK 32
#define FPROG_USERNS 48
#define FAILED 64
#define MSGHDR 72
#define MSG_IOV 88
#define MSG_IOVLEN 96
#define MSG_CONTROL 104
#define MSG_CONTROLLEN 112
#define MSG_FLAGS 120
#define IOV 128
#define CMSG 144
#define CMSG_LEN 28
#define CMSG_SPACE 32

// func stageEntry(): see stage_entry.go. The kernel starts the process here
// with 0(SP) = argc, 8(SP) = argv[0], ... Nothing moves SP, so that the
// jump to the Go runtime's entry finds the process as the kernel made it.
// Registers kept across system calls (which clobber AX, CX and R11): BX,
// R12-R15; R8 holds stageScratch from the capget on.
TEXT ·stageEntry(SB), NOSPLIT|NOFRAME, $0-0
	// argc >= 3: argv[1] = the stage's name, argv[2:] the command's argv.
	MOVQ	0(SP), AX
	CMPQ	AX, $3
	JLT	goruntime
	MOVQ	16(SP), SI
	MOVQ	·stageArg(SB), DI // NUL-terminated
name:
	MOVBLZX	(SI), AX
	MOVBLZX	(DI), DX
	CMPL	AX, DX
	JNE	goruntime
	TESTL	AX, AX
	JEQ	stage
	INCQ	SI
	INCQ	DI
	JMP	name

stage:
	MOVQ	$SYS_prctl, AX
	MOVQ	$PR_SET_DUMPABLE, DI
	XORQ	SI, SI
	XORQ	DX, DX
	XORQ	R10, R10
	XORQ	R8, R8
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime
	MOVQ	$SYS_close_range, AX
	MOVQ	$3, DI
	MOVL	$0xffffffff, SI
	MOVQ	$CLOSE_RANGE_CLOEXEC, DX
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime

	// The file: its size (at least the two counts), then a read-only
	// mapping.
	MOVQ	$SYS_lseek, AX
	MOVQ	$ENV_FD, DI
	XORQ	SI, SI
	MOVQ	$SEEK_END, DX
	SYSCALL
	CMPQ	AX, $16
	JLT	goruntime
	MOVQ	AX, R12 // size
	MOVQ	$SYS_mmap, AX
	XORQ	DI, DI
	MOVQ	R12, SI
	MOVQ	$PROT_READ, DX
	MOVQ	$MAP_PRIVATE, R10
	MOVQ	$ENV_FD, R8
	XORQ	R9, R9
	SYSCALL
	CMPQ	AX, $-4096
	JHI	goruntime
	LEAQ	(AX)(R12*1), BX // end of the file
	LEAQ	·stageScratch(SB), R8

	// The task's filter: its count, then its instructions.
	MOVQ	0(AX), R14
	CMPQ	R14, $BPF_MAXINSNS
	JHI	goruntime
	LEAQ	8(AX), R13
	MOVW	R14, FPROG_TASK(R8)
	MOVQ	R13, FPROG_TASK+8(R8)
	LEAQ	(R13)(R14*8), R15 // the second count
	LEAQ	8(R15), AX
	CMPQ	AX, BX
	JHI	goruntime
	// The user namespace rules.
	MOVQ	0(R15), R14
	CMPQ	R14, $BPF_MAXINSNS
	JHI	goruntime
	LEAQ	8(R15), R13
	MOVW	R14, FPROG_USERNS(R8)
	MOVQ	R13, FPROG_USERNS+8(R8)
	LEAQ	(R13)(R14*8), R15 // the environment
	CMPQ	R15, BX
	JHI	goruntime

	// Count the environment's entries; a non-empty one ends with a NUL.
	MOVQ	R15, SI
	XORQ	R12, R12
count:
	CMPQ	SI, BX
	JEQ	counted
	MOVBLZX	(SI), AX
	INCQ	SI
	TESTL	AX, AX
	JNE	count
	INCQ	R12
	JMP	count
counted:
	CMPQ	R15, BX
	JEQ	envp
	MOVBLZX	-1(BX), AX
	TESTL	AX, AX
	JNE	goruntime

envp:
	// An array of R12+1 pointers (zeroed: the last stays NULL).
	MOVQ	$SYS_mmap, AX
	XORQ	DI, DI
	LEAQ	8(R12*8), SI
	MOVQ	$PROT_RW, DX
	MOVQ	$MAP_PRIVATE_ANON, R10
	MOVQ	$-1, R8
	XORQ	R9, R9
	SYSCALL
	CMPQ	AX, $-4096
	JHI	goruntime
	MOVQ	AX, BX // envp from here on
	MOVQ	AX, DI
	MOVQ	R15, SI
fill:
	TESTQ	R12, R12
	JEQ	caps
	MOVQ	SI, (DI)
	ADDQ	$8, DI
	DECQ	R12
skip:
	MOVBLZX	(SI), AX
	INCQ	SI
	TESTL	AX, AX
	JNE	skip
	JMP	fill

caps:
	// capget(&header, &data): the effective set's low word at CAP_DATA.
	LEAQ	·stageScratch(SB), R8
	MOVL	$CAPABILITY_VERSION_3, CAP_HDR(R8)
	MOVL	$0, CAP_HDR+4(R8)
	MOVQ	$SYS_capget, AX
	LEAQ	CAP_HDR(R8), DI
	LEAQ	CAP_DATA(R8), SI
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime
	// The task's filter, always; prctl's fourth and fifth arguments are
	// unused.
	MOVWLZX	FPROG_TASK(R8), AX
	TESTL	AX, AX
	JEQ	userns
	MOVQ	$SYS_prctl, AX
	MOVQ	$PR_SET_SECCOMP, DI
	MOVQ	$SECCOMP_MODE_FILTER, SI
	LEAQ	FPROG_TASK(R8), DX
	XORQ	R10, R10
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime
userns:
	// The user namespace rules, unless the stage holds SYS_ADMIN.
	MOVL	CAP_DATA(R8), AX
	BTL	$CAP_SYS_ADMIN, AX
	JCS	wait
	MOVWLZX	FPROG_USERNS(R8), AX
	TESTL	AX, AX
	JEQ	wait
	MOVQ	$SYS_prctl, AX
	MOVQ	$PR_SET_SECCOMP, DI
	MOVQ	$SECCOMP_MODE_FILTER, SI
	LEAQ	FPROG_USERNS(R8), DX
	XORQ	R10, R10
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime

wait:
	// recvmsg(GO_FD, &msghdr, MSG_CMSG_CLOEXEC) into stageGoAhead, with
	// the descriptors in the control buffer. From here on every failure
	// is told and ends the stage: the go-ahead is taken.
	LEAQ	·stageGoAhead(SB), AX
	MOVQ	AX, IOV(R8)
	MOVQ	$GO_MAX, IOV+8(R8)
	LEAQ	IOV(R8), AX
	MOVQ	AX, MSG_IOV(R8)
	MOVQ	$1, MSG_IOVLEN(R8)
	LEAQ	CMSG(R8), AX
	MOVQ	AX, MSG_CONTROL(R8)
	MOVQ	$CMSG_SPACE, MSG_CONTROLLEN(R8)
	MOVQ	$SYS_recvmsg, AX
	MOVQ	$GO_FD, DI
	LEAQ	MSGHDR(R8), SI
	MOVQ	$MSG_CMSG_CLOEXEC, DX
	SYSCALL
	CMPQ	AX, $-4096
	JHI	gofailed
	MOVQ	AX, R12 // the message's length
	TESTQ	AX, AX
	JNE	received
	CMPQ	MSG_CONTROLLEN(R8), $0
	JEQ	exit // EOF: the supervisor let the task go
received:
	MOVQ	$-EINVAL, AX
	MOVL	MSG_FLAGS(R8), CX
	TESTL	$MSG_TRUNCS, CX
	JNE	gofailed
	CMPQ	MSG_CONTROLLEN(R8), $CMSG_LEN
	JLT	gofailed
	CMPQ	CMSG(R8), $CMSG_LEN
	JNE	gofailed
	CMPL	CMSG+8(R8), $SOL_SOCKET
	JNE	gofailed
	CMPL	CMSG+12(R8), $SCM_RIGHTS
	JNE	gofailed
	// The message: "dir\0path\0", the path not empty.
	CMPQ	R12, $3
	JLT	gofailed
	LEAQ	·stageGoAhead(SB), R13 // the directory
	LEAQ	-1(R13)(R12*1), R15    // the last byte
	MOVBLZX	(R15), CX
	TESTL	CX, CX
	JNE	gofailed
	MOVQ	R13, SI
dirend:
	MOVBLZX	(SI), CX
	INCQ	SI
	TESTL	CX, CX
	JNE	dirend
	MOVQ	SI, R14 // the path
	CMPQ	R14, R15
	JHS	gofailed
	// The path ends at the last byte: no NUL before it.
	MOVQ	R14, SI
pathend:
	MOVBLZX	(SI), CX
	TESTL	CX, CX
	JEQ	pathdone
	INCQ	SI
	JMP	pathend
pathdone:
	CMPQ	SI, R15
	JNE	gofailed

	// The descriptors onto stdin, stdout and stderr; the received ones are
	// closed at exec.
	MOVQ	$0, R12
dup:
	MOVQ	$SYS_dup3, AX
	MOVL	CMSG+16(R8)(R12*4), DI
	MOVQ	R12, SI
	XORQ	DX, DX
	SYSCALL
	CMPQ	AX, $-4096
	JHI	gofailed
	INCQ	R12
	CMPQ	R12, $3
	JLT	dup

	// The working directory, unless empty.
	MOVBLZX	(R13), CX
	TESTL	CX, CX
	JEQ	ready
	MOVQ	$SYS_chdir, AX
	MOVQ	R13, DI
	SYSCALL
	TESTQ	AX, AX
	JEQ	ready
	MOVQ	·stageChdirFailed(SB), SI
	JMP	failed

ready:
	MOVQ	$SYS_write, AX
	MOVQ	$ERROR_FD, DI
	MOVQ	·stageReady(SB), SI
	MOVQ	·stageReady+8(SB), DX
	SYSCALL
	CMPQ	AX, DX
	JNE	exit

	MOVQ	$SYS_execve, AX
	MOVQ	R14, DI
	LEAQ	24(SP), SI
	MOVQ	BX, DX
	SYSCALL
	MOVQ	·stageExecFailed(SB), SI
	JMP	failed

gofailed:
	MOVQ	·stageGoFailed(SB), SI
	// fall through

failed:
	// The marker at SI, then the errno (-AX), then exit 127.
	NEGQ	AX
	LEAQ	·stageScratch(SB), R8
	MOVBLZX	(SI), CX
	MOVB	CX, FAILED(R8)
	MOVB	AX, FAILED+1(R8)
	SHRL	$8, AX
	MOVB	AX, FAILED+2(R8)
	MOVQ	$SYS_write, AX
	MOVQ	$ERROR_FD, DI
	LEAQ	FAILED(R8), SI
	MOVQ	$3, DX
	SYSCALL
exit:
	MOVQ	$SYS_exit_group, AX
	MOVQ	$127, DI
	SYSCALL
	JMP	exit

goruntime:
	JMP	_rt0_amd64_linux(SB)
