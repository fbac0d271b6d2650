/* The compiled exec shim: the same confinement as _shim.py's `apply`, without
 * starting an interpreter for every child.
 *
 * Usage: launcher FD. It reads one request from descriptor FD (built by
 * _launcher.py: every decision is made there, in Python; this program only makes
 * the system calls, in _shim.apply's order), closes every descriptor beyond 0-2,
 * confines itself and execve's the target. Any failure writes one line
 * "confine: ..." to stderr and exits 125: the target never runs less confined.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <linux/filter.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SHIM_FAILED 125
#define MAX_REQUEST (1 << 20)

static unsigned char buf[MAX_REQUEST];
static size_t len, pos;

/* One line on stderr, worded as the Python shim words it ("confine: KIND: ..."), then
 * exit 125. `err`: an errno (0: `what` is the whole reason); `path`: the file a
 * call failed on, if any. */
static void fail_at(const char *what, int err, const char *path) {
    char line[1024];
    int n;
    if (!err) {
        n = snprintf(line, sizeof line, "confine: %s\n", what);
    } else {
        const char *kind = err == EACCES || err == EPERM ? "PermissionError"
                           : err == ENOENT ? "FileNotFoundError"
                           : err == ENOTDIR ? "NotADirectoryError" : "OSError";
        if (path)
            n = snprintf(line, sizeof line, "confine: %s: [Errno %d] %s: '%s'\n", kind, err,
                         strerror(err), path);
        else
            n = snprintf(line, sizeof line, "confine: %s: [Errno %d] %s: %s\n", kind, err,
                         what, strerror(err));
    }
    if (n > 0) {
        ssize_t ignored = write(2, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
        (void)ignored;
    }
    _exit(SHIM_FAILED);
}

static void fail(const char *what, int err) { fail_at(what, err, NULL); }

static const unsigned char *take(size_t n) {
    if (n > len - pos) fail("truncated request", 0);
    const unsigned char *p = buf + pos;
    pos += n;
    return p;
}

static uint64_t u64(void) { uint64_t v; memcpy(&v, take(8), 8); return v; }
static uint32_t u32(void) { uint32_t v; memcpy(&v, take(4), 4); return v; }
static int64_t i64(void) { int64_t v; memcpy(&v, take(8), 8); return v; }

/* A string: u32 length and bytes, copied with a terminating NUL. */
static char *str(void) {
    uint32_t n = u32();
    const unsigned char *p = take(n);
    char *s = malloc((size_t)n + 1);
    if (!s) fail("out of memory", 0);
    memcpy(s, p, n);
    s[n] = 0;
    return s;
}

static char **strings(void) {
    uint32_t n = u32();
    if (n > 65536) fail("bad request", 0);
    char **v = calloc((size_t)n + 1, sizeof *v);
    if (!v) fail("out of memory", 0);
    for (uint32_t i = 0; i < n; i++) v[i] = str();
    return v;
}

static void close_above_2(void) {
    if (syscall(SYS_close_range, 3U, ~0U, 0U) == 0) return;
    struct rlimit r;
    long top = getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < (1 << 20) ? (long)r.rlim_cur
                                                                           : 1 << 20;
    for (long fd = 3; fd < top; fd++) close((int)fd);
}

int main(int argc, char **argv) {
    if (argc != 2) fail("usage: launcher FD", 0);
    int fd = atoi(argv[1]);
    for (;;) {
        if (len == sizeof buf) fail("request too large", 0);
        ssize_t n = read(fd, buf + len, sizeof buf - len);
        if (n < 0) { if (errno == EINTR) continue; fail("read request", errno); }
        if (n == 0) break;
        len += (size_t)n;
    }
    close(fd);
    close_above_2();  /* nothing of the daemon's beyond 0-2 reaches the target */
    if (len < 4 || memcmp(take(4), "AGL1", 4) != 0) fail("bad request", 0);

    char *executable = str();
    char **targv = strings();
    char **tenv = strings();
    char *cgroup_procs = str();
    uint32_t flags = u32();
    int deny_network = flags & 1, try_netns = flags & 2, do_landlock = flags & 4,
        landlock_tcp = flags & 8, require_fs = flags & 16, do_seccomp = flags & 32;
    int64_t gid = i64(), uid = i64();

    if (*cgroup_procs) {  /* first: into its own pids cgroup, while it may write there */
        int c = open(cgroup_procs, O_WRONLY | O_CLOEXEC);
        if (c < 0) fail_at("open", errno, cgroup_procs);
        char pid[32];
        int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
        if (write(c, pid, (size_t)n) != n) fail_at("write", errno, cgroup_procs);
        close(c);
    }
    int net_denied = 0;
    if (deny_network && try_netns && unshare(0x40000000 /* CLONE_NEWNET */) == 0)
        net_denied = 1;
    if (gid >= 0) {
        if (setgroups(0, NULL) != 0) fail("setgroups", errno);
        if (setgid((gid_t)gid) != 0) fail("setgid", errno);
    }
    if (uid >= 0 && setuid((uid_t)uid) != 0) fail("setuid", errno);
    uint32_t nlimits = u32();
    for (uint32_t i = 0; i < nlimits; i++) {
        int which = (int)u32();
        uint64_t value = u64();
        struct rlimit r = {value, value};
        if (setrlimit(which, &r) != 0) fail("setrlimit", errno);
    }
    struct rlimit nocore = {0, 0};
    if (setrlimit(RLIMIT_CORE, &nocore) != 0) fail("setrlimit", errno);
    char *cwd = str();
    if (*cwd && chdir(cwd) != 0) fail_at("chdir", errno, cwd);

    uint32_t attr_len = u32();
    const unsigned char *attr = take(attr_len);
    uint32_t nrules = u32();
    if (do_landlock) {
        long ruleset = syscall(444, attr, (size_t)attr_len, 0U);
        if (ruleset < 0) fail("landlock_create_ruleset", errno);
        for (uint32_t i = 0; i < nrules; i++) {
            char *path = str();
            uint64_t rights = u64(), file_rights = u64();
            int p = open(path, O_PATH | O_CLOEXEC);
            if (p < 0) {
                if (errno == ENOENT) continue;  /* a path that does not exist grants nothing */
                fail_at("open", errno, path);
            }
            struct stat st;
            if (fstat(p, &st) != 0) fail_at("fstat", errno, path);
            if (!S_ISDIR(st.st_mode)) rights &= file_rights;
            if (rights) {
                struct __attribute__((packed)) { uint64_t allowed; int32_t parent; } rule =
                    {rights, p};
                if (syscall(445, (int)ruleset, 1 /* PATH_BENEATH */, &rule, 0U) < 0)
                    fail("landlock_add_rule", errno);
            }
            close(p);
        }
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("prctl(PR_SET_NO_NEW_PRIVS)", errno);
        if (syscall(446, (int)ruleset, 0U) < 0) fail("landlock_restrict_self", errno);
        close((int)ruleset);
        if (landlock_tcp) net_denied = 1;
    } else if (require_fs) {
        fail("RuntimeError: filesystem confinement required but Landlock is unavailable", 0);
    }
    if (deny_network && !net_denied)
        fail("RuntimeError: network denial required but neither a network namespace nor "
             "Landlock TCP rules are available", 0);

    if (geteuid() == 0 || getuid() == 0) {
        /* no capability now or after execve: bounding set, ambient, then the rest */
        int last = 63;
        FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
        if (f) { if (fscanf(f, "%d", &last) != 1) last = 63; fclose(f); }
        for (int cap = 0; cap <= last; cap++)
            if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
                fail("prctl(PR_CAPBSET_DROP)", errno);
        prctl(47 /* PR_CAP_AMBIENT */, 4 /* CLEAR_ALL */, 0, 0, 0);
        struct { uint32_t version; int pid; } header = {0x20080522, 0};
        uint32_t data[6] = {0};
        if (syscall(SYS_capset, &header, data) != 0) fail("capset", errno);
    }
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
        fail("prctl(PR_SET_CHILD_SUBREAPER)", errno);
    uint32_t prog_len = u32();
    const unsigned char *prog = take(prog_len);
    if (do_seccomp) {
        struct sock_fprog fprog = {(unsigned short)(prog_len / 8),
                                   (struct sock_filter *)prog};
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("prctl(PR_SET_NO_NEW_PRIVS)", errno);
        if (prctl(PR_SET_SECCOMP, 2 /* FILTER */, &fprog, 0, 0) != 0)
            fail("prctl(PR_SET_SECCOMP)", errno);
    }
    execve(executable, targv, tenv);
    fail_at("execve", errno, executable);
    return SHIM_FAILED;
}
