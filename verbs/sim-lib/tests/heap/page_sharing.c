/* A program's small malloc buffers against the simulator's heap: does any
 * share a page with an object our libibverbs.so.1 allocated for it (the
 * context, a PD, a region)? A region's pages are adopted whole, so such a
 * page would be one the device may write under the simulator's objects.
 * Prints each shared page; exits 0 when none is, 1 when some is, 2 when
 * a verb failed. */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define BUFFERS 4096

int main(void) {
    int devices = 0;
    struct ibv_device **list = ibv_get_device_list(&devices);
    if (!list || devices < 1) { perror("ibv_get_device_list"); return 2; }
    struct ibv_context *context = ibv_open_device(list[0]);
    if (!context) { perror("ibv_open_device"); return 2; }
    struct ibv_pd *pd = ibv_alloc_pd(context);
    if (!pd) { perror("ibv_alloc_pd"); return 2; }
    /* A page-aligned buffer of the program's: registering it allocates
     * the simulator's region object without touching a malloc page. */
    long page = sysconf(_SC_PAGESIZE);
    void *aligned = NULL;
    if (posix_memalign(&aligned, page, page)) { perror("posix_memalign"); return 2; }
    struct ibv_mr *mr = ibv_reg_mr(pd, aligned, page, IBV_ACCESS_LOCAL_WRITE);
    if (!mr) { perror("ibv_reg_mr"); return 2; }

    const void *simulator[] = { context, pd, mr };
    const char *names[] = { "context", "pd", "mr" };
    static void *buffers[BUFFERS];
    int shared = 0;
    for (int i = 0; i < BUFFERS; i++) {
        /* Small, unaligned: the sizes programs register for a message. */
        buffers[i] = malloc(16 + (size_t)(i % 8) * 16);
        if (!buffers[i]) { perror("malloc"); return 2; }
        for (size_t s = 0; s < sizeof simulator / sizeof simulator[0]; s++) {
            if ((uintptr_t)buffers[i] / (uintptr_t)page == (uintptr_t)simulator[s] / (uintptr_t)page) {
                printf("malloc buffer %p shares a page with the simulator's %s %p\n",
                       buffers[i], names[s], simulator[s]);
                shared++;
            }
        }
    }
    printf("%d of %d small malloc buffers share a page with the simulator's objects\n",
           shared, BUFFERS);

    for (int i = 0; i < BUFFERS; i++) free(buffers[i]);
    if (ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(context)) {
        perror("teardown");
        return 2;
    }
    free(aligned);
    ibv_free_device_list(list);
    return shared ? 1 : 0;
}
