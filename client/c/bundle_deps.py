#!/usr/bin/env python3
"""Copies libattnd_client_c.so and every shared library it needs (ldd), except glibc's and the C++ runtime's,
into one folder, and writes bundled.txt there: the file names in load order, dependencies first.

The package loads the listed libraries by path in that order before libattnd_client_c.so. A library's RUNPATH
applies to its own direct dependencies only, so $ORIGIN on libattnd_client_c.so alone would not let libgrpc++
find libgrpc on a host without gRPC; loaded first by path, each is already there when the next one needs it.

usage: bundle_deps.py LIBRARY DEST_DIR
"""
import os
import re
import shutil
import subprocess
import sys

# What every Linux host provides in a compatible version: glibc's libraries, the loader, the C++ and GCC
# runtimes (the GPU host's are newer than the build's, which is what their versioning allows).
SYSTEM = re.compile(
    r"^(linux-vdso|linux-gate|ld-linux.*|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libnsl|"
    r"libstdc\+\+|libgcc_s)\.so")


def ldd(path):
    """soname -> resolved path of every library `path` loads, direct or not."""
    out = subprocess.run(["ldd", path], check=True, capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+) \(0x", line)
        if m:
            libs[m.group(1)] = m.group(2)
        elif "not found" in line:
            sys.exit(f"bundle_deps: {path}: {line.strip()}")
    return libs


def needed(path):
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    lib, dest = sys.argv[1], sys.argv[2]
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(dest):
        if ".so" in name or name == "bundled.txt":
            os.remove(os.path.join(dest, name))
    deps = {n: p for n, p in ldd(lib).items() if not SYSTEM.match(n)}
    order, seen = [], set()

    def visit(name):
        if name in seen or name not in deps:
            return
        seen.add(name)
        for n in needed(deps[name]):
            visit(n)
        order.append(name)

    for name in sorted(deps):
        visit(name)
    for name in order:
        shutil.copy2(deps[name], os.path.join(dest, name))
    shutil.copy2(lib, os.path.join(dest, os.path.basename(lib)))
    with open(os.path.join(dest, "bundled.txt"), "w") as f:
        f.write("".join(n + "\n" for n in order))
    size = sum(os.path.getsize(os.path.join(dest, n)) for n in order)
    print(f"bundle_deps: {len(order)} libraries ({size >> 20} MiB) and {os.path.basename(lib)} in {dest}")


if __name__ == "__main__":
    main()
