#!/bin/sh
# Container entrypoint. Configuration comes from the environment so that docker -e, compose and a Kubernetes
# ConfigMap all work the same way:
#   ATTND_<NAME>=value  ->  attnd --<name>=value   (NAME lower-cased: ATTND_MAX_QUEUE=64 -> --max_queue=64)
# An empty value is passed on as well (ATTND_UNIX_SOCKET= turns the image's default socket off). Arguments
# that start with '-' are appended after the environment's flags and so override them; any other first
# argument is run as a command instead (`docker run IMAGE attn info`).
#   --healthcheck   grpc.health.v1 check of ATTND_HEALTHCHECK_TARGET (the image's HEALTHCHECK uses it)
set -eu

if [ "${1:-}" = "--healthcheck" ]; then
  # grpc.health.v1 alone; the deadline stays inside the HEALTHCHECK's 3 s timeout so a hung server reads as
  # unhealthy rather than as a killed check.
  exec /usr/local/bin/attn health --target="${ATTND_HEALTHCHECK_TARGET:-127.0.0.1:50051}" --deadline_ms=2500
fi
if [ "$#" -gt 0 ] && [ "${1#-}" = "$1" ]; then
  exec "$@"
fi

for name in $(env | sed -n 's/^\(ATTND_[A-Z0-9_]*\)=.*/\1/p' | sort -r); do
  case "$name" in
    ATTND_HEALTHCHECK_TARGET) continue ;;  # read by this script, not a server flag
  esac
  flag=$(printf '%s' "${name#ATTND_}" | tr 'A-Z' 'a-z')
  eval "value=\${$name}"
  set -- "--${flag}=${value}" "$@"
done
# exec, so that attnd is PID 1 and gets the runtime's SIGTERM itself.
exec /usr/local/bin/attnd "$@"
