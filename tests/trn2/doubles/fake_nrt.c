/*
 * TEST DOUBLE of libnrt, the AWS Neuron runtime C library.  NOT the Neuron runtime.
 *
 * It implements exactly the libnrt functions that deepinfer/runtime/neuron/libnrt.py
 * binds, with the signatures of nrt/nrt.h, nrt/nrt_experimental.h and
 * nrt/nrt_version.h, so that the tests in tests/trn2/ can check how the
 * binding calls the API (argument order, out-parameters, struct layouts,
 * status handling, call order, collective calls across rank processes). It runs no model and knows nothing about
 * Trainium: passing against it proves nothing about Trn2 behaviour or numerics.
 *
 * Every call is appended as one line "<function> <key=value ...> -> <status>"
 * to the file named by $FAKE_NRT_LOG (no log when unset).  nrt_execute's line
 * carries the bytes copied host->device (nrt_tensor_write) and device->host
 * (nrt_tensor_read) since nrt_init: to_device=N to_host=M.  $FAKE_NRT_FAIL=
 * "<function>=<status>" makes that function return <status> without acting.
 *
 * Collectives.  nrt_build_global_comm, nrt_load_collectives and nrt_execute of a model loaded
 * with nrt_load_collectives are this process's "collective calls", numbered from 1 since
 * nrt_init; each needs NEURON_RT_ROOT_COMM_ID and logs rank=, world=, root= (the
 * variable's value), call= (its number) and, for loads and executions, model= (an FNV-1a hash of
 * the NEFF bytes, the same on every rank that loads the same file).  As on Trn2, where each of
 * these calls waits for every rank, they wait for the other ranks when $FAKE_NRT_COLLECTIVES_DIR
 * names a directory the ranks share: call n of rank r writes "<root>.<n>.<r>" there holding its
 * model hash, and returns once every rank of its world has written call n with the same hash (a
 * rank at another model at call n is logged as a MISMATCH and waited for forever, as peers
 * running different programs never complete a collective).  Unset: nothing is waited for.
 * $FAKE_NRT_HANG_RANK="<r>[:<n>]" makes rank r never arrive at its collective call n (default
 * 1): the double logs it and stops the whole process (SIGSTOP), so no thread of that rank runs
 * again until it is killed, as a rank that never got there.  None of this is the runtime's
 * behaviour beyond the waiting: it only lets tests check that every rank makes the same
 * collective calls in the same order, and what the caller does when one never comes.
 *
 * nrt_load runs no NEFF.  It takes a small text description (the "fake model"):
 *
 *     FAKE_NRT_MODEL 1
 *     input  <name> <bytes>
 *     output <name> <bytes>
 *     copy   <output name> <input name>     (on execute: output bytes <- input bytes)
 *     end                                   (optional in a bare description)
 *
 * either bare (written by the tests) or inside a NEFF-shaped file: a blob that
 * starts with a 1024-byte NEFF header (package version 1 or 2 at byte 0, header
 * size 1024 at byte 8, as deepinfer/bundles/neff.py reads it) is searched for
 * the "FAKE_NRT_MODEL 1" marker, and the description runs from there to its
 * "end" line (the stand-in neuronx-cc, doubles/neuronx_cc_stub.py, puts it in
 * an uncompressed tar member).  On execute, outputs that no copy line writes
 * are zero-filled.  When $FAKE_NRT_ANSWERS names a directory holding "<model>.<output name>" (model:
 * the FNV-1a 64 hash of the NEFF bytes, as above) of exactly the output's size, that output (copied
 * or not) is then filled with the file's bytes, the answer a test recorded (from XLA:CPU) for the inputs it
 * knows the caller gives: the double computes nothing, so a caller comparing outputs with XLA:CPU
 * sees agreement only where the test put the answer (logged as answered=N when set).
 *
 * nrt_get_total_nc_count and nrt_get_visible_nc_count report $FAKE_NRT_CORES NeuronCores (default
 * 8; one visible when NEURON_RT_VISIBLE_CORES is set, as the double runs one core a process).
 *
 * Tensors are malloc'd host memory with size bookkeeping; a slice is a view
 * into its source's memory.  Misuse returns the status libnrt documents for
 * it where there is one (NRT_INVALID for bad sizes/names, NRT_UNINITIALIZED
 * outside nrt_init/nrt_close).
 *
 * Build: gcc -shared -fPIC -O1 -o libfake_nrt.so fake_nrt.c
 */

