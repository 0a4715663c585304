// Process-wide allocator tuning for processes that move tensors of megabytes per request (attnd, attn).
#pragma once

namespace attnd {

// glibc serves allocations above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) with fresh
// mmaps and unmaps them on free, so every request's tensor buffers (the parsed message, the reply) are
// page-faulted in again: measured 15 ms of a unary Forward's 25 MB request at attnd's entry, 4 ms once
// freed memory stays in the heap. This keeps blocks up to 32 MiB (the most glibc accepts) in the heap and
// freed memory mapped up to 1 GiB; the process's resident size then stays near its peak instead of
// falling back after each request. Returns false where this is not glibc (nothing changed).
bool RetainFreedHeapMemory();

}  // namespace attnd
