#!/usr/bin/env bash
# A local three-node NATS JetStream cluster for the NATS cluster tests, beside the machine's
# own server.
#
#   stress/nats-cluster.sh up          start n1..n3 (a running node is left alone) and wait until
#                                     JetStream is ready: one meta leader that all three agree
#                                     on, and both other nodes current with it
#   stress/nats-cluster.sh down        stop them (SIGTERM, SIGKILL after 5 s) and delete their data
#   stress/nats-cluster.sh stop NODE   SIGTERM one node and wait until it has exited
#   stress/nats-cluster.sh kill NODE   SIGKILL one node
#   stress/nats-cluster.sh start NODE  start a stopped or killed node again on its own store; wait
#                                     until it listens and, when another node runs, until its
#                                     JetStream is current with the meta leader again (whether
#                                     it has caught up on each stream and consumer is for the
#                                     caller to check: see META_ONLY)
#   stress/nats-cluster.sh status      which nodes run, their ports and the meta leader
#   stress/nats-cluster.sh urls        the client URLs, comma-separated, for NATS_CLUSTER_URLS
#
# NODE is n1, n2 or n3 (or just 1, 2 or 3). Node N listens on 127.0.0.1 only: for clients on
# 424N, for cluster routes on 624N and for HTTP monitoring (the readiness checks) on 824N. Its
# config, pid file, log and JetStream store live in $NATS_CLUSTER_DIR/nN (default
# /tmp/retry-nats-cluster); `up` after everything went down starts all three on their stores.
# NATS_CLUSTER_DEBUG=true writes the servers' debug logs (Raft included) there too.
# The machine's own server (127.0.0.1:4222, /var/lib/nats-server) is never touched: every
# process here is found through its pid file and its own config file.
set -euo pipefail

DIR="${NATS_CLUSTER_DIR:-/tmp/retry-nats-cluster}"
NODES=(n1 n2 n3)
NATS_SERVER="${NATS_SERVER:-$(command -v nats-server || echo /usr/sbin/nats-server)}"
READY_TIMEOUT=60
# META_ONLY: why `start` waits for the meta group only, not for the whole /healthz. On
# nats-server 2.9.10 (Debian's) the first leader of a consumer's Raft group installs a
# snapshot at once, before the group holds any entry. Killed before the group has another
# entry, that node comes back at term 1, index 0, and the new leader's catch-up never
# applies (the node truncates the first entry it is sent and cancels the catch-up, every
# time): /healthz names that consumer as not current for as long as the consumer's state
# does not change (more than eight minutes here), and a graceful restart of the node did
# not always help. The two other replicas carry on meanwhile.

die() { echo "nats-cluster.sh: $*" >&2; exit 1; }

case "$DIR" in
    "" | / | /tmp | /tmp/) die "refusing NATS_CLUSTER_DIR='$DIR'" ;;
esac

node_name() {
    case "$1" in
        1 | n1) echo n1 ;;
        2 | n2) echo n2 ;;
        3 | n3) echo n3 ;;
        *) die "unknown node '$1' (n1, n2 or n3, or 1, 2 or 3)" ;;
    esac
}

index() { echo "${1#n}"; }
client_port() { echo "424$(index "$1")"; }
route_port() { echo "624$(index "$1")"; }
http_port() { echo "824$(index "$1")"; }
conf() { echo "$DIR/$1/nats.conf"; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Writes node N's config (again on every start, so an old directory gets today's settings).
prepare() {
    local node="$1" other routes=()
    for other in "${NODES[@]}"; do
        [ "$other" = "$node" ] || routes+=("nats-route://127.0.0.1:$(route_port "$other")")
    done
    mkdir -p "$DIR/$node/store"
    local joined
    joined="$(IFS=,; echo "${routes[*]}")"
    cat >"$(conf "$node")" <<EOF
server_name: $node
debug: ${NATS_CLUSTER_DEBUG:-false}
listen: 127.0.0.1:$(client_port "$node")
http: 127.0.0.1:$(http_port "$node")
pid_file: "$DIR/$node/pid"
jetstream {
  store_dir: "$DIR/$node/store"
}
cluster {
  name: retry-test
  listen: 127.0.0.1:$(route_port "$node")
  routes: [${joined//,/, }]
}
EOF
}

# The pid of the node's server, if it runs: the pid file's pid, if that process is a
# nats-server started with this node's config (the file outlives a killed server).
node_pid() {
    local file="$DIR/$1/pid" pid cmdline
    [ -f "$file" ] || return 1
    pid="$(cat "$file" 2>/dev/null)" || return 1
    [ -n "$pid" ] || return 1
    cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" || return 1
    case "$cmdline" in
        *nats-server*" -c $(conf "$1") "*) echo "$pid" ;;
        *) return 1 ;;
    esac
}

