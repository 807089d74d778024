/* step_record.c — the step record's three spellings, generated from the one
 * table in step_record.h: a metrics.jsonl line, the STEP line's pairs, and
 * the parser of those pairs. Does not send or store anything itself.
 */
#include "step_record.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A non-finite value is written as null in JSON (standard JSON has no NaN)
 * and as "nan"/"inf" on the STEP line, which strtod reads back. */
static int json_num(FILE *f, const char *key, double v) {
  return isfinite(v) ? fprintf(f, ",\"%s\":%.9g", key, v) : fprintf(f, ",\"%s\":null", key);
}

int step_record_json(FILE *f, const step_record *r) {
  int bad = fprintf(f, "{\"step\":%lld", (long long)r->step) < 0;
#define J_INT(name, help) \
  if (strcmp(#name, "step") != 0) bad |= fprintf(f, ",\"" #name "\":%lld", (long long)r->name) < 0;
  STEP_COUNTERS(J_INT)
#undef J_INT
#define J_NUM(ID, name, help, prom, phase) bad |= json_num(f, #name, r->name) < 0;
  STEP_METRICS(J_NUM)
#undef J_NUM
  if (r->has_checksum) bad |= fprintf(f, ",\"checksum\":\"%08x\"", r->checksum) < 0;
  bad |= fputs("}\n", f) < 0;
  return bad ? -1 : 0;
}

int step_record_line(char *out, size_t n, const step_record *r) {
  size_t k = 0;
  int w;
#define PUT(...)                                                  \
  do {                                                            \
    w = snprintf(out + k, k < n ? n - k : 0, __VA_ARGS__);        \
    if (w < 0 || (k += (size_t)w) >= n) return -1;                \
  } while (0)
#define L_INT(name, help) PUT("%s" #name "=%lld", k ? " " : "", (long long)r->name);
  STEP_COUNTERS(L_INT)
#undef L_INT
#define L_NUM(ID, name, help, prom, phase) PUT(" " #name "=%.9g", r->name);
  STEP_METRICS(L_NUM)
#undef L_NUM
  if (r->has_checksum) PUT(" checksum=%08x", r->checksum);
#undef PUT
  return (int)k;
}

/* The value of key in "VERB k=v k=v", or NULL. */
static const char *value_of(const char *line, const char *key) {
  size_t kl = strlen(key);
  for (const char *p = line; (p = strstr(p, key)) != NULL; p += kl)
    if ((p == line || p[-1] == ' ') && p[kl] == '=') return p + kl + 1;
  return NULL;
}

int step_record_parse(const char *line, step_record *r) {
  memset(r, 0, sizeof *r);
  int found = 0;
  const char *v;
#define P_INT(name, help) \
  if ((v = value_of(line, #name)) != NULL) r->name = strtoll(v, NULL, 10), found++;
  STEP_COUNTERS(P_INT)
#undef P_INT
#define P_NUM(ID, name, help, prom, phase) \
  if ((v = value_of(line, #name)) != NULL) r->name = strtod(v, NULL), found++;
  STEP_METRICS(P_NUM)
#undef P_NUM
  if ((v = value_of(line, "checksum")) != NULL) {
    r->checksum = (uint32_t)strtoul(v, NULL, 16);
    r->has_checksum = 1;
    found++;
  }
  return found;
}
