/*
 * tbrelay.c -- user-space WAN delay / jitter / loss relay for the testbed.
 *
 * WHY USER SPACE
 *   The kernel this project runs on has no netem.  Rate is shaped with HTB at
 *   each sender's egress (elsewhere); one-way delay, jitter and loss are
 *   emulated here.  Every emulated link A<->B is cut in two by this relay:
 *
 *     host A ns: A-ethX <-veth-> P  [relay ns]  Q <-veth-> B-ethY :host B ns
 *
 *   Every frame that arrives on P (sent by A) is held for the A->B delay
 *   (+ jitter, unless lost) and then transmitted out of Q, so it reaches B;
 *   symmetrically Q -> P with the B->A parameters.  One process serves many
 *   links; the harness may run one process per core.
 *
 * DATA PATH (why it is cheap)
 *   - One AF_PACKET socket per interface, bound to it with ETH_P_ALL.  RX with
 *     recvmmsg() (up to `batch` frames per syscall) and a kernel receive
 *     timestamp per frame (SO_TIMESTAMPNS, taken when the frame reached the
 *     relay namespace, CLOCK_REALTIME mapped to CLOCK_MONOTONIC).  Because the
 *     arrival time is exact however late user space reads, the relay does not
 *     wake up per frame: in "poll" mode (all delays >= 4 ms) it reads its
 *     sockets every rx_poll_us (auto: delay/8, 0.25..1 ms; recvmmsg batches
 *     instead of one syscall per frame); with
 *     smaller delays the sockets are also in epoll.
 *     (A TPACKET_V3 mmap ring was tried first and dropped: frames only become
 *     visible when the kernel retires a block, which is done from a softirq
 *     timer; on a loaded 2-core machine that timer ran up to 65 ms late,
 *     i.e. frames were seen after their due time.  recvmmsg has no such
 *     dependency and costs about the same: one copy in, one copy out.)
 *   - Each direction owns a preallocated byte arena (FIFO circular buffer,
 *     sized from rate * (delay + 3 jitter) x2 + 100 ms of slack, capped by
 *     max_ring_mb) that holds the frames while they wait, plus a queue of
 *     descriptors (pointer, length, due time): a FIFO ring (default) or a
 *     binary heap (reorder mode).  Arena space is released in arrival order.
 *     When the arena (or the socket buffer) is full, frames are dropped and
 *     counted as "drop_ring" (overload).
 *   - Transmission: sendmmsg() straight from the arena (batch of up to
 *     `batch` frames, one syscall), PACKET_QDISC_BYPASS (no qdisc on the
 *     relay side), PACKET_IGNORE_OUTGOING (never re-read what we sent).
 *   - One epoll_pwait2() with a nanosecond timeout = earliest pending due
 *     time.  A halted vCPU wakes up ~50-100 us late; with spin_us > 0 the
 *     relay sleeps until due - early and spins the rest, where `early` tracks
 *     the measured wakeup overshoot (capped by spin_us) and spinning is paid
 *     from a budget of spin_pct % of wall time.  Off by default: on a
 *     2-vCPU VM it bought ~10 us of median lateness at scale 0.1, cost ~3 %
 *     of each core, and in 15 back-to-back pairs of NetStorm link checks at
 *     scale 1 (order alternated) the relays kept up in 4 with spin_us 150 and
 *     in 10 without.  All frames due at wakeup are sent round-robin over
 *     directions.
 *   - Lateness (hand-over to sendmmsg - due time) is measured per frame
 *     (interpolated inside a batch) and kept in a histogram (p50/p99/p99.9).
 *   - Note: sendmmsg() also runs the receivers' network stack (veth ->
 *     netif_rx -> softirq) in the relay's context, so the relay's "sys" CPU
 *     is mostly the TCP receive work of the hosts, not relay overhead.  Run
 *     the relay SCHED_FIFO (rtprio, the Python wrapper's default) when the
 *     TCP endpoints share the cores: with CFS the relay waits behind them
 *     and lateness grows to milliseconds.
 *   - Delays below ~0.1 ms cannot be emulated exactly (wakeup latency); this
 *     relay targets WAN delays (ms to 100s of ms).
 *
 * JITTER / ORDER
 *   due = arrival + D, never below arrival, D drawn exactly as netem's
 *   tabledist() draws it (sch_netem.c): with a table (iproute2's .dist files,
 *   the ones tc loads: "table K PATH"), D = mu + sigma * t / 8192 for t a
 *   table value picked uniformly; without one (table 0), netem's uniform
 *   D = mu - sigma + (r mod 2 sigma), in ns.  mu and sigma are netem's
 *   "delay MU SIGMA", which the Python side derives from the link's mean
 *   delay and standard deviation (testbed/emulator/jitter.py), so the relay
 *   and netem give the same distribution.  By default the relay keeps FIFO
 *   order per direction:  due = max(previous due, arrival + D), as netem does
 *   given a rate (shaping.py).
 *   Real WAN paths very rarely reorder, and reordering makes TCP see spurious
 *   losses (dupacks), which would dominate the experiment.  netem WOULD
 *   reorder; set "reorder 1" to get netem-like behaviour (heap by due time).
 *
 * LOSS
 *   Independent Bernoulli(loss) per MTU segment, xoshiro256** RNG seeded per
 *   direction from (seed, link, direction): reproducible for a given frame
 *   sequence, independent of other links.
 *
 * LINK DOWN
 *   A fault sets a host's end of a link down; the relay's end loses its
 *   carrier and every frame due meanwhile is lost (drop_down), as on a cut
 *   link and as netem's queue is when its device goes down.
 *
 * OFFLOADS / GSO ("vnet" mode)
 *   vnet 0 (plain mode): frames are relayed byte for byte.  Then the HOST-side
 *   veth ends (A-ethX, B-ethY) must not produce GSO super-frames or partial
 *   checksums:  ethtool -K A-ethX tx off tso off gso off   (tx off implies
 *   no partial checksums; GRO on the relay-side ends must stay off, the veth
 *   default).  Frames with an incomplete checksum would be delivered with a
 *   wrong checksum, frames > MTU cannot be sent (counted in drop_tx).
 *   vnet 1 (default): PACKET_VNET_HDR on every socket; each frame carries a
 *   virtio_net_hdr, so GSO super-frames (up to 64 KB) and partial checksums
 *   pass through unchanged and offloads may stay ON -- far fewer frames per
 *   second: with TSO/GSO on at the hosts, 26 x 90 Mbit/s flows need ~30k
 *   frames/s instead of ~250k.  GRO on the veths (ethtool -K dev gro on:
 *   veth NAPI mode) is also fine in vnet mode and coalesces MTU frames into
 *   super-frames before the relay sees them.  Loss stays per-MTU-segment correct: each super-frame of N
 *   segments draws N Bernoulli samples; if some (not all) segments are lost,
 *   a TCP super-frame is segmented in user space (headers rebuilt, checksums
 *   recomputed) and only the surviving segments are sent.  Non-TCP GSO
 *   (UDP GSO) and super-frames of > 64 segments are dropped as a whole when
 *   any of their segments is lost (approximation; counted per segment).
 *
 * CONFIG (argv[1]) -- trivial line format written by the Python wrapper:
 *   seed N | reorder 0/1 | vnet 0/1 | cpu N | rtprio N | slack_us N |
 *   batch N | rx_poll_us N (-1 = auto) | max_ring_mb N | spin_us N |
 *   spin_pct N (CPU share the early-wake spinning may use)
 *   table K PATH   (jitter table K >= 1: a netem .dist file; at most MAX_TABLES)
 *   link P Q  ab_delay_us ab_jitter_us ab_loss ab_table  ba_delay_us ba_jitter_us ba_loss ba_table  rate_mbps
 *   (delay and jitter: netem's mu and sigma; table 0: netem's uniform)
 * Runtime control on stdin (one command per line):
 *   set LINK ab|ba DELAY_US JITTER_US LOSS TABLE      stats
 * Output (stdout, one JSON object per line): {"event":"ready"...} once set up,
 *   {"event":"stats"...} on SIGUSR1 or "stats", {"event":"exit"...} on
 *   SIGTERM/SIGINT/SIGHUP/EOF-free exit (then exit status 0).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/sockios.h>
#include <linux/virtio_net.h>
#include <math.h>
#include <net/if.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#ifndef PACKET_QDISC_BYPASS
#define PACKET_QDISC_BYPASS 20
#endif
#ifndef PACKET_IGNORE_OUTGOING
#define PACKET_IGNORE_OUTGOING 23
#endif

#define MAX_BATCH 256
#define VNET_LEN ((uint32_t)sizeof(struct virtio_net_hdr))
#define NSEC 1000000000LL
#define HIST_N 281 /* lateness buckets, see hist_idx() */
#define MAX_TABLES 16
#define NETEM_DIST_SCALE 8192

