/*
 * SEH shim of the KMDF shell (hca-miniport/src/kmdf/platform.rs).
 *
 * Two kernel routines report failure by raising an exception rather than
 * returning a status: MmProbeAndLockPages (a bad or inaccessible address)
 * and MmMapLockedPagesSpecifyCache with UserMode (no room in the process).
 * Rust cannot catch SEH, so these calls are made here, under __try, and
 * the exception code comes back as an NTSTATUS. Nothing else lives here.
 *
 * Compiled by build.rs with the cc crate for Windows targets; on Linux
 * `cargo xtask wdk-check` compiles it with clang in cl mode at -W4 -WX
 * against a stand-in WDK. Never built with MSVC and the real WDK yet.
 */

#include <ntddk.h>

/*
 * Probes and locks the pages an MDL built by IoAllocateMdl describes.
 * AccessMode is UserMode for a caller's buffer (at or below APC_LEVEL, in
 * the caller's process) or KernelMode; Writable asks for IoWriteAccess
 * (the device will write the pages). On failure the MDL is not locked.
 */
NTSTATUS HcaProbeAndLockPages(PMDL Mdl, KPROCESSOR_MODE AccessMode, BOOLEAN Writable)
{
    NTSTATUS status = STATUS_SUCCESS;

    __try {
        MmProbeAndLockPages(Mdl, AccessMode, Writable ? IoWriteAccess : IoReadAccess);
    } __except (EXCEPTION_EXECUTE_HANDLER) {
        status = GetExceptionCode();
        /* A raised code that is not an error status still means failure. */
        if (NT_SUCCESS(status)) {
            status = STATUS_ACCESS_VIOLATION;
        }
    }
    return status;
}

/*
 * Maps the (locked or non-paged) pages of Mdl uncached into the current
 * process's user address space. PASSIVE_LEVEL... APC_LEVEL, in the target
 * process. On success *UserVa is the user address of the MDL's first page
 * plus its byte offset; undo with MmUnmapLockedPages in the same process.
 */
NTSTATUS HcaMapLockedPagesToUser(PMDL Mdl, PVOID *UserVa)
{
    NTSTATUS status = STATUS_SUCCESS;
    PVOID va = NULL;

    __try {
        va = MmMapLockedPagesSpecifyCache(Mdl, UserMode, MmNonCached, NULL, FALSE,
                                          NormalPagePriority);
    } __except (EXCEPTION_EXECUTE_HANDLER) {
        status = GetExceptionCode();
        if (NT_SUCCESS(status)) {
            status = STATUS_INSUFFICIENT_RESOURCES;
        }
        va = NULL;
    }
    if (NT_SUCCESS(status) && va == NULL) {
        status = STATUS_INSUFFICIENT_RESOURCES;
    }
    *UserVa = va;
    return status;
}
