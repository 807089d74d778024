/* fuzz_ftar_frame.c — fuzzes FTAR's wire frames (core/ftar/ftar_wire.c:
 * ftar_hdr_decode, ftar_hdr_check, ftar_frame_crc) on arbitrary bytes, the
 * way a member or the coordinator meets them off a socket before trusting
 * them. Does not open sockets or run the members' payload parsers (those
 * are static in ftar_control.c, ftar_coord.c, ftar_port.c); it checks what
 * they rely on. Built by CMake with -DTRANSOM_FUZZ=ON; run by run.sh.
 *
 * Input: a u32 (little-endian) that sets the largest DATA payload the ring
 * expects (data_max, taken modulo 64 KiB), then a byte stream read as
 * back-to-back frames, as ctl_read_cb and conn_read_cb read them: decode
 * 40 bytes, check, wait for the payload, check the CRC, go on. A frame that
 * fails the check ends the stream (the readers close the link).
 *
 * Checked, for every header:
 *   - encode(decode(bytes)) gives the same 40 bytes;
 *   - a header that passes ftar_hdr_check has a payload length that fits the
 *     buffer of every reader that accepts its type (the member's ctl_buf,
 *     the coordinator's COMMID-sized pay, the data port's CONNECT buffer,
 *     the ring's data_max); the payload is copied into a heap buffer of
 *     exactly that size, so AddressSanitizer sees any overrun;
 *   - a refused header leaves a NUL-terminated reason that fits `why`;
 *   - the one-shot CRC equals the streaming form (payload CRC, then
 *     ftar_frame_crc_finish), and a frame whose CRC matches rebuilds
 *     (ftar_frame_build) to the same 40 bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "ftar_member_internal.h"
#include "ftar_wire.h"
#include "fuzz.h"

/* The buffers the readers copy a checked payload into. */
#define MEMBER_CTL_BUF sizeof(((ftar_member *)0)->ctl_buf) /* ftar_control.c ctl_read_cb */
#define COORD_PAY FTAR_COMMID_LEN                           /* ftar_coord.c conn_read_cb: "the longest frame a member sends" */
#define PORT_PAY (sizeof(((pending *)0)->b) - FTAR_HDR)     /* ftar_port.c: a CONNECT */

/* The smallest buffer among the readers that accept this type: the payload
 * must fit it once ftar_hdr_check passed. */
static size_t reader_cap(unsigned type, uint32_t data_max) {
  switch (type) {
  case FT_EPOCH:
  case FT_GO: return MEMBER_CTL_BUF; /* coordinator -> member */
  case FT_BYE:
  case FT_REJECT: return FTAR_REASON_MAX; /* ctl_on_bye, handshake(): reason[FTAR_REASON_MAX + 1], NUL after it */
  case FT_COMMID: return COORD_PAY < MEMBER_CTL_BUF ? COORD_PAY : MEMBER_CTL_BUF; /* both ways */
  case FT_HELLO:
  case FT_HEARTBEAT:
  case FT_SYNC:
  case FT_ABORT:
  case FT_LEAVE: return COORD_PAY; /* member -> coordinator */
  case FT_WELCOME: return FTAR_REASON_MAX + 1; /* ftar_control.c handshake(): pay[FTAR_REASON_MAX + 1] */
  case FT_CONNECT: return PORT_PAY;
  case FT_DATA: return data_max; /* the ring reads into the segment it expects */
  case FT_WIND: /* both ways, no payload */
  case FT_TOKEN: return 0;
  default: return 0;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 4) return 0;
  uint32_t data_max = ftw_get32(data) % (64u * 1024);
  data += 4;
  size -= 4;
  while (size >= FTAR_HDR) {
    ftar_hdr h;
    ftar_hdr_decode(data, &h);
    uint8_t again[FTAR_HDR];
    ftar_hdr_encode(again, &h);
    FUZZ_CHECK(memcmp(again, data, FTAR_HDR) == 0, "decode/encode does not round-trip");

    /* why: as small as 1 byte (snprintf truncates), as large as the readers' */
    char why[200];
    size_t why_len = 1 + (size_t)(data[6] % sizeof why);
    memset(why, 0x5a, sizeof why);
    if (ftar_hdr_check(&h, data_max, why, why_len) != 0) {
      FUZZ_CHECK(memchr(why, 0, why_len) != NULL, "the refusal reason is not NUL-terminated within why_len");
      for (size_t i = why_len; i < sizeof why; i++) FUZZ_CHECK(why[i] == 0x5a, "wrote past why_len");
      return 0; /* the reader closes the link */
    }
    FUZZ_CHECK(h.magic == FTAR_MAGIC, "a header with a bad magic passed");
    FUZZ_CHECK(strcmp(ftar_type_name(h.type), "?") != 0, "an unknown type %u passed", h.type);
    size_t cap = reader_cap(h.type, data_max);
    FUZZ_CHECK(h.len <= cap, "%s frame of %u bytes passed the check; its reader holds %zu", ftar_type_name(h.type),
               h.len, cap);
    if (size - FTAR_HDR < h.len) return 0; /* the reader waits for the rest */

    uint8_t *pay = malloc(cap ? cap : 1); /* exactly the reader's buffer */
    FUZZ_CHECK(pay != NULL, "out of memory");
    memcpy(pay, data + FTAR_HDR, h.len);
    uint32_t crc = ftar_frame_crc(data, pay, h.len);
    uint32_t streamed = ftar_frame_crc_finish(h.len ? tr_crc32c(0, pay, h.len) : 0, data);
    FUZZ_CHECK(crc == streamed, "one-shot CRC %08x, streamed %08x", crc, streamed);
    if (crc == h.crc) { /* trusted: the sender's build gives these bytes */
      ftar_hdr b = h;
      uint8_t built[FTAR_HDR];
      ftar_frame_build(built, &b, pay);
      FUZZ_CHECK(memcmp(built, data, FTAR_HDR) == 0, "a frame with a valid CRC does not rebuild to itself");
    }
    free(pay);
    if (crc != h.crc) return 0; /* bad checksum: the reader closes the link */
    data += FTAR_HDR + h.len;
    size -= FTAR_HDR + h.len;
  }
  return 0;
}