/* ---------------------------------------------------------------- utils */

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tbrelay: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

static inline int64_t clock_ns(clockid_t c)
{
    struct timespec ts;
    clock_gettime(c, &ts);
    return ts.tv_sec * NSEC + ts.tv_nsec;
}
static inline int64_t mono_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

/* xoshiro256** seeded with splitmix64 */
typedef struct { uint64_t s[4]; } rng_t;
static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static void rng_seed(rng_t *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}
static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static inline uint64_t rng_next(rng_t *r)
{
    uint64_t *s = r->s, res = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45);
    return res;
}
static inline double rng_unit(rng_t *r) { return (rng_next(r) >> 11) * 0x1.0p-53; }

/* ------------------------------------------------------------ structures */

typedef struct {
    uint8_t *data;     /* what is sent: vnet hdr (vnet mode) + L2 frame, in the ring */
    uint32_t len;      /* bytes to send */
    uint32_t rec;      /* arena record (arrival index) holding the frame */
    int64_t due;       /* CLOCK_MONOTONIC ns */
    uint64_t lossmask; /* GSO frames: bit i = segment i lost (=> user-space segmentation) */
    uint32_t segs;     /* MTU segments in this frame (1 unless GSO) */
    uint32_t seq;      /* arrival order (heap tie break) */
} entry_t;

typedef struct {
    uint64_t frames_in, bytes_in, segs_in;
    uint64_t frames_out, bytes_out, segs_out;
    uint64_t lost_segs, lost_frames;   /* dropped by the loss model */
    uint64_t drop_ring;                /* kernel: ring full (overload) */
    uint64_t drop_queue;               /* descriptor queue full (should not happen) */
    uint64_t drop_tx;                  /* sendmmsg hard errors */
    uint64_t drop_trunc;               /* frame larger than the receive slot */
    uint64_t drop_down;                /* due while its link was down (no carrier): lost, as on a cut link */
    uint64_t gso_frames, gso_split;    /* super-frames seen / segmented for loss */
    uint64_t tx_retry;                 /* ENOBUFS/EAGAIN, retried later */
    uint64_t max_backlog, max_backlog_bytes, max_arena;
    int64_t late_max;                  /* ns */
    int64_t rxlag_max, rxlag_sum;      /* ns from kernel timestamp to harvest */
    uint64_t hist[HIST_N];
} stats_t;

struct dir;

typedef struct port {
    char name[IFNAMSIZ];
    int fd, ifindex;
    struct dir *rxdir; /* direction fed by frames arriving on this port */
    int rx_ready;      /* epoll said readable (event mode) */
} port_t;

typedef struct dir {
    port_t *in, *out;
    int link, ba; /* ba=0: A->B (in = P), ba=1: B->A (in = Q) */
    int64_t delay, jitter; /* netem's mu and sigma, ns */
    int table;             /* jitter table (0: netem's uniform) */
    double loss;
    uint64_t loss_thr; /* loss * 2^53 */
    rng_t rng;
    entry_t *q;
    uint32_t cap, qhead, qlen, seq;
    /* arena: FIFO circular byte buffer holding queued frames */
    uint8_t *arena;
    size_t acap, awpos, aused;
    /* arena records in arrival order: bytes each one occupies (incl. wrap
     * waste) and whether it was sent; [rtail, seq) are live */
    uint32_t *rsize;
    uint8_t *rdone;
    uint32_t rtail;
    uint64_t qbytes;
    int64_t last_due;
    int retry; /* tx hit ENOBUFS: retry soon */
    stats_t st;
} dir_t;

static struct {
    uint64_t seed;
    int reorder, vnet, cpu, rtprio, slack_us, batch, rx_poll_us, max_ring_mb, spin_us, spin_pct, tx_kb;
} cfg = {0, 0, 1, -1, 0, 20, 64, -1, 256, 0, 5, 0};

typedef struct { int16_t *v; uint32_t n; } table_t;
static table_t tables[MAX_TABLES + 1]; /* [0]: none (uniform) */

static port_t *ports;
static dir_t *dirs;
static int nports, ndirs, nlinks;
static double *link_rate; /* Mbit/s, for ring sizing */
static uint64_t n_wakeups, n_loops, n_sendcalls;
static int64_t send_call_max, wake_late_max; /* ns: longest sendmmsg, worst timer overshoot */
static int64_t tx_loop_max, harvest_gap_max; /* ns: longest send round, longest time between socket reads */
static int64_t rx_ns, tx_ns;                  /* ns spent reading sockets / in sendmmsg (window) */
static int64_t win_start;                     /* start of the keep-up window (ns) */
static int64_t sched0_run, sched0_delay;      /* /proc/self/schedstat at window start */
static uint64_t sched0_slices;
static int64_t t_start;

/* --------------------------------------------------------------- config */

static int set_dir_params(dir_t *d, double delay_us, double jitter_us, double loss, int table)
{
    if (delay_us < 0 || jitter_us < 0 || jitter_us > 2e6 || loss < 0 || loss > 1 || !isfinite(delay_us) ||
        !isfinite(jitter_us) || !isfinite(loss) || table < 0 || table > MAX_TABLES ||
        (table && !tables[table].n)) {
        fprintf(stderr, "tbrelay: bad parameters %g %g %g %d ignored\n", delay_us, jitter_us, loss, table);
        return -1;
    }
    d->delay = (int64_t)llround(delay_us * 1000.0);
    d->jitter = (int64_t)llround(jitter_us * 1000.0);
    d->table = table;
    d->loss = loss;
    d->loss_thr = loss >= 1.0 ? (1ULL << 53) : (uint64_t)(loss * 0x1.0p53);
    return 0;
}

/* A netem distribution table (iproute2's .dist format: '#' comment lines,
 * whitespace-separated integers), as tc reads it. */
static void load_table(int k, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) die("cannot open jitter table %s: %s", path, strerror(errno));
    char line[4096];
    uint32_t cap = 4096;
    tables[k].v = malloc(sizeof(int16_t) * cap);
    tables[k].n = 0;
    while (fgets(line, sizeof line, f)) {
        char *s = line, *end;
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '#') continue;
        for (;;) {
            long x = strtol(s, &end, 10);
            if (end == s) break;
            if (x < INT16_MIN || x > INT16_MAX) die("%s: value %ld out of range", path, x);
            if (tables[k].n == cap) tables[k].v = realloc(tables[k].v, sizeof(int16_t) * (cap *= 2));
            tables[k].v[tables[k].n++] = (int16_t)x;
            s = end;
        }
    }
    fclose(f);
    if (!tables[k].n) die("jitter table %s is empty", path);
}