running() { node_pid "$1" >/dev/null; }

# Whether a process is alive: a zombie is not (this machine's init reaps the detached servers
# only after a second or so).
alive() {
    local stat
    stat="$(cat 2>/dev/null "/proc/$1/stat")" || return 1
    stat="${stat##*) }"
    [ "${stat%% *}" != Z ]
}

# Starts a node's server in the background (its own session, output to its log) without
# waiting for it.
launch_node() {
    local node="$1" port
    running "$node" && return 0
    port="$(client_port "$node")"
    if port_open "$port"; then
        die "127.0.0.1:$port is taken, but not by $node of $DIR"
    fi
    prepare "$node"
    rm -f "$DIR/$node/pid"
    echo "--- $(date '+%F %T') starting $node" >>"$DIR/$node/log"
    setsid "$NATS_SERVER" -c "$(conf "$node")" >>"$DIR/$node/log" 2>&1 </dev/null &
}

# Waits until a node's server listens for clients (and has written its pid file).
wait_listening() {
    local node="$1" port
    port="$(client_port "$node")"
    for _ in $(seq 1 150); do
        if running "$node" && port_open "$port"; then
            return 0
        fi
        sleep 0.2
    done
    tail -n 20 "$DIR/$node/log" >&2 || true
    die "$node did not start listening on 127.0.0.1:$port within 30 s; see $DIR/$node/log"
}

jsz() { curl -fsS --max-time 2 "http://127.0.0.1:$(http_port "$1")/jsz" 2>/dev/null; }

# The meta leader a node's /jsz names ("" if none).
leader_of() {
    jsz "$1" | grep -o '"leader": *"[^"]*"' | head -n 1 | sed 's/.*"\([^"]*\)"$/\1/'
}

# Whether a node's /healthz answers 200: its JetStream is current with the meta leader and
# with every stream and consumer it holds (with a second argument of `?js-server-only=true`,
# with the meta leader only).
healthy() {
    curl -fsS --max-time 2 -o /dev/null "http://127.0.0.1:$(http_port "$1")/healthz${2:-}" 2>/dev/null
}

# JetStream is ready when every node is healthy and names the same leader, which is one of
# ours and lists the two others as replicas of the meta group, both current. (/jsz's
# cluster_size stays 3 with a node down, and a node keeps naming a killed leader for a
# couple of seconds, so neither alone says that the three see each other.)
js_ready() {
    local node leader="" l body
    for node in "${NODES[@]}"; do
        healthy "$node" || return 1
        l="$(leader_of "$node")"
        [ -n "$l" ] || return 1
        if [ -z "$leader" ]; then leader="$l"; elif [ "$l" != "$leader" ]; then return 1; fi
    done
    case "$leader" in n1 | n2 | n3) ;; *) return 1 ;; esac
    body="$(jsz "$leader")" || return 1
    grep -q '"cluster_size": *3' <<<"$body" || return 1
    [ "$(grep -c '"current": *true' <<<"$body")" = 2 ]
}

wait_js_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT))
    until js_ready; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            local node
            for node in "${NODES[@]}"; do
                echo "--- $node /jsz meta_cluster:" >&2
                jsz "$node" | sed -n '/"meta_cluster"/,$p' >&2 || echo "(no answer)" >&2
            done
            die "JetStream did not become ready within ${READY_TIMEOUT} s (a meta leader with both other nodes current); see $DIR/n*/log"
        fi
        sleep 0.5
    done
}

