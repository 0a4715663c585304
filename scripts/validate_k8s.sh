#!/usr/bin/env bash
# Validates the Kubernetes manifests (docker/k8s/, examples included) and docker/compose.yaml offline:
# OpenAPI schema, no unknown fields, the compose specification, and attnd's own deployment rules (see
# scripts/validate_k8s/validate.mjs). The tools are npm packages pinned in scripts/validate_k8s/package-lock.json,
# installed once into a cache directory (the npm registry is the only network use; validation itself is offline).
# A self-test breaks the manifests on purpose first and fails unless every break is caught.
#   ATTND_TOOLS_DIR   where the packages go (default: ~/.cache/attnd/validate_k8s)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "validate_k8s: installing nodejs and npm"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi

tools=${ATTND_TOOLS_DIR:-${HOME:-/root}/.cache/attnd/validate_k8s}
mkdir -p "$tools"
# Reinstall only when the pinned set changes.
if ! cmp -s scripts/validate_k8s/package-lock.json "$tools/package-lock.json" || [ ! -d "$tools/node_modules" ]; then
  cp scripts/validate_k8s/package.json scripts/validate_k8s/package-lock.json "$tools/"
  echo "validate_k8s: npm ci into $tools"
  (cd "$tools" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
fi
# Node resolves the packages relative to the script, so it runs from the tools directory.
cp scripts/validate_k8s/validate.mjs "$tools/validate.mjs"

mapfile -t files < <(find docker/k8s -name '*.yaml' -o -name '*.yml' | sort)
node "$tools/validate.mjs" --repo "$root" "${files[@]}" docker/compose.yaml
