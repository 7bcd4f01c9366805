#include "textflag.h"

// System call numbers of linux/arm64 (include/uapi/asm-generic/unistd.h).
#define SYS_lseek 62
#define SYS_write 64
#define SYS_capget 90
#define SYS_exit_group 94
#define SYS_prctl 167
#define SYS_execve 221
#define SYS_mmap 222
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

// func stageEntry(): see stage_entry.go and stage_entry_amd64.s, which this
// follows step by step. The kernel starts the process here with 0(RSP) =
// argc, 8(RSP) = argv[0], ... Nothing moves RSP. System calls take R8 and
// R0-R5 and return in R0; the values kept across them are in R19-R25
// (size, end, filter length, filter, environment, count, envp).
TEXT ·stageEntry(SB), NOSPLIT|NOFRAME, $0-0
	MOVD	0(RSP), R0
	CMP	$4, R0
	BLT	goruntime
	MOVD	16(RSP), R1
	MOVD	·stageArg(SB), R2 // NUL-terminated
name:
	MOVBU	(R1), R3
	MOVBU	(R2), R4
	CMP	R3, R4
	BNE	goruntime
	CBZ	R3, stage
	ADD	$1, R1
	ADD	$1, R2
	B	name

stage:
	MOVD	$PR_SET_DUMPABLE, R0
	MOVD	$0, R1
	MOVD	$0, R2
	MOVD	$0, R3
	MOVD	$0, R4
	MOVD	$SYS_prctl, R8
	SVC
	CBNZ	R0, goruntime
	MOVD	$3, R0
	MOVD	$0xffffffff, R1
	MOVD	$CLOSE_RANGE_CLOEXEC, R2
	MOVD	$SYS_close_range, R8
	SVC
	CBNZ	R0, goruntime

	// The file: its size (at least the count), then a read-only mapping.
	MOVD	$ENV_FD, R0
	MOVD	$0, R1
	MOVD	$SEEK_END, R2
	MOVD	$SYS_lseek, R8
	SVC
	CMP	$8, R0
	BLT	goruntime
	MOVD	R0, R19 // size
	MOVD	$0, R0
	MOVD	R19, R1
	MOVD	$PROT_READ, R2
	MOVD	$MAP_PRIVATE, R3
	MOVD	$ENV_FD, R4
	MOVD	$0, R5
	MOVD	$SYS_mmap, R8
	SVC
	MOVD	$-4096, R9
	CMP	R9, R0
	BHI	goruntime
	ADD	R0, R19, R20 // end of the file
	MOVD	(R0), R21    // filter instructions
	CMP	$BPF_MAXINSNS, R21
	BHI	goruntime
	ADD	$8, R0, R22       // the filter
	ADD	R21<<3, R22, R23  // the environment
	CMP	R20, R23
	BHI	goruntime

	// Count the environment's entries; a non-empty one ends with a NUL.
	MOVD	R23, R1
	MOVD	$0, R24
count:
	CMP	R20, R1
	BEQ	counted
	MOVBU.P	1(R1), R3
	CBNZ	R3, count
	ADD	$1, R24
	B	count
counted:
	CMP	R20, R23
	BEQ	envp
	MOVBU	-1(R20), R3
	CBNZ	R3, goruntime

envp:
	// An array of R24+1 pointers (zeroed: the last stays NULL).
	MOVD	$0, R0
	LSL	$3, R24, R1
	ADD	$8, R1
	MOVD	$PROT_RW, R2
	MOVD	$MAP_PRIVATE_ANON, R3
	MOVD	$-1, R4
	MOVD	$0, R5
	MOVD	$SYS_mmap, R8
	SVC
	MOVD	$-4096, R9
	CMP	R9, R0
	BHI	goruntime
	MOVD	R0, R25 // envp from here on
	MOVD	R0, R2
	MOVD	R23, R1
fill:
	CBZ	R24, caps
	MOVD.P	R1, 8(R2)
	SUB	$1, R24
skip:
	MOVBU.P	1(R1), R3
	CBNZ	R3, skip
	B	fill

caps:
	// capget(&header, &data): the effective set's low word at 8(R9).
	MOVD	$·stageScratch(SB), R9
	MOVW	$CAPABILITY_VERSION_3, R3
	MOVW	R3, 0(R9)
	MOVW	ZR, 4(R9)
	MOVD	R9, R0
	ADD	$8, R9, R1
	MOVD	$SYS_capget, R8
	SVC
	CBNZ	R0, goruntime
	MOVWU	8(R9), R3
	TBNZ	$CAP_SYS_ADMIN, R3, ready
	CBZ	R21, ready
	// struct sock_fprog { unsigned short len; struct sock_filter *filter; }
	MOVH	R21, 32(R9)
	MOVD	R22, 40(R9)
	MOVD	$PR_SET_SECCOMP, R0
	MOVD	$SECCOMP_MODE_FILTER, R1
	ADD	$32, R9, R2
	MOVD	$SYS_prctl, R8
	SVC
	CBNZ	R0, goruntime

ready:
	MOVD	$ERROR_FD, R0
	MOVD	·stageReady(SB), R1
	MOVD	·stageReady+8(SB), R2
	MOVD	R2, R10
	MOVD	$SYS_write, R8
	SVC
	CMP	R10, R0
	BNE	exit

	MOVD	24(RSP), R0
	ADD	$32, RSP, R1
	MOVD	R25, R2
	MOVD	$SYS_execve, R8
	SVC

	// The exec failed: the marker and the errno, then exit 127.
	NEG	R0, R0
	MOVD	$·stageScratch(SB), R9
	MOVD	·stageExecFailed(SB), R1
	MOVBU	(R1), R3
	MOVB	R3, 48(R9)
	MOVB	R0, 49(R9)
	LSR	$8, R0, R3
	MOVB	R3, 50(R9)
	MOVD	$ERROR_FD, R0
	ADD	$48, R9, R1
	MOVD	$3, R2
	MOVD	$SYS_write, R8
	SVC
exit:
	MOVD	$127, R0
	MOVD	$SYS_exit_group, R8
	SVC
	B	exit

goruntime:
	JMP	_rt0_arm64_linux(SB)
