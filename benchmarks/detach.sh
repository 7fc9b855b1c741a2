#!/usr/bin/env bash
# Runs a long command (the GPU suite and the benchmark: run_h200.sh) detached from the calling shell, so that it
# outlives a device call that must return within its time limit, and collects what it wrote so far in later calls.
#
# Usage (from the repository root):
#   bash benchmarks/detach.sh start COMMAND [ARGS...]   # returns at once; COMMAND runs with OUT=$DETACHED_DIR/out
#   bash benchmarks/detach.sh collect [SECONDS]         # waits up to SECONDS (default 0) for it to end, then copies
#                                                       # $DETACHED_DIR/out and its log into $OUT (default ./out)
# DETACHED_DIR (default /tmp/s2attn-detached) holds the command's output, log and exit status, and the snapshot of
# the working directory the command runs in (its "tree": a copy without .venv, build and out), so that a later call
# that refreshes the working directory under it changes no file the command reads; "start" refuses while an earlier
# command still runs there. "collect" exits 0 once the command has ended (its status is in
# $OUT/detached-status), 3 while it still runs, 2 if none was started. Copy whatever matters before the call's
# time runs out: a collect killed by its call's limit returns nothing.
set -uo pipefail
dir="${DETACHED_DIR:-/tmp/s2attn-detached}"
case "${1:-}" in
  start)
    shift
    [[ $# -ge 1 ]] || { echo "usage: $0 start COMMAND [ARGS...]" >&2; exit 2; }
    if [[ -e "$dir/running" ]]; then
      echo "a detached command still runs in $dir: $(cat "$dir/command")" >&2
      exit 2
    fi
    rm -rf "$dir" && mkdir -p "$dir/out" "$dir/tree"
    tar -C "$PWD" --exclude=./.venv --exclude=./build --exclude=./out -cf - . | tar -C "$dir/tree" -xf - ||
      { echo "could not copy $PWD into $dir/tree" >&2; exit 2; }
    printf '%q ' "$@" > "$dir/command"
    touch "$dir/running"
    # The status is written before the running mark goes, so that collect never sees neither.
    OUT="$dir/out" setsid bash -c 'cd "$0/tree" && "$@" > "$0/log" 2>&1; echo $? > "$0/status"; rm -f "$0/running"' \
      "$dir" "$@" < /dev/null > /dev/null 2>&1 &
    echo "started in $dir: $(cat "$dir/command")"
    ;;
  collect)
    [[ -e "$dir/command" ]] || { echo "no detached command was started in $dir" >&2; exit 2; }
    end=$(( $(date +%s) + ${2:-0} ))
    while [[ -e "$dir/running" && $(date +%s) -lt $end ]]; do sleep 2; done
    out="${OUT:-$PWD/out}"
    mkdir -p "$out"
    cp -r "$dir/out/." "$out/" 2>/dev/null
    cp "$dir/log" "$out/detached.log" 2>/dev/null
    if [[ -e "$dir/running" ]]; then
      echo "still running: $(cat "$dir/command")"; tail -5 "$dir/log" 2>/dev/null
      exit 3
    fi
    cp "$dir/status" "$out/detached-status"
    echo "ended with status $(cat "$dir/status"): $(cat "$dir/command")"; tail -5 "$dir/log"
    ;;
  *)
    echo "usage: $0 start COMMAND [ARGS...] | collect [SECONDS]" >&2
    exit 2
    ;;
esac