#define _GNU_SOURCE         /* memmem */
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef enum {
    NRT_SUCCESS = 0, NRT_FAILURE = 1, NRT_INVALID = 2, NRT_RESOURCE = 4, NRT_UNINITIALIZED = 13,
} NRT_STATUS;

#define NAME_MAX_ 256       /* NRT_TENSOR_NAME_MAX */
#define MAX_IO 256         /* a region takes ~40 tensors */

typedef struct nrt_tensor {
    char name[NAME_MAX_];
    unsigned char *data;
    size_t size;
    int owns;                    /* 0 for a slice */
    int live_slices;
    struct nrt_tensor *source;   /* the tensor a slice views */
} nrt_tensor_t;

typedef void nrt_tensor_set_t;
typedef int nrt_framework_type_t;     /* C enums: int-sized; NRT_FRAMEWORK_TYPE_NO_FW = 1 */
typedef int nrt_tensor_placement_t;   /* DEVICE = 0, HOST = 1, VIRTUAL = 2 */

typedef struct nrt_tensor_info {      /* layout of nrt_experimental.h */
    char name[NAME_MAX_];
    int usage;                        /* nrt_tensor_usage_t: 0 input, 1 output */
    size_t size;
    int dtype;                        /* nrt_dtype_t */
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct nrt_tensor_info_array {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

typedef struct nrt_version {          /* layout of nrt_version.h */
    uint64_t rt_major, rt_minor, rt_patch, rt_maintenance;
    char rt_detail[128];
    char git_hash[64];
} nrt_version_t;

typedef struct { char name[NAME_MAX_]; size_t size; int usage; } fake_io;

typedef struct nrt_model {
    int n_io, n_copy;
    fake_io io[MAX_IO];
    int copy_out[MAX_IO], copy_in[MAX_IO];      /* indices into io */
    int collective;                             /* loaded with nrt_load_collectives */
    uint32_t rank, world;                       /* as it was loaded */
    char id[17];                                /* FNV-1a 64 of the NEFF bytes, hex */
} nrt_model_t;

typedef struct { int n; char names[MAX_IO][NAME_MAX_]; nrt_tensor_t *tensors[MAX_IO]; } fake_set;

static int g_init;
static long g_live_tensors, g_live_models, g_live_sets;
static int g_collective_calls;             /* nrt_build_global_comm, nrt_load_collectives, their executes */
static size_t g_to_device, g_to_host;      /* bytes through nrt_tensor_write / nrt_tensor_read since nrt_init */

static void log_line(const char *fmt, va_list ap, int status, int with_status) {
    const char *path = getenv("FAKE_NRT_LOG");
    if (!path || !*path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    vfprintf(f, fmt, ap);
    if (with_status) fprintf(f, " -> %d", status);
    fputc('\n', f);
    fclose(f);
}

/* log "<fmt ...> -> status" and return status */
static NRT_STATUS done(NRT_STATUS status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_line(fmt, ap, status, 1);
    va_end(ap);
    return status;
}

static void note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_line(fmt, ap, 0, 0);
    va_end(ap);
}

/* $FAKE_NRT_FAIL = "<function>=<status>" */
static int injected(const char *fn) {
    const char *spec = getenv("FAKE_NRT_FAIL");
    size_t n = strlen(fn);
    if (spec && strncmp(spec, fn, n) == 0 && spec[n] == '=') return atoi(spec + n + 1);
    return 0;
}

#define GUARD(fn)                                                                 \
    do {                                                                          \
        int s_ = injected(fn);                                                    \
        if (s_) return done((NRT_STATUS)s_, "%s injected", fn);                   \
        if (!g_init) return done(NRT_UNINITIALIZED, "%s before nrt_init", fn);    \
    } while (0)

static const char *or_empty(const char *s) { return s ? s : ""; }
static void fnv1a(const void *bytes, size_t size, char out[17]);

/* ---- runtime ------------------------------------------------------------------------- */

NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    int s = injected("nrt_init");
    const char *visible = getenv("NEURON_RT_VISIBLE_CORES");
    if (s) return done((NRT_STATUS)s, "nrt_init injected");
    if (g_init) return done(NRT_FAILURE, "nrt_init already initialized");
    if (framework != 1 || !fw_version || !fal_version)      /* NRT_FRAMEWORK_TYPE_NO_FW */
        return done(NRT_INVALID, "nrt_init framework=%d", framework);
    g_init = 1;
    g_to_device = g_to_host = 0;
    g_collective_calls = 0;
    return done(NRT_SUCCESS, "nrt_init framework=%d fw_version='%s' fal_version='%s' visible_cores=%s",
                framework, fw_version, fal_version, visible ? visible : "unset");
}

void nrt_close(void) {
    note("nrt_close live_tensors=%ld live_models=%ld live_sets=%ld", g_live_tensors, g_live_models, g_live_sets);
    g_init = 0;
}

/* nrt_status.h's string for a status; the double's own words, marked as such */
const char *nrt_get_status_as_str(NRT_STATUS status) {
    switch ((int)status) {
    case 10: return "fake_nrt: unsupported NEFF version";
    case 1003: return "fake_nrt: execution completed with numerical errors (NaN)";
    default: return NULL;
    }
}

/* nrt.h: how many NeuronCores the instance has / this process may use (the double's $FAKE_NRT_CORES) */
static uint32_t fake_cores(void) {
    const char *n = getenv("FAKE_NRT_CORES");
    return n && *n ? (uint32_t)strtoul(n, NULL, 10) : 8;
}

NRT_STATUS nrt_get_total_nc_count(uint32_t *nc_count) {
    GUARD("nrt_get_total_nc_count");
    if (!nc_count) return done(NRT_INVALID, "nrt_get_total_nc_count nc_count=NULL");
    *nc_count = fake_cores();
    return done(NRT_SUCCESS, "nrt_get_total_nc_count count=%u", *nc_count);
}

NRT_STATUS nrt_get_visible_nc_count(uint32_t *nc_count) {
    GUARD("nrt_get_visible_nc_count");
    const char *visible = getenv("NEURON_RT_VISIBLE_CORES");
    if (!nc_count) return done(NRT_INVALID, "nrt_get_visible_nc_count nc_count=NULL");
    *nc_count = visible && *visible ? 1 : fake_cores();
    return done(NRT_SUCCESS, "nrt_get_visible_nc_count count=%u", *nc_count);
}

NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size) {
    nrt_version_t v = {2, 99, 0, 0, "fake_nrt test double", "none"};
    if (!ver) return done(NRT_INVALID, "nrt_get_version ver=NULL");
    memcpy(ver, &v, size < sizeof v ? size : sizeof v);
    return done(NRT_SUCCESS, "nrt_get_version size=%zu", size);
}