static void parse_config(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) die("cannot open config %s: %s", path, strerror(errno));
    char line[1024];
    int cap = 0, lineno = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        char *s = line;
        while (*s == ' ' || *s == '\t') s++;
        if (*s == '#' || *s == '\n' || *s == 0) continue;
        char key[32];
        long long v;
        if (strncmp(s, "table ", 6) == 0) {
            int k;
            char tp[900];
            if (sscanf(s, "table %d %899s", &k, tp) != 2 || k < 1 || k > MAX_TABLES)
                die("%s:%d: bad table line", path, lineno);
            load_table(k, tp);
            continue;
        }
        if (strncmp(s, "link ", 5) == 0) {
            char p[IFNAMSIZ], q[IFNAMSIZ];
            double ad, aj, al, bd, bj, bl, rate;
            int at, bt;
            if (sscanf(s, "link %15s %15s %lf %lf %lf %d %lf %lf %lf %d %lf", p, q, &ad, &aj, &al, &at, &bd,
                       &bj, &bl, &bt, &rate) != 11)
                die("%s:%d: bad link line", path, lineno);
            if (nlinks == cap) {
                cap = cap ? cap * 2 : 16;
                ports = realloc(ports, sizeof(port_t) * 2 * cap);
                dirs = realloc(dirs, sizeof(dir_t) * 2 * cap);
                link_rate = realloc(link_rate, sizeof(double) * cap);
            }
            int i = nlinks++;
            port_t *pp = &ports[2 * i], *pq = &ports[2 * i + 1];
            memset(pp, 0, sizeof *pp * 2);
            memset(&dirs[2 * i], 0, sizeof(dir_t) * 2);
            memcpy(pp->name, p, IFNAMSIZ);
            memcpy(pq->name, q, IFNAMSIZ);
            dir_t *ab = &dirs[2 * i], *ba = &dirs[2 * i + 1];
            ab->link = i; ab->ba = 0; /* ports: set once parsing is done (realloc moves them) */
            ba->link = i; ba->ba = 1;
            if (set_dir_params(ab, ad, aj, al, at) || set_dir_params(ba, bd, bj, bl, bt))
                die("%s:%d: bad parameters", path, lineno);
            link_rate[i] = rate > 0 ? rate : 1000;
            continue;
        }
        if (sscanf(s, "%31s %lld", key, &v) != 2) die("%s:%d: cannot parse: %s", path, lineno, s);
        if (!strcmp(key, "seed")) cfg.seed = (uint64_t)v;
        else if (!strcmp(key, "reorder")) cfg.reorder = !!v;
        else if (!strcmp(key, "vnet")) cfg.vnet = !!v;
        else if (!strcmp(key, "cpu")) cfg.cpu = (int)v;
        else if (!strcmp(key, "rtprio")) cfg.rtprio = (int)v;
        else if (!strcmp(key, "slack_us")) cfg.slack_us = (int)v;
        else if (!strcmp(key, "tov_ms")) (void)v; /* obsolete (TPACKET_V3 ring) */
        else if (!strcmp(key, "batch")) cfg.batch = v < 1 ? 1 : v > MAX_BATCH ? MAX_BATCH : (int)v;
        else if (!strcmp(key, "rx_poll_us")) cfg.rx_poll_us = (int)v;
        else if (!strcmp(key, "spin_us")) cfg.spin_us = v < 0 ? 0 : (int)v;
        else if (!strcmp(key, "spin_pct")) cfg.spin_pct = v < 0 ? 0 : v > 100 ? 100 : (int)v;
        else if (!strcmp(key, "max_ring_mb")) cfg.max_ring_mb = v < 1 ? 1 : (int)v;
        else if (!strcmp(key, "tx_kb")) cfg.tx_kb = v < 0 ? 0 : (int)v;
        else die("%s:%d: unknown key %s", path, lineno, key);
    }
    fclose(f);
    if (!nlinks) die("%s: no link lines", path);
    nports = ndirs = 2 * nlinks;
    for (int i = 0; i < ndirs; i++) {
        dirs[i].in = &ports[i];      /* A->B: in = P (port 2l), out = Q; B->A the reverse */
        dirs[i].out = &ports[i ^ 1];
        dirs[i].in->rxdir = &dirs[i];
        rng_seed(&dirs[i].rng, cfg.seed * 0x100000001b3ULL ^ (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ULL);
    }
}

/* ------------------------------------------------------------- sockets */

#define SLOT (65536 + 512) /* receive slot: a 64 KB GSO frame + vnet/L2 headers */

static void setup_port(port_t *p, dir_t *d)
{
    int one = 1;
    p->ifindex = if_nametoindex(p->name);
    if (!p->ifindex) die("no such interface %s (in this namespace)", p->name);
    p->fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (p->fd < 0) die("socket(AF_PACKET): %s (need root/CAP_NET_RAW)", strerror(errno));
    if (cfg.vnet && setsockopt(p->fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one))
        die("PACKET_VNET_HDR: %s (use vnet 0)", strerror(errno));
    if (setsockopt(p->fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one))
        die("SO_TIMESTAMPNS: %s", strerror(errno));
    setsockopt(p->fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof one);
    if (setsockopt(p->fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one))
        fprintf(stderr, "tbrelay: PACKET_IGNORE_OUTGOING unsupported, filtering in user space\n");
    /* socket buffers: frames wait there only between two reads (<= 10 ms) */
    int buf = 64 << 20;
    if (setsockopt(p->fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof buf))
        setsockopt(p->fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    if (setsockopt(p->fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof buf))
        setsockopt(p->fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);

    struct sockaddr_ll sll = {.sll_family = AF_PACKET,
                              .sll_protocol = htons(ETH_P_ALL),
                              .sll_ifindex = p->ifindex};
    if (bind(p->fd, (struct sockaddr *)&sll, sizeof sll))
        die("bind %s: %s", p->name, strerror(errno));

    /* Arena of the direction fed by this port: the bytes that arrive during
     * delay + 4 sigma jitter at the link's maximum rate, x2 (headers, small
     * frames, record alignment), plus 100 ms at full rate of slack for stalls;
     * at least 4 MB.  Full arena => drop_ring (overload). */
    double hold_s = (d->delay + 4 * d->jitter) / 1e9 + 0.005; /* netem's tables: up to 4 sigma */
    double rate_Bps = link_rate[d->link] * 1e6 / 8;
    double bytes = 2 * rate_Bps * hold_s + rate_Bps * 0.100;
    size_t acap = (size_t)bytes;
    if (acap < ((size_t)4 << 20)) acap = (size_t)4 << 20;
    size_t maxb = (size_t)cfg.max_ring_mb << 20;
    if (acap > maxb) {
        fprintf(stderr, "tbrelay: %s: buffer capped at %d MB (wanted %.0f MB)\n", p->name,
                cfg.max_ring_mb, bytes / 1048576.0);
        acap = maxb;
    }
    if (acap < 2 * SLOT) acap = 2 * SLOT;
    d->acap = (acap + 63) & ~(size_t)63;
    d->arena = mmap(NULL, d->acap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (d->arena == MAP_FAILED) die("mmap arena (%zu bytes): %s", d->acap, strerror(errno));
    /* one descriptor per possible frame (records are >= 64 bytes); a power
     * of two, so that indices stay consistent when the 32-bit seq wraps */
    d->cap = 1024;
    while (d->cap < d->acap / 64 + 64) d->cap <<= 1;
    d->q = malloc(sizeof(entry_t) * d->cap);
    d->rsize = malloc(sizeof(uint32_t) * d->cap);
    d->rdone = calloc(d->cap, 1);
    if (!d->q || !d->rsize || !d->rdone) die("out of memory");
}

/* Would len bytes fit in d's arena now? */
static int arena_fits(const dir_t *d, uint32_t len)
{
    size_t need = ((size_t)len + 63) & ~(size_t)63;
    size_t waste = d->awpos + need > d->acap ? d->acap - d->awpos : 0;
    return d->aused + waste + need <= d->acap;
}

/* Reserve len bytes in d's arena (FIFO; may wrap).  Returns NULL if full. */
static uint8_t *arena_alloc(dir_t *d, uint32_t len, uint32_t *recsize)
{
    size_t need = ((size_t)len + 63) & ~(size_t)63, off = d->awpos, waste = 0;
    if (off + need > d->acap) { /* does not fit before the end: wrap */
        waste = d->acap - off;
        off = 0;
    }
    if (d->aused + waste + need > d->acap) return NULL;
    d->aused += waste + need;
    d->awpos = off + need;
    if (d->awpos == d->acap) d->awpos = 0;
    *recsize = (uint32_t)(waste + need);
    return d->arena + off;
}

/* Frame with arena record `rec` has left: free arena space, in arrival order. */
static void arena_done(dir_t *d, uint32_t rec)
{
    d->rdone[rec & (d->cap - 1)] = 1;
    while (d->rtail != d->seq && d->rdone[d->rtail & (d->cap - 1)]) {
        d->rdone[d->rtail & (d->cap - 1)] = 0;
        d->aused -= d->rsize[d->rtail & (d->cap - 1)];
        d->rtail++;
    }
}

/* ---------------------------------------------------------------- queue */
/* FIFO (circular) unless cfg.reorder, then a min-heap on (due, seq). */

static inline int ent_less(const entry_t *a, const entry_t *b)
{
    return a->due < b->due || (a->due == b->due && (int32_t)(a->seq - b->seq) < 0);
}

static void q_push(dir_t *d, const entry_t *e)
{
    if (!cfg.reorder) {
        uint32_t i = d->qhead + d->qlen;
        if (i >= d->cap) i -= d->cap;
        d->q[i] = *e;
    } else {
        uint32_t i = d->qlen;
        while (i > 0) {
            uint32_t par = (i - 1) / 2;
            if (!ent_less(e, &d->q[par])) break;
            d->q[i] = d->q[par];
            i = par;
        }
        d->q[i] = *e;
    }
    d->qlen++;
    d->qbytes += e->len;
}

static inline entry_t *q_top(dir_t *d) { return d->qlen ? &d->q[cfg.reorder ? 0 : d->qhead] : NULL; }

static void q_pop(dir_t *d)
{
    d->qbytes -= q_top(d)->len;
    if (!cfg.reorder) {
        if (++d->qhead == d->cap) d->qhead = 0;
        d->qlen--;
        return;
    }
    entry_t last = d->q[--d->qlen];
    uint32_t i = 0, n = d->qlen;
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && ent_less(&d->q[c + 1], &d->q[c])) c++;
        if (!ent_less(&d->q[c], &last)) break;
        d->q[i] = d->q[c];
        i = c;
    }
    if (n) d->q[i] = last;
}

