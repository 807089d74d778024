/* ckpt_reaches_ftar_wire.c — boundary probe (never linked): the checkpoint
 * engine once included FTAR's private wire header to borrow its CRC32C.
 * With one library per folder that include must fail to compile (ctest
 * boundary_forbidden expects "ftar_wire.h: No such file"). */
#include "ckpt.h"
#include "ftar_wire.h"

uint32_t probe_forbidden(const void *p, size_t n) { return tr_crc32c(0, p, n); }