/* ---- models ---------------------------------------------------------------------------- */

static int find_io(const nrt_model_t *m, const char *name, int usage) {
    for (int i = 0; i < m->n_io; i++)
        if (m->io[i].usage == usage && strcmp(m->io[i].name, name) == 0) return i;
    return -1;
}

/* parse the fake model text; 0 on success.  `need_end`: the text must close with an "end" line. */
static int parse_model(char *text, nrt_model_t *m, int need_end) {
    char *save = NULL, *line = strtok_r(text, "\n", &save);
    int version = 0, ended = 0;
    if (!line || sscanf(line, "FAKE_NRT_MODEL %d", &version) != 1 || version != 1) return -1;
    while ((line = strtok_r(NULL, "\n", &save))) {
        char kind[16], a[NAME_MAX_], b[NAME_MAX_];
        size_t bytes;
        if (line[0] == '\0' || line[0] == '#') continue;
        if (strcmp(line, "end") == 0) {
            ended = 1;
            break;
        }
        if (sscanf(line, "%15s %255s %zu", kind, a, &bytes) == 3 &&
            (strcmp(kind, "input") == 0 || strcmp(kind, "output") == 0)) {
            if (m->n_io == MAX_IO) return -1;
            fake_io *io = &m->io[m->n_io++];
            snprintf(io->name, sizeof io->name, "%s", a);
            io->size = bytes;
            io->usage = strcmp(kind, "output") == 0;
        } else if (sscanf(line, "%15s %255s %255s", kind, a, b) == 3 && strcmp(kind, "copy") == 0) {
            int o = find_io(m, a, 1), i = find_io(m, b, 0);
            if (o < 0 || i < 0 || m->io[o].size != m->io[i].size || m->n_copy == MAX_IO) return -1;
            m->copy_out[m->n_copy] = o;
            m->copy_in[m->n_copy++] = i;
        } else {
            return -1;
        }
    }
    return need_end && !ended ? -1 : 0;
}