/* Put back frames that could not be sent (tx ENOBUFS); `b` holds them in the
 * order they were popped. */
static void q_unpop(dir_t *d, entry_t *b, int n)
{
    if (!cfg.reorder) {
        for (int i = n - 1; i >= 0; i--) {
            d->qhead = d->qhead ? d->qhead - 1 : d->cap - 1;
            d->q[d->qhead] = b[i];
            d->qlen++;
            d->qbytes += b[i].len;
        }
    } else {
        for (int i = 0; i < n; i++) q_push(d, &b[i]);
    }
}

/* ----------------------------------------------------------------- RX */

/* One delay draw (ns), as netem's tabledist(mu, sigma, ...) makes it. */
static int64_t tabledist(dir_t *d)
{
    int64_t mu = d->delay, sigma = d->jitter;
    if (!sigma) return mu;
    uint32_t rnd = (uint32_t)(rng_next(&d->rng) >> 32);
    if (!d->table) return (int64_t)(rnd % (2 * (uint32_t)sigma)) + mu - sigma; /* netem's uniform */
    const table_t *t = &tables[d->table];
    int64_t v = t->v[rnd % t->n];
    int64_t x = (sigma % NETEM_DIST_SCALE) * v;
    x += x >= 0 ? NETEM_DIST_SCALE / 2 : -NETEM_DIST_SCALE / 2;
    return x / NETEM_DIST_SCALE + (sigma / NETEM_DIST_SCALE) * v + mu;
}

/* L3/L4 layout of a frame; returns 0 if not IPv4/IPv6. */
typedef struct { uint32_t l3, l4, hdrs; int v6, proto; } layout_t;

static int parse_layout(const uint8_t *f, uint32_t len, layout_t *o)
{
    uint32_t l3 = 14;
    if (len < 14) return 0;
    uint16_t et = (uint16_t)(f[12] << 8 | f[13]);
    if (et == 0x8100 || et == 0x88a8) {
        if (len < 18) return 0;
        et = (uint16_t)(f[16] << 8 | f[17]);
        l3 = 18;
    }
    if (et == 0x0800) {
        if (len < l3 + 20) return 0;
        o->v6 = 0;
        o->proto = f[l3 + 9];
        o->l4 = l3 + (f[l3] & 15) * 4;
    } else if (et == 0x86dd) {
        if (len < l3 + 40) return 0;
        o->v6 = 1;
        o->proto = f[l3 + 6]; /* extension headers not handled */
        o->l4 = l3 + 40;
    } else
        return 0;
    o->l3 = l3;
    if (o->proto == 6) {
        if (len < o->l4 + 20) return 0;
        o->hdrs = o->l4 + (f[o->l4 + 12] >> 4) * 4;
    } else if (o->proto == 17) {
        o->hdrs = o->l4 + 8;
    } else
        return 0;
    return o->hdrs <= len;
}

/* Account and enqueue one received frame. */
static void rx_frame(dir_t *d, uint8_t *data, uint32_t len, int64_t arrival)
{
    stats_t *st = &d->st;
    const uint32_t vl = cfg.vnet ? VNET_LEN : 0;
    uint32_t segs = 1;
    if (!arena_fits(d, len)) { /* the frames in flight exceed the buffer: overload */
        st->drop_ring++;      /* (like socket-buffer drops: not counted in frames_in) */
        return;
    }
    if (cfg.vnet) {
        struct virtio_net_hdr *vh = (struct virtio_net_hdr *)data;
        vh->flags &= VIRTIO_NET_HDR_F_NEEDS_CSUM; /* DATA_VALID is rx-only */
        if ((vh->gso_type & ~VIRTIO_NET_HDR_GSO_ECN) != VIRTIO_NET_HDR_GSO_NONE && vh->gso_size) {
            layout_t lo;
            uint32_t fl = len - vl;
            if (parse_layout(data + vl, fl, &lo) && fl > lo.hdrs)
                segs = (fl - lo.hdrs + vh->gso_size - 1) / vh->gso_size;
            st->gso_frames++;
        }
    }
    st->frames_in++;
    st->bytes_in += len - vl;
    st->segs_in += segs;

    uint64_t lossmask = 0;
    uint32_t nlost = 0;
    if (d->loss_thr) {
        for (uint32_t i = 0; i < segs; i++)
            if ((rng_next(&d->rng) >> 11) < d->loss_thr) {
                nlost++;
                if (i < 64) lossmask |= 1ULL << i;
            }
    }
    if (nlost) {
        layout_t lo;
        int splittable = segs > 1 && segs <= 64 && nlost < segs &&
                         parse_layout(data + vl, len - vl, &lo) && lo.proto == 6;
        st->lost_segs += splittable ? nlost : segs;
        if (!splittable) {
            st->lost_frames++;
            return;
        }
        st->gso_split++;
    }
    if (d->qlen >= d->cap || d->seq - d->rtail >= d->cap) {
        st->drop_queue++;
        return;
    }
    uint32_t recsize;
    uint8_t *copy = arena_alloc(d, len, &recsize); /* cannot fail: arena_fits() */
    memcpy(copy, data, len);
    data = copy;
    d->rsize[d->seq & (d->cap - 1)] = recsize;
    int64_t due = arrival + tabledist(d);
    if (due < arrival) due = arrival;
    if (!cfg.reorder && due < d->last_due) due = d->last_due; /* FIFO: never reorder */
    d->last_due = due;
    entry_t e = {.data = data, .len = len, .rec = d->seq, .due = due,
                 .lossmask = lossmask, .segs = segs, .seq = d->seq};
    d->seq++;
    q_push(d, &e);
    if (d->qlen > st->max_backlog) st->max_backlog = d->qlen;
    if (d->qbytes > st->max_backlog_bytes) st->max_backlog_bytes = d->qbytes;
    if (d->aused > st->max_arena) st->max_arena = d->aused;
}

