// attnd allocates with jemalloc: CMake links it into this binary only (cmake/Dependencies.cmake). jemalloc reads
// the options below once, at the process's first allocation, before main() runs; what the flags change at run time
// (--retain_heap) goes through mallctl in attnd/transport/heap_tuning.h, and so does the idle purge.
//
// oversize_threshold:0 keeps blocks of 8 MiB and more in the arenas like every other block: jemalloc's default
//   serves them from an arena that purges what it frees at once, so each request would page-fault its tensor
//   buffers in again (what --retain_heap avoids).
// percpu_arena:percpu: one arena per CPU, the one a thread runs on (jemalloc's default is 4 per CPU, each thread
//   bound to the least loaded when it starts). Fewer arenas hold less of what they free and less bookkeeping: a
//   hostile upload leaves 1.8-2.2 MiB resident once purged against 2.2-2.6 MiB, and 1-token calls fault 2.5-6k
//   pages in 8 s against 6-9k, at the same throughput (2-core VM).
// tcache_max:16384, tcache_nslots_small_max:16, tcache_nslots_large:4: small thread caches. gRPC starts and ends
//   threads as calls come (about one for every few 1-token calls at 16 callers), and each new thread faults its
//   cache in: with jemalloc's default caches (up to 200 blocks a size class, blocks up to 32 KiB) the server took
//   81-111k page faults in 8 s of such calls against glibc's 1.3-1.8k, and 5% of their throughput; with these,
//   7.4-9.5k and none measurable. Blocks past the cache come from the arena, under its lock.
extern "C" {
// jemalloc defines a weak malloc_conf of its own; this one takes its place.
__attribute__((visibility("default"))) const char* malloc_conf =
    "oversize_threshold:0,percpu_arena:percpu,tcache_max:16384,tcache_nslots_small_max:16,tcache_nslots_large:4";
}