static const char MARKER[] = "FAKE_NRT_MODEL 1";
#define NEFF_HEADER_SIZE 1024

/* a NEFF-shaped blob: u64 package version (1 or 2) at byte 0, u64 header size 1024 at byte 8 */
static int neff_headed(const void *blob, size_t size) {
    uint64_t pkg, header_size;
    if (size < NEFF_HEADER_SIZE) return 0;
    memcpy(&pkg, blob, 8);
    memcpy(&header_size, (const char *)blob + 8, 8);
    return (pkg == 1 || pkg == 2) && header_size == NEFF_HEADER_SIZE;
}

NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count, nrt_model_t **model) {
    GUARD("nrt_load");
    if (!neff_bytes || !model) return done(NRT_INVALID, "nrt_load null argument");
    if (vnc != -1 && vnc != 0) return done(NRT_INVALID, "nrt_load vnc=%d (one visible core)", vnc);
    if (vnc_count != -1) return done(NRT_INVALID, "nrt_load vnc_count=%d (deprecated: must be -1)", vnc_count);
    const char *start = neff_bytes;
    int neff = neff_headed(neff_bytes, size);
    if (neff) {
        start = memmem(start + NEFF_HEADER_SIZE, size - NEFF_HEADER_SIZE, MARKER, sizeof MARKER - 1);
        if (!start)
            return done(NRT_INVALID, "nrt_load size=%zu vnc=%d NEFF without a fake model (gzip'd payload, "
                        "or not written by the stand-in neuronx-cc)", size, vnc);
    }
    size_t n = size - (size_t)(start - (const char *)neff_bytes);
    char *text = malloc(n + 1);
    nrt_model_t *m = calloc(1, sizeof *m);
    memcpy(text, start, n);
    text[n] = '\0';
    int bad = parse_model(text, m, neff);
    free(text);
    if (bad) {
        free(m);
        return done(NRT_INVALID, "nrt_load size=%zu vnc=%d not a fake model", size, vnc);
    }
    fnv1a(neff_bytes, size, m->id);
    *model = m;
    g_live_models++;
    return done(NRT_SUCCESS, "nrt_load size=%zu vnc=%d vnc_count=%d tensors=%d source=%s", size, vnc, vnc_count,
                m->n_io, neff ? "neff" : "text");
}

/* ---- collectives ----------------------------------------------------------------------- */

/* NEURON_RT_ROOT_COMM_ID, which every collective call needs; NULL when unset or empty */
static const char *root_comm(void) {
    const char *root = getenv("NEURON_RT_ROOT_COMM_ID");
    return root && *root ? root : NULL;
}

