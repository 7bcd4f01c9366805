#include "textflag.h"

// System call numbers of linux/arm64 (include/uapi/asm-generic/unistd.h).
#define SYS_dup3 24
#define SYS_chdir 49
#define SYS_lseek 62
#define SYS_write 64
#define SYS_capget 90
#define SYS_exit_group 94
#define SYS_prctl 167
#define SYS_recvmsg 212
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

// stageScratch's layout: see stage_entry_amd64.s.
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

// func stageEntry(): see stage_entry.go and stage_entry_amd64.s, which this
// follows step by step. The kernel starts the process here with 0(RSP) =
// argc, 8(RSP) = argv[0], ... Nothing moves RSP. System calls take R8 and
// R0-R5 and return in R0; the values kept across them are in R19-R25
// (size or length, end, counts and pointers into the file or the
// go-ahead, envp in R25), and R9 holds stageScratch from the filters on.
TEXT ·stageEntry(SB), NOSPLIT|NOFRAME, $0-0
	MOVD	0(RSP), R0
	CMP	$3, R0
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

	// The file: its size (at least the two counts), then a read-only
	// mapping.
	MOVD	$ENV_FD, R0
	MOVD	$0, R1
	MOVD	$SEEK_END, R2
	MOVD	$SYS_lseek, R8
	SVC
	CMP	$16, R0
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
	MOVD	$·stageScratch(SB), R9

	// The task's filter: its count, then its instructions.
	MOVD	(R0), R21
	CMP	$BPF_MAXINSNS, R21
	BHI	goruntime
	ADD	$8, R0, R22
	MOVH	R21, FPROG_TASK(R9)
	MOVD	R22, FPROG_TASK+8(R9)
	ADD	R21<<3, R22, R23 // the second count
	ADD	$8, R23, R3
	CMP	R20, R3
	BHI	goruntime
	// The user namespace rules.
	MOVD	(R23), R21
	CMP	$BPF_MAXINSNS, R21
	BHI	goruntime
	ADD	$8, R23, R22
	MOVH	R21, FPROG_USERNS(R9)
	MOVD	R22, FPROG_USERNS+8(R9)
	ADD	R21<<3, R22, R23 // the environment
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
	// capget(&header, &data): the effective set's low word at CAP_DATA.
	MOVD	$·stageScratch(SB), R9
	MOVW	$CAPABILITY_VERSION_3, R3
	MOVW	R3, CAP_HDR(R9)
	MOVW	ZR, CAP_HDR+4(R9)
	ADD	$CAP_HDR, R9, R0
	ADD	$CAP_DATA, R9, R1
	MOVD	$SYS_capget, R8
	SVC
	CBNZ	R0, goruntime
	// The task's filter, always.
	MOVHU	FPROG_TASK(R9), R3
	CBZ	R3, userns
	MOVD	$PR_SET_SECCOMP, R0
	MOVD	$SECCOMP_MODE_FILTER, R1
	ADD	$FPROG_TASK, R9, R2
	MOVD	$0, R3
	MOVD	$SYS_prctl, R8
	SVC
	CBNZ	R0, goruntime
userns:
	// The user namespace rules, unless the stage holds SYS_ADMIN.
	MOVWU	CAP_DATA(R9), R3
	TBNZ	$CAP_SYS_ADMIN, R3, wait
	MOVHU	FPROG_USERNS(R9), R3
	CBZ	R3, wait
	MOVD	$PR_SET_SECCOMP, R0
	MOVD	$SECCOMP_MODE_FILTER, R1
	ADD	$FPROG_USERNS, R9, R2
	MOVD	$0, R3
	MOVD	$SYS_prctl, R8
	SVC
	CBNZ	R0, goruntime