/* Read every frame queued on p's socket (recvmmsg batches). */
static void harvest(port_t *p, int64_t now, int64_t rt_minus_mono)
{
    static uint8_t *staging;
    static struct mmsghdr m[MAX_BATCH];
    static struct iovec iov[MAX_BATCH];
    static struct sockaddr_ll from[MAX_BATCH];
    static union { char buf[CMSG_SPACE(sizeof(struct timespec))]; struct cmsghdr align; } ctl[MAX_BATCH];
    dir_t *d = p->rxdir;
    int n = cfg.batch;
    if (!staging) { /* set up once; recvmmsg only rewrites lengths and flags */
        staging = mmap(NULL, (size_t)MAX_BATCH * SLOT, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (staging == MAP_FAILED) die("mmap staging: %s", strerror(errno));
        for (int i = 0; i < MAX_BATCH; i++) {
            iov[i].iov_base = staging + (size_t)i * SLOT;
            iov[i].iov_len = SLOT;
            m[i].msg_hdr = (struct msghdr){.msg_name = &from[i], .msg_namelen = sizeof from[i],
                                           .msg_iov = &iov[i], .msg_iovlen = 1,
                                           .msg_control = ctl[i].buf, .msg_controllen = sizeof ctl[i].buf};
        }
    }
    for (;;) {
        int k = recvmmsg(p->fd, m, (unsigned)n, MSG_DONTWAIT, NULL);
        if (k <= 0) return; /* EAGAIN: drained */
        now = mono_ns();
        for (int i = 0; i < k; i++) {
            if (from[i].sll_pkttype == PACKET_OUTGOING) continue;
            if (m[i].msg_hdr.msg_flags & MSG_TRUNC) {
                d->st.drop_trunc++;
                continue;
            }
            int64_t arr = now;
            struct cmsghdr *c;
            for (c = CMSG_FIRSTHDR(&m[i].msg_hdr); c; c = CMSG_NXTHDR(&m[i].msg_hdr, c))
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                    struct timespec ts;
                    memcpy(&ts, CMSG_DATA(c), sizeof ts);
                    arr = (int64_t)ts.tv_sec * NSEC + ts.tv_nsec - rt_minus_mono;
                }
            if (arr > now || arr < now - 10 * NSEC) arr = now; /* sanity */
            int64_t lag = now - arr;
            d->st.rxlag_sum += lag;
            if (lag > d->st.rxlag_max) d->st.rxlag_max = lag;
            rx_frame(d, iov[i].iov_base, m[i].msg_len, arr);
        }
        for (int i = 0; i < k; i++) {
            m[i].msg_hdr.msg_namelen = sizeof from[i];
            m[i].msg_hdr.msg_controllen = sizeof ctl[i].buf;
        }
        if (k < n) return;
    }
}

/* ----------------------------------------------------------------- TX */

static inline int hist_idx(int64_t late_ns)
{
    int64_t us = late_ns / 1000;
    if (us < 0) us = 0;
    if (us < 1000) return (int)(us / 10);
    if (us < 10000) return 100 + (int)((us - 1000) / 100);
    if (us < 100000) return 190 + (int)((us - 10000) / 1000);
    return HIST_N - 1;
}
/* frames sent in the keep-up window: each has its lateness in the histogram */
static uint64_t hist_total(const stats_t *st)
{
    uint64_t tot = 0;
    for (int j = 0; j < HIST_N; j++) tot += st->hist[j];
    return tot;
}
static double hist_upper_us(int i)
{
    if (i < 100) return (i + 1) * 10.0;
    if (i < 190) return 1000.0 + (i - 99) * 100.0;
    if (i < 280) return 10000.0 + (i - 189) * 1000.0;
    return INFINITY;
}

static void sent_ok(dir_t *d, const entry_t *e, int64_t t_sent)
{
    stats_t *st = &d->st;
    uint32_t vl = cfg.vnet ? VNET_LEN : 0;
    st->frames_out++;
    st->bytes_out += e->len - vl;
    st->segs_out += e->segs - (uint32_t)__builtin_popcountll(e->lossmask);
    int64_t late = t_sent - e->due;
    if (late > st->late_max) st->late_max = late;
    st->hist[hist_idx(late)]++;
    arena_done(d, e->rec);
}

static inline void csum_add(uint32_t *sum, const uint8_t *p, uint32_t n)
{
    uint64_t s = *sum;
    while (n >= 2) {
        s += (uint32_t)(p[0] << 8 | p[1]);
        p += 2;
        n -= 2;
    }
    if (n) s += (uint32_t)(p[0] << 8);
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    *sum = (uint32_t)s;
}
static inline uint16_t csum_fold(uint32_t s)
{
    while (s >> 16) s = (s & 0xffff) + (s >> 16);
    return (uint16_t)~s;
}
static inline void put16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }

/* Software TCP segmentation of a GSO super-frame, emitting only the segments
 * whose bit in lossmask is clear, into `scratch`; returns #messages. */
static int tcp_segment(const entry_t *e, uint8_t *scratch, size_t scap, struct mmsghdr *m,
                       struct iovec *iov)
{
    const uint8_t *f = e->data + VNET_LEN;
    uint32_t flen = e->len - VNET_LEN;
    const struct virtio_net_hdr *vh = (const void *)e->data;
    layout_t lo;
    if (!parse_layout(f, flen, &lo) || lo.proto != 6) return 0;
    uint32_t mss = vh->gso_size, payload = flen - lo.hdrs, off = 0, seq0;
    seq0 = (uint32_t)f[lo.l4 + 4] << 24 | f[lo.l4 + 5] << 16 | f[lo.l4 + 6] << 8 | f[lo.l4 + 7];
    uint16_t id0 = (uint16_t)(f[lo.l3 + 4] << 8 | f[lo.l3 + 5]);
    uint8_t flags0 = f[lo.l4 + 13];
    size_t used = 0;
    int nm = 0;
    for (uint32_t i = 0; off < payload; i++, off += mss) {
        uint32_t seg = payload - off < mss ? payload - off : mss;
        int last = off + seg >= payload;
        if (i < 64 && (e->lossmask >> i) & 1) continue;
        size_t need = VNET_LEN + lo.hdrs + seg;
        if (used + need > scap) break;
        uint8_t *o = scratch + used;
        memset(o, 0, VNET_LEN); /* plain frame: full checksums, no GSO */
        uint8_t *g = o + VNET_LEN;
        memcpy(g, f, lo.hdrs);
        memcpy(g + lo.hdrs, f + lo.hdrs + off, seg);
        uint32_t l4len = lo.hdrs - lo.l4 + seg;
        uint8_t *ip = g + lo.l3, *th = g + lo.l4;
        if (!lo.v6) {
            put16(ip + 2, lo.l4 - lo.l3 + l4len);
            put16(ip + 4, (uint16_t)(id0 + i));
            put16(ip + 10, 0);
            uint32_t s = 0;
            csum_add(&s, ip, lo.l4 - lo.l3);
            put16(ip + 10, csum_fold(s));
        } else {
            put16(ip + 4, l4len);
        }
        uint32_t sq = seq0 + off;
        th[4] = (uint8_t)(sq >> 24); th[5] = (uint8_t)(sq >> 16); th[6] = (uint8_t)(sq >> 8); th[7] = (uint8_t)sq;
        uint8_t fl = flags0;
        if (!last) fl &= (uint8_t)~0x09; /* FIN, PSH only on the last segment */
        if (i) fl &= (uint8_t)~0x80;     /* CWR only on the first */
        th[13] = fl;
        put16(th + 16, 0);
        uint32_t s = 0;
        uint8_t ph[8];
        if (!lo.v6) csum_add(&s, ip + 12, 8);
        else csum_add(&s, ip + 8, 32);
        ph[0] = 0; ph[1] = 6; put16(ph + 2, 0); /* proto */
        csum_add(&s, ph, 2);
        put16(ph, l4len >> 16); put16(ph + 2, l4len & 0xffff);
        csum_add(&s, ph, 4);
        csum_add(&s, th, l4len);
        put16(th + 16, csum_fold(s));
        iov[nm].iov_base = o;
        iov[nm].iov_len = need;
        memset(&m[nm], 0, sizeof m[nm]);
        m[nm].msg_hdr.msg_iov = &iov[nm];
        m[nm].msg_hdr.msg_iovlen = 1;
        nm++;
        used += (need + 15) & ~(size_t)15;
        if (nm == 64) break;
    }
    return nm;
}