/* $FAKE_NRT_HANG_RANK = "<r>[:<n>]": does `rank` stop at its collective call `call`? */
static int hangs_here(uint32_t rank, int call) {
    const char *spec = getenv("FAKE_NRT_HANG_RANK");
    char *end;
    if (!spec || !*spec) return 0;
    long r = strtol(spec, &end, 10);
    long n = *end == ':' ? strtol(end + 1, NULL, 10) : 1;
    return r == (long)rank && n == call;
}

static void fnv1a(const void *bytes, size_t size, char out[17]) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < size; i++) h = (h ^ ((const unsigned char *)bytes)[i]) * 1099511628211ULL;
    snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* Collective call `call` of `rank` (see the header): stop the process if $FAKE_NRT_HANG_RANK says
 * so; else, with $FAKE_NRT_COLLECTIVES_DIR, write this rank's arrival and wait until every rank of
 * `world` has arrived at `call` with the same `model`.  NRT_FAILURE if the arrival cannot be written. */
static NRT_STATUS take_part(const char *fn, const char *root, uint32_t rank, uint32_t world, int call,
                            const char *model) {
    const char *dir = getenv("FAKE_NRT_COLLECTIVES_DIR");
    char path[4096], tmp[4200];
    if (hangs_here(rank, call)) {
        note("%s rank=%u call=%d FAKE_NRT_HANG_RANK: this rank never arrives (process stopped)", fn, rank, call);
        raise(SIGSTOP);
    }
    if (!dir || !*dir) return NRT_SUCCESS;
    snprintf(path, sizeof path, "%s/%s.%d.%u", dir, root, call, rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) return done(NRT_FAILURE, "%s rank=%u call=%d cannot write %s", fn, rank, call, tmp);
    fputs(model, f);
    fclose(f);
    rename(tmp, path);                       /* the others see it whole or not at all */
    for (uint32_t k = 0, told = 0; k < world;) {
        char theirs[32] = "";
        snprintf(path, sizeof path, "%s/%s.%d.%u", dir, root, call, k);
        FILE *peer = fopen(path, "r");
        if (peer) {
            if (!fgets(theirs, sizeof theirs, peer)) theirs[0] = '\0';
            fclose(peer);
            if (strcmp(theirs, model) == 0) {
                k++;
                continue;
            }
            if (!told) note("%s rank=%u call=%d MISMATCH rank %u is at model=%s, this rank at model=%s", fn, rank,
                            call, k, theirs, model);
            told = 1;
        }
        usleep(1000);
    }
    return NRT_SUCCESS;
}

/* nrt.h: set up the communicator of every NEFF with collectives this process will run, as rank
 * g_device_id of g_device_count.  The double checks what nrt_load_collectives checks and takes part. */
NRT_STATUS nrt_build_global_comm(int32_t vnc, uint32_t g_device_id, uint32_t g_device_count) {
    GUARD("nrt_build_global_comm");
    const char *root = root_comm();
    if (!root) return done(NRT_INVALID, "nrt_build_global_comm without NEURON_RT_ROOT_COMM_ID");
    if (vnc != 0) return done(NRT_INVALID, "nrt_build_global_comm vnc=%d (one visible core)", vnc);
    if (g_device_count < 1 || g_device_id >= g_device_count)
        return done(NRT_INVALID, "nrt_build_global_comm rank=%u world=%u (rank outside the world)", g_device_id,
                    g_device_count);
    int call = ++g_collective_calls;
    NRT_STATUS s = take_part("nrt_build_global_comm", root, g_device_id, g_device_count, call, "comm");
    if (s) return s;
    return done(NRT_SUCCESS, "nrt_build_global_comm vnc=%d rank=%u world=%u root=%s call=%d", vnc, g_device_id,
                g_device_count, root, call);
}

/* The load nrt.h prescribes for a NEFF that holds collectives.  The double checks what a real rank
 * needs (the rendezvous variable set, a rank inside its world), parses the model as nrt_load does
 * (which logs its own line first), takes part and logs the rank, world and model. */
