#!/usr/bin/env bash
# Checks the API (proto/) with buf: `buf lint` under proto/buf.yaml, then `buf breaking` of proto/ as checked out
# against the previous commit's (HEAD~1), so that attnd.v1 stays wire- and JSON-compatible (docs/transport.md,
# "The API's compatibility"). buf is the npm package pinned in scripts/proto_check/package-lock.json, installed once
# into ~/.cache/attnd/proto_check (the npm registry is its only network use; npm comes from scripts/install_deps.sh).
# Without a previous commit (a shallow clone of depth 1, the first commit, no git) the breaking check says so and
# is skipped.
#   bash scripts/proto_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v npm >/dev/null; then
  echo "proto_check: npm is missing (bash scripts/install_deps.sh installs it)" >&2
  exit 1
fi
tools=${HOME:-/root}/.cache/attnd/proto_check
mkdir -p "$tools"
# Reinstall only when the pinned set changes; the stamp is written after a complete install.
if ! cmp -s scripts/proto_check/package-lock.json "$tools/installed.lock" || [ ! -x "$tools/node_modules/.bin/buf" ]; then
  rm -f "$tools/installed.lock"
  cp scripts/proto_check/package.json scripts/proto_check/package-lock.json "$tools/"
  echo "proto_check: npm ci into $tools"
  (cd "$tools" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
  cp scripts/proto_check/package-lock.json "$tools/installed.lock"
fi
buf=$tools/node_modules/.bin/buf

"$buf" lint proto
echo "proto_check: buf lint: clean"

# The previous commit's proto/ goes into a folder of its own (git archive works the same in a clone and in a
# worktree, whose .git is a file). Its config is given inline, so that no buf.yaml above the temporary folder
# claims it.
if ! git rev-parse --git-dir >/dev/null; then
  echo "proto_check: not a git checkout: buf breaking skipped"
  exit 0
fi
if ! git rev-parse --verify --quiet 'HEAD~1^{commit}' >/dev/null; then
  if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
    echo "proto_check: shallow clone without HEAD~1 (fetch with --depth=2 or more): buf breaking skipped"
  else
    echo "proto_check: HEAD has no parent: buf breaking skipped"
  fi
  exit 0
fi
if ! git cat-file -e 'HEAD~1:proto' 2>/dev/null; then
  echo "proto_check: HEAD~1 has no proto/: buf breaking skipped"
  exit 0
fi
prev=$(mktemp -d)
trap 'rm -rf "$prev"' EXIT
git archive HEAD~1 proto | tar -x -C "$prev"
"$buf" breaking proto --against "$prev/proto" --against-config '{"version": "v2"}'
echo "proto_check: buf breaking against $(git rev-parse --short HEAD~1): compatible"
