#!/usr/bin/env bash
# A private single RabbitMQ node for the chaos runs, beside the machine's broker: the chaos
# stops and starts its application and closes its connections, which must never happen to
# the shared broker on 5672.
#
#   stress/chaos-node.sh up [OWNER_PID]  start the node (a fresh one); with OWNER_PID, a watcher
#                                       stops it and deletes its data once that process exits,
#                                       unless a later `up` has replaced it by then
#   stress/chaos-node.sh down            stop it and delete its data (its log is kept in
#                                       /tmp/retry-chaos-$CHAOS_PORT.last.log)
#   stress/chaos-node.sh stop-app        rabbitmqctl stop_app (the node keeps running)
#   stress/chaos-node.sh start-app       rabbitmqctl start_app, and wait until it serves
#   stress/chaos-node.sh list            one line per client connection: its Erlang pid, the
#                                       client's port and the connection's name, tab-separated
#   stress/chaos-node.sh close-peers PORT...
#                                       close the connections whose client ports these are
#   stress/chaos-node.sh url             the AMQP URL of the node
#
# CHAOS_PORT picks the node (default 5690): it listens for AMQP 0-9-1 and 1.0 on
# 127.0.0.1:$CHAOS_PORT, for distribution on $CHAOS_PORT + 20000, is called
# rchaos$CHAOS_PORT@localhost, and keeps its config, data and logs in
# /tmp/retry-chaos-$CHAOS_PORT (owned by the rabbitmq user, as the server script requires).
# Ports 5681-5683 belong to stress/cluster.sh's cluster, 5675-5676 to stress/tls-node.sh's node;
# the machine's node is never named.
set -euo pipefail

PORT="${CHAOS_PORT:-5690}"
case "$PORT" in
    5672 | 5675 | 5676 | 5681 | 5682 | 5683) echo "chaos-node.sh: port $PORT is not ours" >&2; exit 2 ;;
esac
DIST_PORT=$((PORT + 20000))
NODE="rchaos$PORT@localhost"
DIR="/tmp/retry-chaos-$PORT"
LOCK="/tmp/retry-chaos-$PORT.lock"
RMQ_BIN=/usr/lib/rabbitmq/bin

die() { echo "chaos-node.sh: $*" >&2; exit 1; }

as_rabbitmq() {
    if [ "$(id -u)" = "$(id -u rabbitmq)" ]; then
        env HOME=/var/lib/rabbitmq "$@"
    else
        runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq "$@"
    fi
}

ctl() { as_rabbitmq "$RMQ_BIN/rabbitmqctl" -n "$NODE" "$@"; }

running() { ctl -q status >/dev/null 2>&1; }

prepare() {
    rm -rf "$DIR"
    mkdir -p "$DIR/mnesia" "$DIR/log"
    cat >"$DIR/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:$PORT
loopback_users = none
EOF
    echo '[rabbitmq_amqp1_0].' >"$DIR/enabled_plugins"
    cat >"$DIR/rabbitmq-env.conf" <<EOF
NODENAME=$NODE
NODE_PORT=$PORT
DIST_PORT=$DIST_PORT
ERL_EPMD_ADDRESS=127.0.0.1
MNESIA_BASE=$DIR/mnesia
LOG_BASE=$DIR/log
CONFIG_FILE=$DIR/rabbitmq.conf
ENABLED_PLUGINS_FILE=$DIR/enabled_plugins
PID_FILE=$DIR/pid
# One scheduler: the machine has two cores and its own broker.
SERVER_ADDITIONAL_ERL_ARGS="+S 1:1 +A 4"
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
    chown -R rabbitmq:rabbitmq "$DIR"
}

wait_up() {
    for _ in $(seq 1 120); do
        if ctl -q await_startup >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    die "$NODE did not start; see $DIR/log"
}

stop_node() {
    if running; then
        ctl -q stop >/dev/null 2>&1 || true
    fi
    local pid
    pid="$(cat "$DIR/pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -9 "$pid" 2>/dev/null || true
    fi
    # The node's log outlives it, for reading after a run.
    cat "$DIR/log/$NODE.log" >"/tmp/retry-chaos-$PORT.last.log" 2>/dev/null || true
    rm -rf "$DIR"
}

up() {
    local owner="${1:-}"
    # Names this start of the node, so that an owner's watcher takes down its own node and
    # never one a later owner started after it (a run that follows another at once).
    local token="$$-$(date +%s%N)"
    [ -x "$RMQ_BIN/rabbitmq-server" ] || die "no RabbitMQ server at $RMQ_BIN"
    id -u rabbitmq >/dev/null 2>&1 || die "no rabbitmq user"
    (
        # A watcher of an earlier owner may still be taking its node down.
        flock 9
        stop_node
        prepare
        echo "$token" >"$DIR/token"
        # Without the lock's descriptor: the node's VM would hold the lock for its lifetime.
        as_rabbitmq env RABBITMQ_CONF_ENV_FILE="$DIR/rabbitmq-env.conf" \
            "$RMQ_BIN/rabbitmq-server" -detached 9>&-
        wait_up
    ) 9>"$LOCK"
    if [ -n "$owner" ]; then
        # Detached from the caller's process group and standard streams, so that it outlives
        # the caller and never holds a pipe of its open.
        setsid nohup bash -c '
            while kill -0 "$1" 2>/dev/null; do sleep 1; done
            CHAOS_PORT="$2" exec "$3" down-if "$4"
        ' watcher "$owner" "$PORT" "$(readlink -f "$0")" "$token" >/dev/null 2>&1 </dev/null &
    fi
    url
}

url() { echo "amqp://guest:guest@127.0.0.1:$PORT/%2f"; }

case "${1:-}" in
    up) up "${2:-}" ;;
    down) ( flock 9; stop_node ) 9>"$LOCK"; echo "$NODE down" ;;
    # The watcher's down: only the node that `up` started with this token.
    down-if)
        (
            flock 9
            if [ "$(cat "$DIR/token" 2>/dev/null)" = "${2:-}" ]; then
                stop_node
            fi
        ) 9>"$LOCK"
        ;;
    stop-app) ctl -q stop_app ;;
    start-app) ctl -q start_app && wait_up ;;
    list) ctl -q list_connections pid peer_port name --no-table-headers ;;
    close-peers)
        # AMQP 0-9-1 connections are closed by the broker (connection.close, 320); the AMQP
        # 1.0 plugin of 3.10 lists none of its connections, so those whose client port is
        # left have their reader process killed, which drops the socket from the broker's side.
        shift
        left=" $* "
        closed=0
        while IFS=$'\t' read -r pid peer _; do
            case "$left" in
                *" $peer "*)
                    if ctl -q close_connection "$pid" "chaos: forced close" >/dev/null 2>&1; then
                        closed=$((closed + 1))
                        left="${left/ $peer / }"
                    fi
                    ;;
            esac
        done < <(ctl -q list_connections pid peer_port --no-table-headers)
        killed=0
        ports="$(echo $left | tr ' ' ',')"
        if [ -n "$ports" ]; then
            killed="$(ctl -q eval "Ports = [$ports], length([begin {connected, Owner} = erlang:port_info(P, connected), exit(Owner, kill) end || P <- erlang:ports(), erlang:port_info(P, name) =:= {name, \"tcp_inet\"}, {ok, {_, Peer}} <- [inet:peername(P)], lists:member(Peer, Ports)])." )"
        fi
        echo "closed=$closed killed=$killed"
        ;;
    url) url ;;
    *) sed -n '2,21p' "$0" >&2; exit 2 ;;
esac
