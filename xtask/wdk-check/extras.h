/* Stand-in WDK (cargo xtask wdk-check): kernel routines and types of the
 * Windows 10/11 WDK that mingw-w64 10's DDK headers do not declare, with
 * the signatures learn.microsoft.com documents. Each one is a fidelity
 * risk: a wrong declaration here hides a wrong call in the shell. */
#pragma once

typedef ULONG64 POOL_FLAGS;
NTKERNELAPI PVOID NTAPI ExAllocatePool2(POOL_FLAGS Flags, SIZE_T NumberOfBytes, ULONG Tag);

typedef volatile LONG EX_SPIN_LOCK, *PEX_SPIN_LOCK;
NTKERNELAPI KIRQL ExAcquireSpinLockShared(PEX_SPIN_LOCK SpinLock);
NTKERNELAPI VOID ExReleaseSpinLockShared(PEX_SPIN_LOCK SpinLock, KIRQL OldIrql);
NTKERNELAPI KIRQL ExAcquireSpinLockExclusive(PEX_SPIN_LOCK SpinLock);
NTKERNELAPI VOID ExReleaseSpinLockExclusive(PEX_SPIN_LOCK SpinLock, KIRQL OldIrql);

NTKERNELAPI ULONG64 KeQueryInterruptTimePrecise(PULONG64 QpcTimeStamp);
NTKERNELAPI PVOID MmMapIoSpaceEx(PHYSICAL_ADDRESS PhysicalAddress, SIZE_T NumberOfBytes, ULONG Protect);

NTKERNELAPI ULONG ExTryAcquireSpinLockSharedAtDpcLevel(PEX_SPIN_LOCK SpinLock);
NTKERNELAPI ULONG ExTryAcquireSpinLockExclusiveAtDpcLevel(PEX_SPIN_LOCK SpinLock);