NRT_STATUS nrt_load_collectives(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count,
                                uint32_t g_device_id, uint32_t g_device_count, nrt_model_t **model) {
    GUARD("nrt_load_collectives");
    const char *root = root_comm();
    if (!root) return done(NRT_INVALID, "nrt_load_collectives without NEURON_RT_ROOT_COMM_ID");
    if (g_device_count < 1 || g_device_id >= g_device_count)
        return done(NRT_INVALID, "nrt_load_collectives rank=%u world=%u (rank outside the world)", g_device_id,
                    g_device_count);
    NRT_STATUS s = nrt_load(neff_bytes, size, vnc, vnc_count, model);
    if (s) return s;
    nrt_model_t *m = *model;
    m->collective = 1;
    m->rank = g_device_id;
    m->world = g_device_count;
    fnv1a(neff_bytes, size, m->id);
    int call = ++g_collective_calls;
    s = take_part("nrt_load_collectives", root, m->rank, m->world, call, m->id);
    if (s) return s;
    return done(NRT_SUCCESS, "nrt_load_collectives rank=%u world=%u root=%s model=%s call=%d", m->rank, m->world,
                root, m->id, call);
}

NRT_STATUS nrt_unload(nrt_model_t *model) {
    GUARD("nrt_unload");
    if (!model) return done(NRT_INVALID, "nrt_unload model=NULL");
    free(model);
    g_live_models--;
    return done(NRT_SUCCESS, "nrt_unload");
}

NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info) {
    GUARD("nrt_get_model_tensor_info");
    if (!model || !tensor_info) return done(NRT_INVALID, "nrt_get_model_tensor_info null argument");
    nrt_tensor_info_array_t *arr = calloc(1, sizeof *arr + model->n_io * sizeof(nrt_tensor_info_t));
    arr->tensor_count = model->n_io;
    for (int i = 0; i < model->n_io; i++) {
        nrt_tensor_info_t *t = &arr->tensor_array[i];
        snprintf(t->name, sizeof t->name, "%s", model->io[i].name);
        t->usage = model->io[i].usage;
        t->size = model->io[i].size;
        t->dtype = 0x3;                   /* NRT_DTYPE_UINT8 in today's nrt.h: the double sees bytes */
        t->ndim = 1;
        t->shape = malloc(sizeof(uint32_t));
        t->shape[0] = (uint32_t)model->io[i].size;
    }
    *tensor_info = arr;
    return done(NRT_SUCCESS, "nrt_get_model_tensor_info count=%d", model->n_io);
}

NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info) {
    GUARD("nrt_free_model_tensor_info");
    if (!tensor_info) return done(NRT_INVALID, "nrt_free_model_tensor_info NULL");
    for (uint64_t i = 0; i < tensor_info->tensor_count; i++) free(tensor_info->tensor_array[i].shape);
    free(tensor_info);
    return done(NRT_SUCCESS, "nrt_free_model_tensor_info");
}

/* ---- tensors --------------------------------------------------------------------------- */

static nrt_tensor_t *new_tensor(const char *name, unsigned char *data, size_t size, nrt_tensor_t *source) {
    nrt_tensor_t *t = calloc(1, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", or_empty(name));
    t->data = data;
    t->size = size;
    t->owns = source == NULL;
    t->source = source;
    g_live_tensors++;
    return t;
}

NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t placement, int vnc, size_t size, const char *name,
                               nrt_tensor_t **tensor) {
    GUARD("nrt_tensor_allocate");
    if (!tensor || placement < 0 || placement > 2)
        return done(NRT_INVALID, "nrt_tensor_allocate placement=%d", placement);
    if (placement == 0 && vnc != 0)          /* NRT_TENSOR_PLACEMENT_DEVICE on the one visible core */
        return done(NRT_INVALID, "nrt_tensor_allocate placement=0 vnc=%d", vnc);
    *tensor = new_tensor(name, calloc(size ? size : 1, 1), size, NULL);
    return done(NRT_SUCCESS, "nrt_tensor_allocate placement=%d vnc=%d size=%zu name=%s", placement, vnc, size,
                or_empty(name));
}