static int is_transient(int err) { return err == ENOBUFS || err == EAGAIN || err == ENOMEM || err == EINTR; }

/* A send into `out` failed with `err` because the link is down: without a carrier (the
 * host's end of the veth set down) the kernel refuses every frame with ENOBUFS, as for a
 * full queue.  Kept and retried (every 20 us), such frames were delivered seconds late
 * when the link came back (a stale CREW heartbeat announced the link back while its far
 * end was still down); they are lost instead. */
static int link_down(int err, const port_t *out)
{
    struct ifreq ifr;
    if (err != ENOBUFS) return 0;
    memset(&ifr, 0, sizeof ifr);
    snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", out->name);
    return ioctl(out->fd, SIOCGIFFLAGS, &ifr) == 0 && !(ifr.ifr_flags & IFF_RUNNING);
}

/* Send up to cfg.batch due frames of d.  Returns 1 if anything was sent. */
static int tx_batch(dir_t *d, int64_t now)
{
    static entry_t b[MAX_BATCH];
    static struct mmsghdr m[MAX_BATCH];
    static struct iovec iov[MAX_BATCH];
    static uint8_t scratch[64 * 2048 + 65536 + 4096];
    int n = 0;
    size_t bytes = 0, cap = cfg.tx_kb ? (size_t)cfg.tx_kb << 10 : SIZE_MAX;
    entry_t *t;
    while (n < cfg.batch && bytes < cap && (t = q_top(d)) && t->due <= now) {
        if (t->lossmask) {
            if (n) break; /* send what we have first */
            entry_t e = *t;
            q_pop(d);
            int nm = tcp_segment(&e, scratch, sizeof scratch, m, iov);
            int64_t t0 = mono_ns();
            int k = nm ? sendmmsg(d->out->fd, m, (unsigned)nm, MSG_DONTWAIT) : 0, err = errno;
            n_sendcalls++;
            int down = k < 0 && link_down(err, d->out);
            if (k < 0 && !down && is_transient(err)) {
                d->st.tx_retry++;
                q_unpop(d, &e, 1);
                d->retry = 1;
                return 0;
            }
            if (k <= 0 && nm) { /* hard error or the link down: the whole frame is lost */
                if (down) d->st.drop_down++;
                else d->st.drop_tx++;
                arena_done(d, e.rec);
                return 1;
            }
            sent_ok(d, &e, t0); /* (a partial send counts as sent) */
            return 1;
        }
        b[n] = *t;
        bytes += t->len;
        q_pop(d);
        iov[n].iov_base = b[n].data;
        iov[n].iov_len = b[n].len;
        memset(&m[n], 0, sizeof m[n]);
        m[n].msg_hdr.msg_iov = &iov[n];
        m[n].msg_hdr.msg_iovlen = 1;
        n++;
    }
    if (!n) return 0;
    int done = 0;
    while (done < n) {
        int64_t t0 = mono_ns();
        int k = sendmmsg(d->out->fd, m + done, (unsigned)(n - done), MSG_DONTWAIT);
        int64_t t1 = mono_ns();
        n_sendcalls++;
        if (t1 - t0 > send_call_max) send_call_max = t1 - t0;
        tx_ns += t1 - t0;
        if (k > 0) {
            /* frame i is handed to the device at ~ t0 + (t1-t0)*i/k (the
             * syscall also runs the receivers' stack in softirq context, so
             * t1 is later than the frame's departure) */
            for (int i = 0; i < k; i++)
                sent_ok(d, &b[done + i], t0 + (t1 - t0) * i / k);
            done += k;
            continue;
        }
        int err = errno;
        if (k < 0 && link_down(err, d->out)) { /* every frame of this batch is lost */
            for (; done < n; done++) {
                d->st.drop_down++;
                arena_done(d, b[done].rec);
            }
            break;
        }
        if (k < 0 && is_transient(err)) {
            d->st.tx_retry++;
            q_unpop(d, b + done, n - done);
            d->retry = 1;
            return done > 0;
        }
        /* hard error on frame `done` (e.g. EMSGSIZE: frame > MTU, ENXIO/ENETDOWN) */
        static int warned;
        if (warned++ < 5)
            fprintf(stderr, "tbrelay: send on %s: %s (len %u)\n", d->out->name, strerror(err),
                    b[done].len);
        d->st.drop_tx++;
        arena_done(d, b[done].rec);
        done++;
    }
    return 1;
}

/* -------------------------------------------------------------- stats */

static void poll_kernel_stats(void)
{
    for (int i = 0; i < nports; i++) {
        struct tpacket_stats ks = {0, 0}; /* read-and-reset counters */
        socklen_t l = sizeof ks;
        if (getsockopt(ports[i].fd, SOL_PACKET, PACKET_STATISTICS, &ks, &l) == 0)
            ports[i].rxdir->st.drop_ring += ks.tp_drops; /* socket buffer overflow */
    }
}

/* Run-queue accounting of this process (CONFIG_SCHED_INFO): CPU time, time spent
 * runnable but waiting for a CPU, and number of timeslices.  0 if unavailable. */
static void read_schedstat(int64_t *run, int64_t *delay, uint64_t *slices)
{
    long long r = 0, w = 0;
    unsigned long long n = 0;
    FILE *f = fopen("/proc/self/schedstat", "r");
    if (f) {
        if (fscanf(f, "%lld %lld %llu", &r, &w, &n) != 3) r = w = 0, n = 0;
        fclose(f);
    }
    *run = r, *delay = w, *slices = n;
}

/* Start a new keep-up window: per-direction maxima and histograms, and the loop's
 * timing maxima and totals. */
static void reset_window(void)
{
    for (int i = 0; i < ndirs; i++) {
        stats_t *st = &dirs[i].st;
        st->max_backlog = st->max_backlog_bytes = 0;
        st->late_max = st->rxlag_max = 0;
        st->drop_ring = st->drop_queue = 0;
        memset(st->hist, 0, sizeof st->hist);
    }
    send_call_max = wake_late_max = tx_loop_max = harvest_gap_max = 0;
    rx_ns = tx_ns = 0;
    win_start = mono_ns();
    read_schedstat(&sched0_run, &sched0_delay, &sched0_slices);
}

