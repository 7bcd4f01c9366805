#include "textflag.h"

// System call numbers of linux/amd64 (arch/x86/entry/syscalls/syscall_64.tbl).
#define SYS_write 1
#define SYS_lseek 8
#define SYS_mmap 9
#define SYS_execve 59
#define SYS_capget 125
#define SYS_prctl 157
#define SYS_exit_group 231
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

// The descriptors of wire.SeccompErrorFD and wire.SeccompEnvFD.
#define ERROR_FD 4
#define ENV_FD 5

// func stageEntry(): see stage_entry.go. The kernel starts the process here
// with 0(SP) = argc, 8(SP) = argv[0], ... Nothing moves SP, so that the
// jump to the Go runtime's entry finds the process as the kernel made it.
// Registers kept across system calls (which clobber AX, CX and R11): BX,
// R12-R15.
TEXT ·stageEntry(SB), NOSPLIT|NOFRAME, $0-0
	// argc >= 4: argv[1] = the stage's name, argv[2] = the command's
	// path, argv[3:] its argv.
	MOVQ	0(SP), AX
	CMPQ	AX, $4
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

	// The file: its size (at least the count), then a read-only mapping.
	MOVQ	$SYS_lseek, AX
	MOVQ	$ENV_FD, DI
	XORQ	SI, SI
	MOVQ	$SEEK_END, DX
	SYSCALL
	CMPQ	AX, $8
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
	MOVQ	0(AX), R14      // filter instructions
	CMPQ	R14, $BPF_MAXINSNS
	JHI	goruntime
	LEAQ	8(AX), R13          // the filter
	LEAQ	(R13)(R14*8), R15   // the environment
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
	// capget(&header, &data): the effective set's low word at 8(R8).
	LEAQ	·stageScratch(SB), R8
	MOVL	$CAPABILITY_VERSION_3, 0(R8)
	MOVL	$0, 4(R8)
	MOVQ	$SYS_capget, AX
	MOVQ	R8, DI
	LEAQ	8(R8), SI
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime
	MOVL	8(R8), AX
	BTL	$CAP_SYS_ADMIN, AX
	JCS	ready
	TESTQ	R14, R14
	JEQ	ready
	// struct sock_fprog { unsigned short len; struct sock_filter *filter; }
	MOVW	R14, 32(R8)
	MOVQ	R13, 40(R8)
	MOVQ	$SYS_prctl, AX
	MOVQ	$PR_SET_SECCOMP, DI
	MOVQ	$SECCOMP_MODE_FILTER, SI
	LEAQ	32(R8), DX
	SYSCALL
	TESTQ	AX, AX
	JNE	goruntime

ready:
	MOVQ	$SYS_write, AX
	MOVQ	$ERROR_FD, DI
	MOVQ	·stageReady(SB), SI
	MOVQ	·stageReady+8(SB), DX
	SYSCALL
	CMPQ	AX, DX
	JNE	exit

	MOVQ	$SYS_execve, AX
	MOVQ	24(SP), DI
	LEAQ	32(SP), SI
	MOVQ	BX, DX
	SYSCALL

	// The exec failed: the marker and the errno, then exit 127.
	NEGQ	AX
	LEAQ	·stageScratch(SB), R8
	MOVQ	·stageExecFailed(SB), SI
	MOVBLZX	(SI), CX
	MOVB	CX, 48(R8)
	MOVB	AX, 49(R8)
	SHRL	$8, AX
	MOVB	AX, 50(R8)
	MOVQ	$SYS_write, AX
	MOVQ	$ERROR_FD, DI
	LEAQ	48(R8), SI
	MOVQ	$3, DX
	SYSCALL
exit:
	MOVQ	$SYS_exit_group, AX
	MOVQ	$127, DI
	SYSCALL
	JMP	exit

goruntime:
	JMP	_rt0_amd64_linux(SB)