NRT_STATUS nrt_tensor_allocate_slice(const nrt_tensor_t *source, size_t offset, size_t size, const char *name,
                                     nrt_tensor_t **slice) {
    GUARD("nrt_tensor_allocate_slice");
    if (!source || !slice) return done(NRT_INVALID, "nrt_tensor_allocate_slice null argument");
    if (offset > source->size || size > source->size - offset)
        return done(NRT_INVALID, "nrt_tensor_allocate_slice source=%s offset=%zu size=%zu outside %zu bytes",
                    source->name, offset, size, source->size);
    nrt_tensor_t *src = (nrt_tensor_t *)source;
    src->live_slices++;
    *slice = new_tensor(name, src->data + offset, size, src);
    return done(NRT_SUCCESS, "nrt_tensor_allocate_slice source=%s offset=%zu size=%zu name=%s", source->name,
                offset, size, or_empty(name));
}

void nrt_tensor_free(nrt_tensor_t **tensor) {
    if (!tensor || !*tensor) {
        note("nrt_tensor_free NULL");
        return;
    }
    nrt_tensor_t *t = *tensor;
    if (t->live_slices) {                    /* misuse: slices still point into it; leak instead */
        note("nrt_tensor_free name=%s MISUSE live_slices=%d", t->name, t->live_slices);
        return;
    }
    note("nrt_tensor_free name=%s", t->name);
    if (t->source) t->source->live_slices--;
    if (t->owns) free(t->data);
    free(t);
    *tensor = NULL;
    g_live_tensors--;
}

static NRT_STATUS check_range(const char *fn, const nrt_tensor_t *t, const void *buf, size_t offset, size_t size) {
    if (!t || !buf) return done(NRT_INVALID, "%s null argument", fn);
    if (offset > t->size || size > t->size - offset)
        return done(NRT_INVALID, "%s name=%s offset=%zu size=%zu outside %zu bytes", fn, t->name, offset, size,
                    t->size);
    return NRT_SUCCESS;
}

NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    GUARD("nrt_tensor_write");
    NRT_STATUS s = check_range("nrt_tensor_write", tensor, buf, offset, size);
    if (s) return s;
    memcpy(tensor->data + offset, buf, size);
    g_to_device += size;
    return done(NRT_SUCCESS, "nrt_tensor_write name=%s offset=%zu size=%zu", tensor->name, offset, size);
}

NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    GUARD("nrt_tensor_read");
    NRT_STATUS s = check_range("nrt_tensor_read", tensor, buf, offset, size);
    if (s) return s;
    memcpy(buf, tensor->data + offset, size);
    g_to_host += size;
    return done(NRT_SUCCESS, "nrt_tensor_read name=%s offset=%zu size=%zu", tensor->name, offset, size);
}

size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) {
    note("nrt_tensor_get_size name=%s", tensor ? tensor->name : "NULL");
    return tensor ? tensor->size : 0;
}

/* ---- tensor sets and execution ---------------------------------------------------------- */

NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result) {
    GUARD("nrt_allocate_tensor_set");
    if (!result) return done(NRT_INVALID, "nrt_allocate_tensor_set NULL");
    *result = calloc(1, sizeof(fake_set));
    g_live_sets++;
    return done(NRT_SUCCESS, "nrt_allocate_tensor_set");
}

NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name, nrt_tensor_t *tensor) {
    GUARD("nrt_add_tensor_to_tensor_set");
    fake_set *s = tensor_set;
    if (!s || !tensor_name || !tensor) return done(NRT_INVALID, "nrt_add_tensor_to_tensor_set null argument");
    int i = 0;
    while (i < s->n && strcmp(s->names[i], tensor_name) != 0) i++;
    if (i == MAX_IO) return done(NRT_RESOURCE, "nrt_add_tensor_to_tensor_set full");
    if (i == s->n) s->n++;
    snprintf(s->names[i], NAME_MAX_, "%s", tensor_name);
    s->tensors[i] = tensor;
    return done(NRT_SUCCESS, "nrt_add_tensor_to_tensor_set name=%s tensor=%s", tensor_name, tensor->name);
}

