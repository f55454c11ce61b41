#!/usr/bin/env bash
# A local three-node RabbitMQ cluster for the cluster tests, beside the machine's own broker.
#
#   stress/cluster.sh up            start rtest1..3@localhost and cluster them (idempotent)
#   stress/cluster.sh down          stop them and delete their data
#   stress/cluster.sh stop NODE     stop one gracefully (rabbitmqctl -n NODE stop)
#   stress/cluster.sh kill NODE     kill -9 one node's Erlang VM
#   stress/cluster.sh start NODE    start a stopped or killed node again; it rejoins by itself
#   stress/cluster.sh start-all     start every stopped node at once (after all went down)
#   stress/cluster.sh status        the cluster as rtest1 (or any running node) sees it
#   stress/cluster.sh urls          the AMQP node list, comma-separated, for AMQP_CLUSTER_URLS
#
# NODE is rtest1, rtest2 or rtest3 (or the full rtest1@localhost). Node N listens for AMQP
# (and AMQP 1.0) on 127.0.0.1:568N and for distribution on 2568N; its data, logs, config and
# enabled-plugins file live under $RTEST_CLUSTER_DIR (default /tmp/retry-test-cluster), owned by
# the rabbitmq user. The machine's own node (rabbit@localhost, 5672, 25672) is never touched:
# every command here names an rtest node explicitly.
set -euo pipefail

DIR="${RTEST_CLUSTER_DIR:-/tmp/retry-test-cluster}"
NODES=(rtest1 rtest2 rtest3)
RMQ_BIN=/usr/lib/rabbitmq/bin

die() { echo "cluster.sh: $*" >&2; exit 1; }

# Runs a command as the rabbitmq user, whose home holds the Erlang cookie every node shares.
as_rabbitmq() {
    if [ "$(id -u)" = "$(id -u rabbitmq)" ]; then
        env HOME=/var/lib/rabbitmq "$@"
    else
        runuser -u rabbitmq -- env HOME=/var/lib/rabbitmq "$@"
    fi
}

short() {
    local n="${1%@localhost}"
    case "$n" in
        rtest1 | rtest2 | rtest3) echo "$n" ;;
        *) die "unknown node '$1' (rtest1, rtest2 or rtest3)" ;;
    esac
}

index() { echo "${1#rtest}"; }

ctl() {
    local node="$1"
    shift
    as_rabbitmq "$RMQ_BIN/rabbitmqctl" -n "$node@localhost" "$@"
}

# Writes node N's config, env and plugins files (once).
prepare() {
    local node="$1" i
    i="$(index "$node")"
    local home="$DIR/$node"
    if [ ! -d "$home" ]; then
        mkdir -p "$home/mnesia" "$home/log"
        cat >"$home/rabbitmq.conf" <<EOF
listeners.tcp.1 = 127.0.0.1:568$i
loopback_users = none
cluster_name = retry-test-cluster
# Give up a partition's minority instead of serving stale data.
cluster_partition_handling = pause_minority
EOF
        # At-least-once dead-lettering re-sends what its target did not confirm after this
        # long (3 minutes by default): a retry whose target queue lost its leader waits that
        # long. 10 s keeps the failover tests short.
        echo '[{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 10000}]}].' >"$home/advanced.config"
        echo '[rabbitmq_amqp1_0].' >"$home/enabled_plugins"
        cat >"$home/rabbitmq-env.conf" <<EOF
NODENAME=$node@localhost
NODE_PORT=568$i
DIST_PORT=2568$i
ERL_EPMD_ADDRESS=127.0.0.1
MNESIA_BASE=$home/mnesia
LOG_BASE=$home/log
CONFIG_FILE=$home/rabbitmq.conf
ADVANCED_CONFIG_FILE=$home/advanced.config
ENABLED_PLUGINS_FILE=$home/enabled_plugins
PID_FILE=$home/pid
# One scheduler each: three extra nodes share two cores with the machine's own broker.
SERVER_ADDITIONAL_ERL_ARGS="+S 1:1 +A 4"
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
EOF
        chown -R rabbitmq:rabbitmq "$DIR"
    fi
}

running() { ctl "$1" -q status >/dev/null 2>&1; }

# Starts a node's VM without waiting for it: after the whole cluster went down, each node
# waits for its peers before it boots, so they are started together.
launch_node() {
    local node="$1"
    prepare "$node"
    if running "$node"; then
        return 0
    fi
    as_rabbitmq env RABBITMQ_CONF_ENV_FILE="$DIR/$node/rabbitmq-env.conf" \
        "$RMQ_BIN/rabbitmq-server" -detached
}

start_node() {
    launch_node "$1"
    wait_node "$1"
}

start_all() {
    for node in "${NODES[@]}"; do
        launch_node "$node"
    done
    for node in "${NODES[@]}"; do
        wait_node "$node"
    done
}

wait_node() {
    local node="$1"
    for _ in $(seq 1 90); do
        if ctl "$node" -q await_startup >/dev/null 2>&1; then
            return 0
        fi
        sleep 1
    done
    die "$node@localhost did not start; see $DIR/$node/log"
}

# The OS pid of a node's Erlang VM, from its pid file.
vm_pid() {
    local file="$DIR/$1/pid"
    [ -f "$file" ] && cat "$file"
}

member() {
    # Whether $1 is a running member of the cluster $2 belongs to.
    ctl "$2" -q cluster_status --formatter json 2>/dev/null |
        grep -q "\"$1@localhost\""
}

up() {
    mkdir -p "$DIR"
    chown rabbitmq:rabbitmq "$DIR"
    start_all
    for node in rtest2 rtest3; do
        if ! member "$node" rtest1; then
            {
                ctl "$node" -q stop_app &&
                    ctl "$node" -q reset &&
                    ctl "$node" -q join_cluster rtest1@localhost &&
                    ctl "$node" -q start_app
            } >"$DIR/$node/join.log" 2>&1 || { cat "$DIR/$node/join.log" >&2; die "$node could not join"; }
            wait_node "$node"
        fi
    done
    ctl rtest1 -q cluster_status --formatter json | grep -q '"rtest3@localhost"' ||
        die "the nodes did not form one cluster"
    echo "cluster up: $(urls)"
}

down() {
    for node in "${NODES[@]}"; do
        if running "$node"; then
            ctl "$node" -q stop >/dev/null 2>&1 || true
        fi
        local pid
        pid="$(vm_pid "$node" || true)"
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    rm -rf "$DIR"
    echo "cluster down"
}

urls() {
    local out=()
    for node in "${NODES[@]}"; do
        out+=("amqp://guest:guest@127.0.0.1:568$(index "$node")/%2f")
    done
    (IFS=,; echo "${out[*]}")
}

cmd="${1:-}"
case "$cmd" in
    up) up ;;
    down) down ;;
    stop)
        node="$(short "${2:-}")"
        ctl "$node" -q stop
        ;;
    kill)
        node="$(short "${2:-}")"
        pid="$(vm_pid "$node")" || die "no pid file for $node"
        kill -9 "$pid"
        # The VM is gone once its pid is.
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        ;;
    start)
        node="$(short "${2:-}")"
        start_node "$node"
        ;;
    start-all) start_all ;;
    status)
        for node in "${NODES[@]}"; do
            if running "$node"; then
                ctl "$node" cluster_status
                exit 0
            fi
        done
        die "no rtest node is running"
        ;;
    urls) urls ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
