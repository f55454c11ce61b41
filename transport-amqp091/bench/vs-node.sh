#!/usr/bin/env bash
# The retry consumer against the seed article's Node.js consumer and plain lapin, on the local
# RabbitMQ, in interleaved rounds.
#
#   transport-amqp091/bench/vs-node.sh [N] [ROUNDS]        # default 20000 messages, 3 rounds
#
# Copies the Node.js peer (../shared/bench/node-peer, or $NODE_PEER) to a temporary directory
# and installs its dependencies there, builds the `throughput` example in release, then runs,
# round by round, each consumer once as a process of its own: the peer's success and retry
# paths (DURABLE=1: durable queues, persistent messages) and the example's paths (lapin
# baselines and ours, see examples/throughput.rs), the order rotated every round. Every run
# makes its own uniquely named queues and deletes them. The table at the end is the
# example's `--report`: every consumer per round, min/median/max, and our ratios to each
# baseline in the same round.
#
# Environment: AMQP_URL (default: the example's and the peer's, guest@127.0.0.1:5672),
# NODE_PEER, QUIET=<load> to wait (at most 10 minutes) for the 1-minute load average to fall
# below <load> before starting, KEEP=<file> to keep the raw results (tab-separated).
set -euo pipefail

N=${1:-20000}
ROUNDS=${2:-3}
PREFETCH=100 # the example's, fixed

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
peer_src=${NODE_PEER:-$root/../shared/bench/node-peer}
[ -f "$peer_src/peer.js" ] || { echo "no Node.js peer at $peer_src (set NODE_PEER)" >&2; exit 1; }
command -v node >/dev/null && command -v npm >/dev/null || { echo "node and npm are needed" >&2; exit 1; }

work=$(mktemp -d -t vs-node.XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -r "$peer_src"/. "$work/peer"
chmod -R u+w "$work/peer"
echo "installing the Node.js peer in $work/peer" >&2
(cd "$work/peer" && npm install --no-audit --no-fund --loglevel=error >&2)

echo "building the throughput example (release)" >&2
(cd "$root" && cargo build --quiet --release -p transport-amqp091 --example throughput)
bin=${CARGO_TARGET_DIR:-$root/target}/release/examples/throughput

load1() { cut -d' ' -f1 /proc/loadavg; }

# Waits (at most 5 s) until the local broker has used under 5% of a core for 200 ms, as the
# example does before each of its measurements.
idle_broker() {
  local pid a b
  pid=$(pgrep -x beam.smp | head -1) || return 0
  for _ in $(seq 25); do
    a=$(awk '{ print $14 + $15 }' "/proc/$pid/stat") || return 0
    sleep 0.2
    b=$(awk '{ print $14 + $15 }' "/proc/$pid/stat") || return 0
    [ $((b - a)) -le 1 ] && return 0
  done
}

if [ -n "${QUIET:-}" ]; then
  for _ in $(seq 60); do
    awk -v l="$(load1)" -v q="$QUIET" 'BEGIN { exit !(l < q) }' && break
    echo "load $(load1), waiting for < $QUIET" >&2
    sleep 10
  done
fi

results=$work/results.tsv
echo "# uptime before: $(uptime)" >"$results"

# One run of the peer, as a result line: round path n seconds msg/s load1.
node_run() {
  local mode=$1 round=$2 line secs rate
  idle_broker
  line=$(cd "$work/peer" && DURABLE=1 node peer.js "$mode" "$N" "$PREFETCH")
  secs=$(sed -n 's/.*secs=\([0-9.]*\).*/\1/p' <<<"$line")
  rate=$(sed -n 's/.*rate=\([0-9.]*\).*/\1/p' <<<"$line")
  [ -n "$secs" ] && [ -n "$rate" ] || { echo "unexpected peer output: $line" >&2; exit 1; }
  printf '%s\tnode-%s\t%s\t%s\t%s\t%s\n' "$round" "$mode" "$N" "$secs" "$rate" "$(load1)"
}

paths=(node-ack lapin-ack-each lapin-batched ours-success node-retry lapin-pipelined ours-retry)
for round in $(seq "$ROUNDS"); do
  k=${#paths[@]}
  for i in $(seq 0 $((k - 1))); do
    path=${paths[$(((i + round - 1) % k))]}
    case $path in
      node-*) line=$(node_run "${path#node-}" "$round") ;;
      *) line=$("$bin" --tsv --n "$N" --round "$round" --paths "$path") ;;
    esac
    echo "$line" | tee -a "$results" >&2
  done
done
echo "# uptime after: $(uptime)" >>"$results"

[ -n "${KEEP:-}" ] && cp "$results" "$KEEP"
echo "uptime before: $(sed -n 's/^# uptime before: //p' "$results")"
echo "uptime after:  $(sed -n 's/^# uptime after: //p' "$results")"
echo
"$bin" --report "$results"