void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set) {
    note("nrt_destroy_tensor_set");
    if (!tensor_set || !*tensor_set) return;
    free(*tensor_set);
    *tensor_set = NULL;
    g_live_sets--;
}

static nrt_tensor_t *lookup(const fake_set *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->names[i], name) == 0) return s->tensors[i];
    return NULL;
}

/* Output `i` of `model` into `data` from $FAKE_NRT_ANSWERS/<model>.<name> when that holds exactly the
 * output's bytes (returns 1); else `data` is left as it is (returns 0). */
static int answer(const nrt_model_t *model, int i, unsigned char *data) {
    const char *dir = getenv("FAKE_NRT_ANSWERS");
    size_t size = model->io[i].size;
    char path[4096];
    if (!dir || !*dir) return 0;
    snprintf(path, sizeof path, "%s/%s.%s", dir, model->id, model->io[i].name);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long have = ftell(f);
    rewind(f);
    size_t got = have == (long)size ? fread(data, 1, size, f) : 0;
    fclose(f);
    return got == size;
}

NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set, nrt_tensor_set_t *output_set) {
    GUARD("nrt_execute");
    if (!model || !input_set || !output_set) return done(NRT_INVALID, "nrt_execute null argument");
    nrt_tensor_t *bound[MAX_IO];
    for (int i = 0; i < model->n_io; i++) {
        const fake_io *io = &model->io[i];
        bound[i] = lookup(io->usage ? output_set : input_set, io->name);
        if (!bound[i])
            return done(NRT_INVALID, "nrt_execute missing %s %s", io->usage ? "output" : "input", io->name);
        if (bound[i]->size != io->size)
            return done(NRT_INVALID, "nrt_execute %s has %zu bytes, model wants %zu", io->name, bound[i]->size,
                        io->size);
    }
    char collective[256] = "";
    if (model->collective) {                  /* every rank of its world takes part */
        const char *root = root_comm();
        if (!root) return done(NRT_INVALID, "nrt_execute without NEURON_RT_ROOT_COMM_ID (a collective model)");
        int call = ++g_collective_calls;
        NRT_STATUS s = take_part("nrt_execute", root, model->rank, model->world, call, model->id);
        if (s) return s;
        snprintf(collective, sizeof collective, " rank=%u world=%u root=%s model=%s call=%d", model->rank,
                 model->world, root, model->id, call);
    }
    int copied[MAX_IO] = {0}, in_place = 0;
    for (int c = 0; c < model->n_copy; c++) copied[model->copy_out[c]] = 1;
    int answered = 0;
    for (int i = 0; i < model->n_io; i++)
        if (model->io[i].usage && !copied[i]) memset(bound[i]->data, 0, model->io[i].size);
    for (int c = 0; c < model->n_copy; c++) {
        int o = model->copy_out[c], i = model->copy_in[c];
        in_place += bound[o]->data == bound[i]->data;         /* output bound to its input's storage */
        memmove(bound[o]->data, bound[i]->data, model->io[o].size);
    }
    for (int i = 0; i < model->n_io; i++)                     /* a recorded answer replaces either */
        if (model->io[i].usage) answered += answer(model, i, bound[i]->data);
    char answers[32] = "";                    /* only with $FAKE_NRT_ANSWERS set */
    if (getenv("FAKE_NRT_ANSWERS")) snprintf(answers, sizeof answers, " answered=%d", answered);
    return done(NRT_SUCCESS, "nrt_execute tensors=%d copies=%d in_place=%d to_device=%zu to_host=%zu%s%s", model->n_io,
                model->n_copy, in_place, g_to_device, g_to_host, collective, answers);
}
