#!/usr/bin/env bash
# The retry consumer against the seed article's Node.js consumer and plain lapin, on the local
# RabbitMQ, in interleaved rounds, at one or more prefetches.
#
#   benches/vs-node.sh [N] [ROUNDS] [--prefetch P,P,..] [--memory P:BYTES] [--plot FILE.svg]
#
#   N, ROUNDS        default 20000 messages, 3 rounds
#   --prefetch LIST  the prefetches to measure every consumer at (default 100)
#   --memory P:B     also measure, in the same rounds, the benchmark's paths (not the peer's,
#                    whose bodies are fixed at 256 bytes) at prefetch P with B-byte bodies, for
#                    the growth of their resident memory (e.g. --memory 1000:1024)
#   --plot FILE      also draw msg/s against prefetch as an SVG (the benchmark's --plot)
#
# Copies the Node.js peer (../shared/bench/node-peer, or $NODE_PEER) to a temporary directory
# and installs its dependencies there, builds the `throughput` benchmark in release, then runs,
# round by round, each consumer at each prefetch once as a process of its own: the peer's
# success and retry paths (DURABLE=1: durable queues, persistent messages; its prefetch is its
# third argument) and the benchmark's paths on amqp091 (lapin baselines, the seed's work on
# lapin, and ours, see src/bin/throughput.rs and src/amqp091.rs), the order of the (prefetch, consumer) pairs rotated every round.
# Since each benchmark run is a process of one measurement, it reports the growth of its
# resident memory too. Every run makes its own uniquely named queues and deletes them.
#
# The peer's CPU time is measured over the same span as its msg/s: it is started with a
# preload (node -r) that wraps process.hrtime.bigint, which peer.js reads exactly twice, when
# its clock starts (just before consuming) and when it stops; at each reading the preload
# also reads the process's CPU time (process.cpuUsage) and the broker's (/proc/<pid>/stat of
# beam.smp), and prints the differences per message when the process exits. Should peer.js
# read that clock any other number of times, its CPU figures are left unknown.
#
# The table at the end is the benchmark's `--report`: per prefetch (and body size) every
# consumer per round, min/median/max, and our ratios to each baseline in the same round, in
# msg/s, client and broker CPU per message and resident memory growth; then the ratios of
# every prefetch side by side.
#
# Environment: AMQP_URL (default: the benchmark's and the peer's, guest@127.0.0.1:5672),
# NODE_PEER, QUIET=<load> to wait (at most 10 minutes) for the 1-minute load average to fall
# below <load> before starting, KEEP=<file> to keep the raw results (tab-separated).
set -euo pipefail

usage="usage: $0 [N] [ROUNDS] [--prefetch P,P,..] [--memory P:BYTES] [--plot FILE.svg]"
positional=()
PREFETCHES=100
MEMORY=
PLOT=
while [ $# -gt 0 ]; do
  case $1 in
    --prefetch) PREFETCHES=${2:?$usage}; shift 2 ;;
    --memory) MEMORY=${2:?$usage}; shift 2 ;;
    --plot) PLOT=${2:?$usage}; shift 2 ;;
    -*) echo "unknown option $1; $usage" >&2; exit 2 ;;
    *) positional+=("$1"); shift ;;
  esac
done
N=${positional[0]:-20000}
ROUNDS=${positional[1]:-3}
BODY=256 # the peer's, fixed
if [ -n "$MEMORY" ]; then
  [[ $MEMORY =~ ^[0-9]+:[0-9]+$ ]] || { echo "--memory takes PREFETCH:BYTES; $usage" >&2; exit 2; }