wait:
	// recvmsg(GO_FD, &msghdr, MSG_CMSG_CLOEXEC) into stageGoAhead, with
	// the descriptors in the control buffer. From here on every failure
	// is told and ends the stage: the go-ahead is taken.
	MOVD	$·stageGoAhead(SB), R3
	MOVD	R3, IOV(R9)
	MOVD	$GO_MAX, R3
	MOVD	R3, IOV+8(R9)
	ADD	$IOV, R9, R3
	MOVD	R3, MSG_IOV(R9)
	MOVD	$1, R3
	MOVD	R3, MSG_IOVLEN(R9)
	ADD	$CMSG, R9, R3
	MOVD	R3, MSG_CONTROL(R9)
	MOVD	$CMSG_SPACE, R3
	MOVD	R3, MSG_CONTROLLEN(R9)
	MOVD	$GO_FD, R0
	ADD	$MSGHDR, R9, R1
	MOVD	$MSG_CMSG_CLOEXEC, R2
	MOVD	$SYS_recvmsg, R8
	SVC
	MOVD	$-4096, R3
	CMP	R3, R0
	BHI	gofailed
	MOVD	R0, R19 // the message's length
	CBNZ	R0, received
	MOVD	MSG_CONTROLLEN(R9), R3
	CBZ	R3, exit // EOF: the supervisor let the task go
received:
	MOVD	$-EINVAL, R0
	MOVWU	MSG_FLAGS(R9), R3
	MOVD	$MSG_TRUNCS, R4
	TST	R4, R3
	BNE	gofailed
	MOVD	MSG_CONTROLLEN(R9), R3
	CMP	$CMSG_LEN, R3
	BLO	gofailed
	MOVD	CMSG(R9), R3
	CMP	$CMSG_LEN, R3
	BNE	gofailed
	MOVWU	CMSG+8(R9), R3
	CMP	$SOL_SOCKET, R3
	BNE	gofailed
	MOVWU	CMSG+12(R9), R3
	CMP	$SCM_RIGHTS, R3
	BNE	gofailed
	// The message: "dir\0path\0", the path not empty.
	CMP	$3, R19
	BLO	gofailed
	MOVD	$·stageGoAhead(SB), R21 // the directory
	ADD	R19, R21, R23
	SUB	$1, R23 // the last byte
	MOVBU	(R23), R3
	CBNZ	R3, gofailed
	MOVD	R21, R1
dirend:
	MOVBU.P	1(R1), R3
	CBNZ	R3, dirend
	MOVD	R1, R22 // the path
	CMP	R23, R22
	BHS	gofailed
	// The path ends at the last byte: no NUL before it.
	MOVD	R22, R1
pathend:
	MOVBU	(R1), R3
	CBZ	R3, pathdone
	ADD	$1, R1
	B	pathend
pathdone:
	CMP	R23, R1
	BNE	gofailed

	// The descriptors onto stdin, stdout and stderr; the received ones are
	// closed at exec.
	MOVD	$0, R19
dup:
	ADD	$(CMSG+16), R9, R3
	ADD	R19<<2, R3, R3
	MOVWU	(R3), R0
	MOVD	R19, R1
	MOVD	$0, R2
	MOVD	$SYS_dup3, R8
	SVC
	MOVD	$-4096, R3
	CMP	R3, R0
	BHI	gofailed
	ADD	$1, R19
	CMP	$3, R19
	BLT	dup

	// The working directory, unless empty.
	MOVBU	(R21), R3
	CBZ	R3, ready
	MOVD	R21, R0
	MOVD	$SYS_chdir, R8
	SVC
	CBZ	R0, ready
	MOVD	·stageChdirFailed(SB), R1
	B	failed

ready:
	MOVD	$ERROR_FD, R0
	MOVD	·stageReady(SB), R1
	MOVD	·stageReady+8(SB), R2
	MOVD	R2, R10
	MOVD	$SYS_write, R8
	SVC
	CMP	R10, R0
	BNE	exit

	MOVD	R22, R0
	ADD	$24, RSP, R1
	MOVD	R25, R2
	MOVD	$SYS_execve, R8
	SVC
	MOVD	·stageExecFailed(SB), R1
	B	failed

gofailed:
	MOVD	·stageGoFailed(SB), R1
	// fall through

failed:
	// The marker at R1, then the errno (-R0), then exit 127.
	NEG	R0, R0
	MOVD	$·stageScratch(SB), R9
	MOVBU	(R1), R3
	MOVB	R3, FAILED(R9)
	MOVB	R0, FAILED+1(R9)
	LSR	$8, R0, R3
	MOVB	R3, FAILED+2(R9)
	MOVD	$ERROR_FD, R0
	ADD	$FAILED, R9, R1
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
