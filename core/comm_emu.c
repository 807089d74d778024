/* comm_emu.c — placeholder until the shared-memory communicator lands (see comm_emu.h). */
#include "comm_emu.h"

#include "util.h"

int emu_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  (void)id;
  return tr_fail(TR_ESTATE, "emu communicator: not built yet");
}
int emu_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  (void)out, (void)id, (void)nranks, (void)rank, (void)timeout;
  return tr_fail(TR_ESTATE, "emu communicator: not built yet");
}
int emu_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  (void)c, (void)buf, (void)n, (void)scale, (void)deadline;
  return tr_fail(TR_ESTATE, "emu communicator: not built yet");
}
void emu_comm_destroy(tr_comm *c) { (void)c; }