fi
# A relative plot path is the caller's, not the working directory's of the report.
[ -n "$PLOT" ] && [[ $PLOT != /* ]] && PLOT=$PWD/$PLOT

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
peer_src=${NODE_PEER:-$root/../shared/bench/node-peer}
[ -f "$peer_src/peer.js" ] || { echo "no Node.js peer at $peer_src (set NODE_PEER)" >&2; exit 1; }
command -v node >/dev/null && command -v npm >/dev/null || { echo "node and npm are needed" >&2; exit 1; }

work=$(mktemp -d -t vs-node.XXXXXX)
trap 'rm -rf "$work"' EXIT
cp -r "$peer_src"/. "$work/peer"
chmod -R u+w "$work/peer"
echo "installing the Node.js peer in $work/peer" >&2
(cd "$work/peer" && npm install --no-audit --no-fund --loglevel=error >&2)

# The preload that measures the peer's CPU time over its own clock's span (see above).
cat >"$work/peer/cpu-span.js" <<'EOF'
const fs = require('fs');
const bigint = process.hrtime.bigint;
const marks = [];
// The broker's CPU time in clock ticks (utime + stime), NaN if it cannot be read.
function brokerTicks() {
  try {
    const stat = fs.readFileSync(`/proc/${process.env.BROKER_PID}/stat`, 'utf8');
    const f = stat.slice(stat.lastIndexOf(')') + 1).trim().split(/\s+/);
    return Number(f[11]) + Number(f[12]);
  } catch (e) {
    return NaN;
  }
}
process.hrtime.bigint = function () {
  marks.push({ broker: brokerTicks(), cpu: process.cpuUsage() });
  return bigint.call(process.hrtime);
};
process.on('exit', () => {
  const n = Number(process.argv[3] || 20000);
  if (marks.length !== 2) return;
  const [a, b] = marks;
  const client = (b.cpu.user - a.cpu.user + b.cpu.system - a.cpu.system) / n;
  const tick = 1e6 / Number(process.env.CLK_TCK || 100);
  const broker = ((b.broker - a.broker) * tick) / n;
  fs.writeSync(1, `cpu client_us=${client.toFixed(1)} broker_us=${broker.toFixed(1)}\n`);
});
EOF

echo "building the throughput benchmark (release)" >&2
(cd "$root" && cargo build --quiet --release -p benches --bin throughput)
bin=${CARGO_TARGET_DIR:-$root/target}/release/throughput

load1() { cut -d' ' -f1 /proc/loadavg; }

# Waits (at most 5 s) until the local broker has used under 5% of a core for 200 ms, as the
# benchmark does before each of its measurements.
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
broker_pid=$(pgrep -x beam.smp | head -1 || true)
clk_tck=$(getconf CLK_TCK)

# One run of the peer, as a result line in the benchmark's format: round path n seconds msg/s
# load1 client-µs/msg broker-µs/msg prefetch body rss-growth-KiB (not measured: NaN).
node_run() {
  local mode=$1 round=$2 prefetch=$3 out line secs rate client broker
  idle_broker
  out=$(cd "$work/peer" && DURABLE=1 BROKER_PID=$broker_pid CLK_TCK=$clk_tck \
    node -r ./cpu-span.js peer.js "$mode" "$N" "$prefetch")
  line=$(grep '^node ' <<<"$out" || true)
  secs=$(sed -n 's/.*secs=\([0-9.]*\).*/\1/p' <<<"$line")
  rate=$(sed -n 's/.*rate=\([0-9.]*\).*/\1/p' <<<"$line")
  [ -n "$secs" ] && [ -n "$rate" ] || { echo "unexpected peer output: $out" >&2; exit 1; }
  client=$(sed -n 's/^cpu client_us=\([0-9.]*\).*/\1/p' <<<"$out")
  broker=$(sed -n 's/^cpu .*broker_us=\([0-9.]*\).*/\1/p' <<<"$out")
  printf '%s\tnode-%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\tNaN\n' "$round" "$mode" "$N" "$secs" \
    "$rate" "$(load1)" "${client:-NaN}" "${broker:-NaN}" "$prefetch" "$BODY"
}

# What a round runs: prefetch:body:path, the peer's paths at the peer's body size only.
runs=()
for prefetch in ${PREFETCHES//,/ }; do
  for path in node-ack lapin-ack-each lapin-batched ours-success node-retry lapin-pipelined lapin-seed ours-retry; do
    runs+=("$prefetch:$BODY:$path")
  done
done
if [ -n "$MEMORY" ]; then
  for path in lapin-ack-each lapin-batched ours-success lapin-pipelined lapin-seed ours-retry; do
    runs+=("${MEMORY%%:*}:${MEMORY##*:}:$path")
  done
fi

for round in $(seq "$ROUNDS"); do
  k=${#runs[@]}
  for i in $(seq 0 $((k - 1))); do
    IFS=: read -r prefetch body path <<<"${runs[$(((i + round - 1) % k))]}"
    case $path in
      node-*) line=$(node_run "${path#node-}" "$round" "$prefetch") ;;
      *) line=$("$bin" amqp091 --tsv --n "$N" --round "$round" --paths "$path" --prefetch "$prefetch" --body "$body") ;;
    esac
    echo "$line" | tee -a "$results" >&2
  done
done
echo "# uptime after: $(uptime)" >>"$results"

[ -n "${KEEP:-}" ] && cp "$results" "$KEEP"
echo "uptime before: $(sed -n 's/^# uptime before: //p' "$results")"
echo "uptime after:  $(sed -n 's/^# uptime after: //p' "$results")"
echo
"$bin" amqp091 --report "$results" ${PLOT:+--plot "$PLOT"}
