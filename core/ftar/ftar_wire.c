/* ftar_wire.c — FTAR frame encoding and validation. See ftar_wire.h.
 * Checksums come from core/base's CRC32C (crc32c.h).
 */
#include "ftar_wire.h"

#include <stdio.h>

/* --- headers --- */

void ftar_hdr_encode(uint8_t out[FTAR_HDR], const ftar_hdr *h) {
  ftw_put32(out, h->magic);
  ftw_put16(out + 4, h->type);
  ftw_put16(out + 6, h->flags);
  ftw_put64(out + 8, h->epoch);
  ftw_put64(out + 16, h->seq);
  ftw_put32(out + 24, h->index);
  ftw_put32(out + 28, h->len);
  ftw_put32(out + 32, h->aux);
  ftw_put32(out + 36, h->crc);
}

void ftar_hdr_decode(const uint8_t in[FTAR_HDR], ftar_hdr *h) {
  h->magic = ftw_get32(in);
  h->type = ftw_get16(in + 4);
  h->flags = ftw_get16(in + 6);
  h->epoch = ftw_get64(in + 8);
  h->seq = ftw_get64(in + 16);
  h->index = ftw_get32(in + 24);
  h->len = ftw_get32(in + 28);
  h->aux = ftw_get32(in + 32);
  h->crc = ftw_get32(in + 36);
}

uint32_t ftar_frame_crc(const uint8_t hdr[FTAR_HDR], const void *payload, size_t len) {
  return ftar_frame_crc_finish(len ? tr_crc32c(0, payload, len) : 0, hdr);
}

uint32_t ftar_frame_crc_finish(uint32_t payload_crc, const uint8_t hdr[FTAR_HDR]) {
  return tr_crc32c(payload_crc, hdr, 36);
}

void ftar_frame_build(uint8_t out[FTAR_HDR], ftar_hdr *h, const void *payload) {
  ftar_frame_build_crc(out, h, h->len ? tr_crc32c(0, payload, h->len) : 0);
}

void ftar_frame_build_crc(uint8_t out[FTAR_HDR], ftar_hdr *h, uint32_t payload_crc) {
  h->magic = FTAR_MAGIC;
  h->crc = 0;
  ftar_hdr_encode(out, h);
  h->crc = ftar_frame_crc_finish(payload_crc, out);
  ftw_put32(out + 36, h->crc);
}

const char *ftar_type_name(unsigned type) {
  switch (type) {
  case FT_HELLO: return "HELLO";
  case FT_WELCOME: return "WELCOME";
  case FT_REJECT: return "REJECT";
  case FT_BYE: return "BYE";
  case FT_HEARTBEAT: return "HEARTBEAT";
  case FT_EPOCH: return "EPOCH";
  case FT_SYNC: return "SYNC";
  case FT_GO: return "GO";
  case FT_ABORT: return "ABORT";
  case FT_LEAVE: return "LEAVE";
  case FT_COMMID: return "COMMID";
  case FT_WIND: return "WIND";
  case FT_CONNECT: return "CONNECT";
  case FT_DATA: return "DATA";
  case FT_TOKEN: return "TOKEN";
  default: return "?";
  }
}

int ftar_hdr_check(const ftar_hdr *h, uint32_t data_max, char *why, size_t why_len) {
  uint32_t max;
  if (h->magic != FTAR_MAGIC) {
    snprintf(why, why_len, "bad magic 0x%08x", h->magic);
    return -1;
  }
  switch (h->type) {
  case FT_HELLO: max = FTAR_HELLO_LEN; break;
  case FT_WELCOME: max = FTAR_WELCOME_LEN; break;
  case FT_REJECT:
  case FT_BYE: max = FTAR_REASON_MAX; break;
  case FT_EPOCH: max = 4 + FTAR_ENTRY_LEN * FTAR_MAX_MEMBERS; break;
  case FT_HEARTBEAT:
  case FT_SYNC:
  case FT_GO:
  case FT_ABORT:
  case FT_LEAVE:
  case FT_WIND:
  case FT_TOKEN: max = 0; break;
  case FT_CONNECT: max = FTAR_CONNECT_LEN; break;
  case FT_COMMID: max = FTAR_COMMID_LEN; break;
  case FT_DATA: max = data_max; break;
  default: snprintf(why, why_len, "unknown frame type %u", h->type); return -1;
  }
  if (h->len > max) {
    snprintf(why, why_len, "%s frame length %u beyond the %u expected", ftar_type_name(h->type), h->len, max);
    return -1;
  }
  return 0;
}
