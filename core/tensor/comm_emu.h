/* comm_emu.h — the "emu" backend's communicator: the tr_comm functions of
 * backend.h over POSIX shared memory between processes on one host.
 *
 * It stands in for NCCL on machines without a GPU so that FTAR's device data
 * plane (one communicator per membership epoch, id handed out through the
 * coordinator, watchdog abort, re-creation at epoch+1) is exercised by real
 * processes in tests: a rank that is killed or stopped makes the others'
 * collective fail after the deadline, exactly where NCCL's watchdog would
 * abort. The id names a shared-memory segment; rank 0 creates it.
 */
#ifndef TRANSOM_COMM_EMU_H
#define TRANSOM_COMM_EMU_H

#include "backend.h"

int emu_comm_id(uint8_t id[TR_COMM_ID_BYTES]);
int emu_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout);
/* The same for a rank on emulated device `dev` (>= 0): when every rank has
 * attached, two ranks on one device fail creation on every rank with
 * TR_EINVAL, as NCCL refuses two ranks on one GPU (a retry cannot mend
 * it). dev < 0: not checked (emu_comm_create). */
int emu_comm_create_on(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout,
                       int dev);
int emu_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline);
/* finalize is backend.h's; emu never waits for the other ranks either way. */
void emu_comm_destroy(tr_comm *c, int finalize);

#endif