static void emit_stats(const char *event)
{
    poll_kernel_stats();
    size_t cap = 4096 + (size_t)ndirs * 1536, n = 0;
    char *buf = malloc(cap);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    int64_t now = mono_ns(), s_run, s_delay;
    uint64_t s_slices;
    read_schedstat(&s_run, &s_delay, &s_slices);
    s_slices -= sched0_slices;
    uint64_t win_frames = 0;
    for (int i = 0; i < ndirs; i++) win_frames += hist_total(&dirs[i].st);
#define P(...) n += (size_t)snprintf(buf + n, cap - n, __VA_ARGS__)
    P("{\"event\":\"%s\",\"pid\":%d,\"t_mono\":%.6f,\"uptime_s\":%.6f,\"cpu_user_s\":%.6f,"
      "\"cpu_sys_s\":%.6f,\"wakeups\":%" PRIu64 ",\"loops\":%" PRIu64 ",\"send_calls\":%" PRIu64
      ",\"send_call_max_us\":%.1f,\"wake_late_max_us\":%.1f,\"tx_loop_max_us\":%.1f,\"read_gap_max_us\":%.1f"
      ",\"window_s\":%.6f,\"win_cpu_s\":%.6f,\"win_runq_wait_s\":%.6f,\"win_runq_wait_avg_us\":%.1f"
      ",\"win_rx_s\":%.6f,\"win_tx_s\":%.6f,\"win_frames_out\":%" PRIu64 ",\"cpu\":%d,\"rtprio\":%d,\"tx_kb\":%d"
      ",\"vnet\":%d,\"reorder\":%d,\"rx_poll_us\":%d,\"dirs\":[",
      event, getpid(), now / 1e9, (now - t_start) / 1e9,
      ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6, ru.ru_stime.tv_sec + ru.ru_stime.tv_usec / 1e6,
      n_wakeups, n_loops, n_sendcalls, send_call_max / 1e3, wake_late_max / 1e3, tx_loop_max / 1e3,
      harvest_gap_max / 1e3, (now - win_start) / 1e9, (s_run - sched0_run) / 1e9,
      (s_delay - sched0_delay) / 1e9, s_slices ? (s_delay - sched0_delay) / 1e3 / (double)s_slices : 0.0,
      rx_ns / 1e9, tx_ns / 1e9, win_frames, cfg.cpu, cfg.rtprio, cfg.tx_kb, cfg.vnet, cfg.reorder, cfg.rx_poll_us);
    for (int i = 0; i < ndirs; i++) {
        dir_t *d = &dirs[i];
        stats_t *s = &d->st;
        uint64_t tot = hist_total(s);
        double pct[3] = {0, 0, 0}, q[3] = {0.50, 0.99, 0.999};
        for (int k = 0; k < 3 && tot; k++) {
            uint64_t want = (uint64_t)ceil(q[k] * (double)tot), acc = 0;
            for (int j = 0; j < HIST_N; j++) {
                acc += s->hist[j];
                if (acc >= want) {
                    pct[k] = hist_upper_us(j);
                    break;
                }
            }
            if (isinf(pct[k])) pct[k] = s->late_max / 1e3;
        }
        P("%s{\"link\":%d,\"dir\":\"%s\",\"in\":\"%s\",\"out\":\"%s\",\"delay_us\":%.3f,"
          "\"jitter_us\":%.3f,\"table\":%d,\"loss\":%.6g,"
          "\"frames_in\":%" PRIu64 ",\"bytes_in\":%" PRIu64 ",\"segs_in\":%" PRIu64
          ",\"frames_out\":%" PRIu64 ",\"bytes_out\":%" PRIu64 ",\"segs_out\":%" PRIu64
          ",\"lost_segs\":%" PRIu64 ",\"lost_frames\":%" PRIu64 ",\"drop_ring\":%" PRIu64
          ",\"drop_queue\":%" PRIu64 ",\"drop_tx\":%" PRIu64 ",\"drop_trunc\":%" PRIu64 ",\"drop_down\":%" PRIu64
          ",\"gso_frames\":%" PRIu64 ",\"gso_split\":%" PRIu64 ",\"tx_retry\":%" PRIu64
          ",\"backlog\":%u,\"backlog_bytes\":%" PRIu64
          ",\"max_backlog\":%" PRIu64 ",\"max_backlog_bytes\":%" PRIu64
          ",\"late_max_us\":%.1f,\"late_p50_us\":%.1f,\"late_p99_us\":%.1f,\"late_p999_us\":%.1f"
          ",\"rx_lag_max_us\":%.1f,\"rx_lag_avg_us\":%.1f,\"buffer_mb\":%.1f,\"buffer_used_max_mb\":%.2f}",
          i ? "," : "", d->link, d->ba ? "ba" : "ab", d->in->name, d->out->name, d->delay / 1e3,
          d->jitter / 1e3, d->table, d->loss, s->frames_in, s->bytes_in, s->segs_in, s->frames_out,
          s->bytes_out, s->segs_out, s->lost_segs, s->lost_frames, s->drop_ring, s->drop_queue,
          s->drop_tx, s->drop_trunc, s->drop_down, s->gso_frames, s->gso_split, s->tx_retry,
          d->qlen, d->qbytes, s->max_backlog, s->max_backlog_bytes, s->late_max / 1e3, pct[0],
          pct[1], pct[2], s->rxlag_max / 1e3,
          s->frames_in ? s->rxlag_sum / 1e3 / (double)s->frames_in : 0.0, d->acap / 1048576.0,
          s->max_arena / 1048576.0);
    }
    P("]}\n");
#undef P
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(1, buf + off, n - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        off += (size_t)w;
    }
    free(buf);
}

/* -------------------------------------------------------------- rx mode */

static int epfd = -1, rx_poll_auto, rx_in_epoll;
static int rx_ep = -1; /* every port, level-triggered: which ones have frames (never waited on) */

/* Read the ports that have frames: one epoll_wait(0) tells which (an empty
 * recvmmsg per idle port is a syscall each, and syscalls are dear in a VM). */
static void harvest_ready(int64_t now, int64_t off)
{
    struct epoll_event evs[64];
    int ne;
    do {
        ne = epoll_wait(rx_ep, evs, 64, 0);
        for (int i = 0; i < ne; i++) harvest(&ports[evs[i].data.u64], now, off);
    } while (ne == 64);
}

/* How we learn about received frames.  They carry kernel timestamps, so it is
 * enough to read the sockets well before the smallest delay has passed:
 * "poll" mode reads them every rx_poll_us (auto:
 * min delay / 8 within 0.25..1 ms; no wakeups per frame).  With a delay below
 * 4 ms the sockets also go into epoll (a wakeup when frames arrive). */
static void apply_rx_mode(void)
{
    int64_t min_delay = INT64_MAX;
    for (int i = 0; i < ndirs; i++)
        if (dirs[i].delay < min_delay) min_delay = dirs[i].delay;
    if (rx_poll_auto) { /* short enough that one read pass stays cheap (~0.1 ms) */
        int64_t us = min_delay / 8000;
        cfg.rx_poll_us = us < 250 ? 250 : us > 1000 ? 1000 : (int)us;
    }
    int want_events = cfg.rx_poll_us == 0 || min_delay < 4000000;
    if (want_events && !rx_in_epoll && epfd >= 0) {
        for (int i = 0; i < nports; i++) {
            struct epoll_event pe = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
            epoll_ctl(epfd, EPOLL_CTL_ADD, ports[i].fd, &pe);
        }
        rx_in_epoll = 1;
    }
}

/* -------------------------------------------------------------- control */

static void control_line(char *line)
{
    int link;
    char which[8];
    double dl, jt, ls;
    int tb;
    if (!strncmp(line, "stats", 5)) {
        emit_stats("stats");
    } else if (!strncmp(line, "reset", 5)) {
        reset_window(); /* a new measurement window for the "did it keep up" statistics */
    } else if (sscanf(line, "set %d %7s %lf %lf %lf %d", &link, which, &dl, &jt, &ls, &tb) == 6 &&
               link >= 0 && link < nlinks && (!strcmp(which, "ab") || !strcmp(which, "ba"))) {
        set_dir_params(&dirs[2 * link + (which[0] == 'b')], dl, jt, ls, tb);
        apply_rx_mode();
    } else if (*line) {
        fprintf(stderr, "tbrelay: bad control line: %s\n", line);
    }
}

