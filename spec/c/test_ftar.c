/* test_ftar.c — FTAR: wire format and CRC32C (placeholder while the
 * process-level scenarios are written). */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "ftar.h"
#include "ftar_wire.h"

int main(void) {
  CHECK(ftar_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value");
  CHECK(ftar_crc32c_sw(0, "123456789", 9) == 0xE3069283u, "crc32c sw check value");
  return check_report("test_ftar");
}
