/* ftar_wire.h — FTAR frame format, shared by members (ftar_control.c,
 * ftar_port.c, ftar_ring.c, ftar_hier.c) and the coordinator (ftar_coord.c). Internal:
 * not for other modules.
 *
 * Every frame, control or data, is a 40-byte little-endian header and a
 * payload of `len` bytes:
 *
 *   off  size  field
 *     0     4  magic   "FTAR"
 *     4     2  type    FT_* below
 *     6     2  flags
 *     8     8  epoch
 *    16     8  seq     collective (caller's step) number
 *    24     4  index   data: frame number in the collective; control: slot,
 *                      decision or token value (per type)
 *    28     4  len     payload bytes
 *    32     4  aux     per type (CONNECT: destination slot)
 *    36     4  crc     CRC32C of the payload, continued over header bytes
 *                      0..35 (payload first, so a payload CRC computed while
 *                      copying or reducing is finished in 36 bytes)
 *
 * A reader validates magic, type and len against the most that type may
 * carry *before* reading the payload, so no buffer is ever sized by an
 * unchecked length; the CRC is checked once the payload is in.
 *
 * Control payloads (member <-> coordinator):
 *   HELLO    m->c  index=slot, seq = the collective to enter at (0: the next);
 *                  u32 version, u16 data port, u16 hostlen, host[48]
 *   WELCOME  c->m  u64 uid, u32 deadline ms, u32 heartbeat ms
 *   REJECT   c->m  index=FTAR_E* code; reason text (<= 200 bytes)
 *   BYE      c->m  the same, then the coordinator closes (evicted, lapsed)
 *   HEARTBEAT m->c epoch = latest epoch the member knows; no payload
 *   EPOCH    c->m  flags FTF_ABORT_PREV, seq = its first collective (a join at
 *                  a chosen seq; 0: the next); u32 n, n x 64-byte entries:
 *                  u32 slot, u16 port, u16 hostlen, u64 uid, host[48]
 *   SYNC     m->c  epoch, seq = the collective it is in, flags FTF_FULL|FTF_FRESH
 *   GO       c->m  epoch, seq, index = FT_GO_RUN / FT_GO_COMMIT / FT_GO_ESEQ /
 *                  FT_GO_CANCEL (the group winds down: what would run does not);
 *                  flags FTF_WIND: decided while the group winds down (no
 *                  member of the epoch runs a collective in it)
 *   ABORT    m->c  epoch, seq of the collective that failed
 *   LEAVE    m->c  seq = its last completed collective: a clean exit at a
 *                  collective boundary (no abort, unlike a closed connection);
 *                  flags FTF_ABORT_PREV: it leaves with a collective in
 *                  flight (ftar_member_leave), which the epoch aborts
 *   COMMID   m->c  epoch, index = slot; the 128-byte communicator id that the
 *                  epoch's rank 0 (first member of its list) made for the
 *                  device data plane (ftar_dev.c)
 *            c->m  epoch; the same id, sent to every member once rank 0
 *                  offered it. The coordinator keeps one id, for its current
 *                  epoch, and forgets it when it publishes the next; an id
 *                  for an older epoch (a collective still running there
 *                  after a join, clean leave or wind-down) is passed on, not kept
 *   WIND     m->c  index = slot: the member winds down (ftar_member_wind_down)
 *                  and so does the group, from now on: the coordinator
 *                  publishes a boundary epoch (no FTF_ABORT_PREV), so every
 *                  member syncs before its next collective
 *            c->m  the group winds down: every member, and one that registers
 *                  later, gets it (no payload)
 * Data frames (member -> its downstream neighbour):
 *   CONNECT  first frame of a link: epoch, index = sender slot, aux = receiver
 *            slot; u64 sender uid, u32 pid, u32 memfd, u32 ring bytes, u32 ring
 *            level (0 flat, 1 the host's local ring, 2 the leaders' ring of
 *            ftar_hier.c; the receiver refuses a level >= 3), u64 ring token. flags FTF_SHM offers a same-host shared-memory
 *            ring (the memfd, opened as /proc/pid/fd/N); the receiver answers
 *            one byte, 'S' (frames go through the ring; the TCP link then only
 *            carries 1-byte doorbells and EOF) or 'T' (frames go over TCP)
 *   DATA     epoch, seq, flags = op | phase << 8 (phase 0: the flat ring;
 *            1..7: ftar_hier.c's phases), index = frame number within the
 *            phase, aux = element count (low 32 bits), len = payload bytes
 *            (float32)
 *   TOKEN    epoch, seq, flags = phase << 8, index = commit token value
 *            (1..p-1)
 */
