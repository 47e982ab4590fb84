/* A program that registers memory of the library's own heap (here the
 * ibv_pd it was handed): the device must not be given the simulator's
 * pages, so ibv_reg_mr refuses with EFAULT and the PD stays usable.
 * Exits 0 when refused so, 1 when the registration succeeded, 2 when
 * another verb failed. */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(void) {
    int devices = 0;
    struct ibv_device **list = ibv_get_device_list(&devices);
    if (!list || devices < 1) { perror("ibv_get_device_list"); return 2; }
    struct ibv_context *context = ibv_open_device(list[0]);
    if (!context) { perror("ibv_open_device"); return 2; }
    struct ibv_pd *pd = ibv_alloc_pd(context);
    if (!pd) { perror("ibv_alloc_pd"); return 2; }

    int refused = 1;
    errno = 0;
    struct ibv_mr *mr = ibv_reg_mr(pd, pd, sizeof *pd, IBV_ACCESS_LOCAL_WRITE);
    if (mr) {
        printf("the PD's own page was registered\n");
        refused = 0;
        if (ibv_dereg_mr(mr)) { perror("ibv_dereg_mr"); return 2; }
    } else {
        printf("refused: %s\n", strerror(errno));
        if (errno != EFAULT) return 2;
    }

    /* The PD is intact: a buffer of the program's still registers. */
    long page = sysconf(_SC_PAGESIZE);
    void *buffer = NULL;
    if (posix_memalign(&buffer, page, page)) { perror("posix_memalign"); return 2; }
    mr = ibv_reg_mr(pd, buffer, page, IBV_ACCESS_LOCAL_WRITE);
    if (!mr) { perror("ibv_reg_mr"); return 2; }
    if (ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(context)) {
        perror("teardown");
        return 2;
    }
    free(buffer);
    ibv_free_device_list(list);
    return refused ? 0 : 1;
}
