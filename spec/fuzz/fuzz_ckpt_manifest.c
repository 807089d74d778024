/* fuzz_ckpt_manifest.c — fuzzes the checkpoint manifest decoder
 * (ckpt_manifest_decode, ckpt/ckpt_internal.h: what ckpt_reader_* runs on
 * every manifest value read from LMDB) on arbitrary bytes. Does not open
 * LMDB or read tensor data. Built by CMake with -DTRANSOM_FUZZ=ON (with
 * ckpt/ on its include path, the white-box seam); run by run.sh.
 *
 * Input: a manifest value. It is decoded twice: as given (almost always
 * refused at the trailing CRC32C) and with a correct CRC32C of it appended,
 * so that the fuzzer reaches the header and the tensor table.
 *
 * Checked: a refusal has a message, leaves *tensors untouched and allocates
 * nothing (LeakSanitizer); an accepted manifest has chunk > 0, a tensor
 * count that its bytes can hold (each entry takes at least 16), names
 * NUL-terminated within CKPT_NAME_MAX, at most CKPT_MAX_DIMS dimensions, and
 * m->tensors == *tensors.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_internal.h"
#include "crc32c.h"
#include "fuzz.h"
#include "util.h"

#define MIN_ENTRY 16 /* u16 name length, u8 dtype, u8 ndim, u64 bytes, u32 crc */

static void decode(const uint8_t *data, size_t len) {
  ckpt_manifest m;
  ckpt_tensor_info sentinel, *t = &sentinel;
  uint64_t chunk = 0;
  int rc = ckpt_manifest_decode(data, len, &m, &t, &chunk);
  if (rc) {
    FUZZ_CHECK(rc < 0 && tr_error()[0] != 0, "refused (%d) without a message", rc);
    FUZZ_CHECK(t == &sentinel, "a refused manifest changed *tensors");
    return;
  }
  FUZZ_CHECK(chunk > 0, "accepted with chunk 0");
  FUZZ_CHECK(m.tensors == t && t != &sentinel, "m.tensors is not *tensors");
  FUZZ_CHECK(m.ntensors >= 0 && (size_t)m.ntensors <= len / MIN_ENTRY, "%d tensors in %zu bytes", m.ntensors, len);
  uint64_t bytes = 0;
  for (int i = 0; i < m.ntensors; i++) {
    FUZZ_CHECK(memchr(t[i].name, 0, CKPT_NAME_MAX) != NULL, "tensor %d: name not NUL-terminated", i);
    FUZZ_CHECK(t[i].ndim >= 0 && t[i].ndim <= CKPT_MAX_DIMS, "tensor %d: %d dimensions", i, t[i].ndim);
    bytes += t[i].bytes;
  }
  FUZZ_CHECK(bytes == m.bytes, "m.bytes %llu, the tensors' sum %llu", (unsigned long long)m.bytes,
             (unsigned long long)bytes);
  free(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  decode(data, size);
  uint8_t *sealed = malloc(size + 4); /* exact size: ASan sees a read past the end */
  FUZZ_CHECK(sealed != NULL, "out of memory");
  if (size) memcpy(sealed, data, size);
  uint32_t crc = tr_crc32c(0, data, size);
  memcpy(sealed + size, &crc, 4); /* the encoder's byte order: the host's (ckpt.c WB) */
  decode(sealed, size + 4);
  free(sealed);
  return 0;
}