static int stdin_open = 1;
static void read_stdin(void)
{
    static char buf[4096];
    static size_t have;
    for (;;) {
        ssize_t r = read(0, buf + have, sizeof buf - 1 - have);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return; /* EAGAIN */
        if (r == 0) {
            stdin_open = 0;
            return;
        }
        have += (size_t)r;
        buf[have] = 0;
        char *s = buf, *nl;
        while ((nl = strchr(s, '\n'))) {
            *nl = 0;
            control_line(s);
            s = nl + 1;
        }
        have = strlen(s);
        memmove(buf, s, have);
        if (have == sizeof buf - 1) have = 0; /* overlong line: discard */
    }
}

/* ----------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CONFIG\n", argv[0]);
        return 2;
    }
    parse_config(argv[1]);
    signal(SIGPIPE, SIG_IGN);

    if (cfg.cpu >= 0) {
        cpu_set_t cs;
        CPU_ZERO(&cs);
        CPU_SET(cfg.cpu, &cs);
        if (sched_setaffinity(0, sizeof cs, &cs))
            fprintf(stderr, "tbrelay: cannot pin to cpu %d: %s\n", cfg.cpu, strerror(errno));
    }
    if (cfg.rtprio > 0) {
        struct sched_param sp = {.sched_priority = cfg.rtprio};
        if (sched_setscheduler(0, SCHED_FIFO, &sp))
            fprintf(stderr, "tbrelay: SCHED_FIFO %d: %s\n", cfg.rtprio, strerror(errno));
    }
    prctl(PR_SET_TIMERSLACK, (unsigned long)(cfg.slack_us > 0 ? cfg.slack_us * 1000L : 1L));

    rx_poll_auto = cfg.rx_poll_us < 0;
    for (int i = 0; i < ndirs; i++) setup_port(dirs[i].in, &dirs[i]);

    sigset_t ss;
    sigemptyset(&ss);
    sigaddset(&ss, SIGUSR1);
    sigaddset(&ss, SIGTERM);
    sigaddset(&ss, SIGINT);
    sigaddset(&ss, SIGHUP);
    sigprocmask(SIG_BLOCK, &ss, NULL);
    int sfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = (uint64_t)-1};
    epoll_ctl(ep, EPOLL_CTL_ADD, sfd, &ev);
    fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
    ev.data.u64 = (uint64_t)-2;
    if (epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev)) stdin_open = 0; /* e.g. /dev/null */
    epfd = ep;
    rx_ep = epoll_create1(EPOLL_CLOEXEC);
    for (int i = 0; rx_ep >= 0 && i < nports; i++) {
        struct epoll_event pe = {.events = EPOLLIN, .data.u64 = (uint64_t)i};
        if (epoll_ctl(rx_ep, EPOLL_CTL_ADD, ports[i].fd, &pe)) {
            close(rx_ep);
            rx_ep = -1; /* fall back to reading every port */
        }
    }
    apply_rx_mode();
    t_start = mono_ns();
    reset_window();
    emit_stats("ready");

    int running = 1;
    int64_t ov_ewma = 0; /* average timer wakeup overshoot, ns */
    int64_t spin_budget = 0, last_refill = mono_ns(), next_harvest = 0, last_harvest = 0;
    while (running) {
        n_loops++;
        int64_t rt = clock_ns(CLOCK_REALTIME), now = mono_ns();
        int64_t off = rt - now;
        /* read the sockets every rx_poll_us (frames carry kernel timestamps,
         * so reading them later does not change their due time) or, in event
         * mode, the ones epoll reported */
        if (now >= next_harvest) {
            if (last_harvest && now - last_harvest > harvest_gap_max) harvest_gap_max = now - last_harvest;
            last_harvest = now;
            if (rx_ep >= 0) harvest_ready(now, off);
            else for (int i = 0; i < nports; i++) harvest(&ports[i], now, off);
            rx_ns += mono_ns() - now;
            for (int i = 0; i < nports; i++) ports[i].rx_ready = 0;
            next_harvest = now + (cfg.rx_poll_us > 0 ? cfg.rx_poll_us : 1000) * 1000LL;
        } else {
            for (int i = 0; i < nports; i++)
                if (ports[i].rx_ready) {
                    ports[i].rx_ready = 0;
                    harvest(&ports[i], now, off);
                }
        }

        /* send everything due, one batch per direction per round (fairness) */
        int busy, any_retry = 0;
        int64_t tx_start = mono_ns();
        do {
            busy = 0;
            now = mono_ns();
            for (int i = 0; i < ndirs; i++) {
                dirs[i].retry = 0;
                busy |= tx_batch(&dirs[i], now);
                any_retry |= dirs[i].retry;
            }
            /* bounded: sending also runs the receivers' stack, and new frames
             * must still be read (and signals handled) meanwhile */
        } while (busy && !any_retry && now - tx_start < 2000000);
        if (now - tx_start > tx_loop_max) tx_loop_max = now - tx_start;

        /* Next wakeup: the earliest due time.  A sleeping (halted) vCPU
         * wakes up tens of microseconds late, so we sleep until
         * due - early and spin the rest; `early` follows a running average of
         * the measured wakeup overshoot (small when the CPU is busy anyway),
         * capped by spin_us. */
        int64_t next = INT64_MAX;
        for (int i = 0; i < ndirs; i++) {
            entry_t *t = q_top(&dirs[i]);
            if (t && t->due < next) next = t->due;
        }
        now = mono_ns();
        /* spinning is paid from a budget of spin_pct % of wall time, so that
         * under heavy load (dense due times) we sleep instead of burning CPU */
        spin_budget += (now - last_refill) * cfg.spin_pct / 100;
        if (spin_budget > 5000000) spin_budget = 5000000;
        last_refill = now;
        int64_t early = ov_ewma + ov_ewma / 2 + 5000;
        if (early > cfg.spin_us * 1000LL) early = cfg.spin_us * 1000LL;
        if (spin_budget <= 0) early = 0;
        if (next != INT64_MAX && next > now && next - now <= early) {
            /* due very soon: spin (pause) until then, then go round again */
            while ((now = mono_ns()) < next) __builtin_ia32_pause();
            spin_budget -= now - last_refill;
            if (n_loops & 255) continue;
            next = now + early; /* every 256 spins: poll signals/stdin below */
        }
        int64_t wake = next == INT64_MAX ? INT64_MAX : next - early;
        if (any_retry && wake > now + 20000) wake = now + 20000;
        if (wake > next_harvest) wake = next_harvest;
        struct timespec ts, *tsp = NULL;
        if (wake != INT64_MAX) {
            int64_t dt = wake - now;
            if (dt < 0) dt = 0;
            ts.tv_sec = dt / NSEC;
            ts.tv_nsec = dt % NSEC;
            tsp = &ts;
        }
        struct epoll_event evs[64];
        int ne = epoll_pwait2(ep, evs, 64, tsp, NULL);
        if (ne == 0 && tsp && wake > now) { /* timed out: learn the overshoot */
            int64_t ov = mono_ns() - wake;
            if (ov < 0) ov = 0;
            if (ov > wake_late_max) wake_late_max = ov;
            if (ov > 1000000) ov = 1000000; /* ignore preemption outliers */
            ov_ewma += (ov - ov_ewma) / 8;
        }
        if (ne > 0 || (tsp && wake > now)) n_wakeups++;
        for (int i = 0; i < ne; i++) {
            if (evs[i].data.u64 == (uint64_t)-1) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {
                    if (si.ssi_signo == SIGUSR1) emit_stats("stats");
                    else running = 0;
                }
            } else if (evs[i].data.u64 == (uint64_t)-2) {
                read_stdin();
                if (!stdin_open) epoll_ctl(ep, EPOLL_CTL_DEL, 0, NULL);
            } else if (evs[i].data.u64 < (uint64_t)nports) {
                ports[evs[i].data.u64].rx_ready = 1;
            }
        }
    }
    emit_stats("exit");
    return 0;
}