#ifndef TRANSOM_FTAR_WIRE_H
#define TRANSOM_FTAR_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "crc32c.h"
#include "ftar.h"

#define FTAR_MAGIC 0x52415446u /* "FTAR" read as little-endian u32 */
#define FTAR_VERSION 1u
#define FTAR_HDR 40
#define FTAR_HELLO_LEN 56
#define FTAR_WELCOME_LEN 16
#define FTAR_ENTRY_LEN 64
#define FTAR_REASON_MAX 200
#define FTAR_CONNECT_LEN 32
#define FTAR_COMMID_LEN 128 /* TR_COMM_ID_BYTES of backend.h */

enum {
  FT_HELLO = 1,
  FT_WELCOME = 2,
  FT_REJECT = 3,
  FT_BYE = 4,
  FT_HEARTBEAT = 5,
  FT_EPOCH = 6,
  FT_SYNC = 7,
  FT_GO = 8,
  FT_ABORT = 9,
  FT_LEAVE = 10,
  FT_COMMID = 11,
  FT_WIND = 12,
  FT_CONNECT = 32,
  FT_DATA = 33,
  FT_TOKEN = 34,
};

enum { FTF_ABORT_PREV = 1, FTF_FULL = 2, FTF_FRESH = 4, FTF_SHM = 8, FTF_WIND = 16 };
enum { FT_GO_RUN = 1, FT_GO_COMMIT = 2, FT_GO_ESEQ = 3, FT_GO_CANCEL = 4 };

typedef struct {
  uint32_t magic;
  uint16_t type, flags;
  uint64_t epoch, seq;
  uint32_t index, len, aux, crc;
} ftar_hdr;

/* --- little-endian helpers --- */

static inline void ftw_put16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void ftw_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void ftw_put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t ftw_get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t ftw_get32(const uint8_t *p) {
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t ftw_get64(const uint8_t *p) { return (uint64_t)ftw_get32(p) | ((uint64_t)ftw_get32(p + 4) << 32); }

/* Writes h (crc field included as given) into out. */
void ftar_hdr_encode(uint8_t out[FTAR_HDR], const ftar_hdr *h);
void ftar_hdr_decode(const uint8_t in[FTAR_HDR], ftar_hdr *h);
/* CRC of a frame: payload, then header bytes 0..35. */
uint32_t ftar_frame_crc(const uint8_t hdr[FTAR_HDR], const void *payload, size_t len);
/* The same from an already computed payload CRC. */
uint32_t ftar_frame_crc_finish(uint32_t payload_crc, const uint8_t hdr[FTAR_HDR]);
/* Sets magic, computes the crc and encodes h into out. */
void ftar_frame_build(uint8_t out[FTAR_HDR], ftar_hdr *h, const void *payload);
void ftar_frame_build_crc(uint8_t out[FTAR_HDR], ftar_hdr *h, uint32_t payload_crc);
/* Checks magic, that type is known and len within what the type may carry
 * (data_max = the largest DATA payload the reader expects). Returns 0, or -1
 * with a reason written into why. */
int ftar_hdr_check(const ftar_hdr *h, uint32_t data_max, char *why, size_t why_len);
/* Name of a frame type for logs ("DATA", "?"). */
const char *ftar_type_name(unsigned type);

#endif