# Whether a node's JetStream is current with the meta leader, whatever the streams and
# consumers it holds (see META_ONLY).
meta_current() {
    healthy "$1" '?js-server-only=true' && [ -n "$(leader_of "$1")" ]
}

# After `start`: the node's JetStream is current with the meta leader again (only possible,
# and only waited for, when another node runs).
wait_node_current() {
    local node="$1" other
    for other in "${NODES[@]}"; do
        if [ "$other" != "$node" ] && running "$other"; then
            local deadline=$((SECONDS + READY_TIMEOUT))
            until meta_current "$node"; do
                [ "$SECONDS" -lt "$deadline" ] ||
                    die "$node listens, but its JetStream is not current with a meta leader after ${READY_TIMEOUT} s; see $DIR/$node/log"
                sleep 0.5
            done
            return 0
        fi
    done
}

require_tools() {
    [ -x "$NATS_SERVER" ] || die "no nats-server at '$NATS_SERVER' (set NATS_SERVER)"
    command -v curl >/dev/null || die "curl is needed for the readiness checks"
    command -v setsid >/dev/null || die "setsid (util-linux) is needed"
}

up() {
    require_tools
    mkdir -p "$DIR"
    local node
    for node in "${NODES[@]}"; do
        launch_node "$node"
    done
    for node in "${NODES[@]}"; do
        wait_listening "$node"
    done
    wait_js_ready
    echo "cluster up (meta leader $(leader_of n1)): $(urls)"
}

# Sends a signal to a node and waits up to $3 tenths of a second for it to exit.
signal_and_wait() {
    local node="$1" sig="$2" tenths="$3" pid
    pid="$(node_pid "$node")" || return 0
    kill "-$sig" "$pid" 2>/dev/null || true
    for _ in $(seq 1 "$tenths"); do
        alive "$pid" || return 0
        sleep 0.1
    done
    return 1
}

down() {
    local node pids=() pid
    for node in "${NODES[@]}"; do
        if pid="$(node_pid "$node")"; then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    for pid in "${pids[@]}"; do
        for _ in $(seq 1 50); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            echo "pid $pid ignored SIGTERM for 5 s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do alive "$pid" || break; sleep 0.1; done
        fi
    done
    rm -rf "$DIR"
    echo "cluster down"
}

status() {
    local node pid any=0 state leader
    for node in "${NODES[@]}"; do
        if pid="$(node_pid "$node")"; then
            any=1
            leader="$(leader_of "$node" || true)"
            state="running (pid $pid, meta leader ${leader:-none yet})"
        else
            state="not running"
        fi
        printf '%s  client 127.0.0.1:%s  route 127.0.0.1:%s  monitor 127.0.0.1:%s  %s\n' \
            "$node" "$(client_port "$node")" "$(route_port "$node")" "$(http_port "$node")" "$state"
    done
    [ "$any" = 1 ] || die "no node is running"
}

urls() {
    local out=() node
    for node in "${NODES[@]}"; do
        out+=("nats://127.0.0.1:$(client_port "$node")")
    done
    (IFS=,; echo "${out[*]}")
}

cmd="${1:-}"
case "$cmd" in
    up) up ;;
    down) down ;;
    stop)
        node="$(node_name "${2:-}")"
        running "$node" || die "$node is not running"
        signal_and_wait "$node" TERM 300 || die "$node did not exit within 30 s of SIGTERM"
        ;;
    kill)
        node="$(node_name "${2:-}")"
        running "$node" || die "$node is not running"
        signal_and_wait "$node" KILL 50 || die "$node survived SIGKILL for 5 s"
        ;;
    start)
        node="$(node_name "${2:-}")"
        require_tools
        [ -d "$DIR/$node" ] || die "$node has no directory in $DIR; run 'up' first"
        launch_node "$node"
        wait_listening "$node"
        wait_node_current "$node"
        ;;
    status) status ;;
    urls) urls ;;
    *) sed -n '2,22p' "$0" >&2; exit 2 ;;
esac
