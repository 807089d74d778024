/* ckpt_uses_crc32c.c — boundary probe (never linked): what the checkpoint
 * engine may include: its own header, base's CRC32C, tensor's backend. It
 * must compile with exactly ckpt's include paths (ctest boundary_allowed). */
#include "backend.h"
#include "ckpt.h"
#include "crc32c.h"

uint32_t probe_allowed(const void *p, size_t n) { return tr_crc32c(0, p, n); }
